"""The controller's links to its storage units: one :class:`~tqtx.wire.peer.Peer` per
registered unit, and the calls the controller makes to several of them at once."""
from __future__ import annotations

from ..wire.peer import Peer, call_many


class UnitPeers(dict[int, Peer]):
    """``{unit id: Peer}`` of the registered units (REGISTER_UNIT replaces a unit's peer)."""

    def call(self, calls: list[tuple], *, timeout: float) -> list:
        """``calls``: ``(unit, op, body)`` or ``(unit, op, body, request ID)``, of registered
        units. Every reply or exception, in order (no call raises)."""
        return call_many([(self[c[0]], *c[1:]) for c in calls], raise_first=False,
                         timeout=timeout)

    def answers(self, uid: int) -> bool:
        """Whether unit ``uid`` answers a PING (a unit that does not is down)."""
        try:
            self[uid].call("PING", timeout=2)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False
