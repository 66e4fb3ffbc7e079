"""REGISTER_UNIT and re-attach: a unit reports what it holds to (a restarted) controller.

:class:`UnitAttachment` is the role of :class:`tqtx.storage.unit.StorageUnit` that does this
(it reads the unit's server, rows, gens, restore worker and checkpoint handlers, and drops
rows through its DROP_ROWS handler). The held report is built from a snapshot of the rows;
the controller answers which of them it does not know (``drop``) and which staged restores
it does not hold open (``drop_staged``). Only the request loop writes the unit's rows, so
the drop runs there (:meth:`Server.call_soon`), sparing every index a put or apply wrote
after the snapshot. A heartbeat thread PINGs the controller and registers again when the
reply names a new incarnation. See docs/reliability.md.
"""
from __future__ import annotations

import logging
import os
import threading

from .. import faults
from ..wire.peer import Peer
from .checkpoints import CheckpointSwitch
from .memory import pause

log = logging.getLogger("tqtx.unit")


def heartbeat_period() -> float:
    """Seconds between a unit's PINGs to its controller (``TQTX_UNIT_HEARTBEAT``, default 1;
    0 or less: no heartbeat)."""
    return float(os.environ.get("TQTX_UNIT_HEARTBEAT", "1.0"))


def held_report(rows: dict[int, dict], gens: dict[int, int]) -> dict:
    """``{"indexes", "gens", "field_sets", "fields_of"}`` of a rows snapshot (and its
    generations); field sets sorted."""
    by_order: dict[tuple, int] = {}   # a row's field names in insertion order -> set id
    by_set: dict[tuple, int] = {}     # sorted field names -> set id
    indexes, fields_of = [], []
    for idx, row in rows.items():
        order = tuple(row)
        sid = by_order.get(order)
        if sid is None:
            sid = by_order[order] = by_set.setdefault(tuple(sorted(order)), len(by_set))
        indexes.append(idx)
        fields_of.append(sid)
    return {"indexes": indexes, "gens": list(map(gens.__getitem__, indexes)),
            "field_sets": [list(s) for s in by_set], "fields_of": fields_of}


class UnitAttachment:
    """Unit side of REGISTER_UNIT for :class:`~tqtx.storage.unit.StorageUnit` ``unit``: the
    held report, applying the reply, the heartbeat. ``incarnation`` is the controller
    incarnation registered with; ``write_watch`` holds one set per registration in flight,
    the indexes written since its snapshot (the request loop adds to them through
    :meth:`note_writes`)."""

    def __init__(self, unit):
        self.unit = unit
        self.incarnation: int | None = None
        self.write_watch: list[set] = []  # replaced, never changed in place: the loop reads it
        self._watch_lock = threading.Lock()
        self.stopped = threading.Event()  # set when the unit stops serving: no more beats
        self._register_lock = threading.Lock()

    def note_writes(self, *indexes) -> None:
        """Called by the request loop after a put or apply while a registration is in flight."""
        for watch in self.write_watch:
            for part in indexes:
                watch.update(part)

    def register(self, timeout: float = 60.0, peer: Peer | None = None) -> dict:
        """Send REGISTER_UNIT with a fresh held report; apply the reply's drops on the loop.

        Returns the reply. The drops are queued to the request loop (they run before it
        reads its next request, or on its first turn when it has not started yet)."""
        own = peer is None
        peer = self.unit.controller() if own else peer
        try:
            with self._register_lock:
                return self._register(peer, timeout)
        finally:
            if own:
                peer.close()

    def _register(self, peer: Peer, timeout: float) -> dict:
        written: set = set()
        # Watch first, then copy: a write the copy misses is always in the watch. The
        # copy is one C-level dict copy under the GIL, so it never sees a half-done
        # insert; row dicts are never changed once stored (puts copy on write), so
        # reading their field names off the loop is safe.
        with self._watch_lock:
            self.write_watch = [*self.write_watch, written]
        unit = self.unit
        rows = unit.rows
        try:
            # rows and gens change together only on the loop: both copies are taken under
            # the GIL in one go, so a row and its generation always match
            snapshot, gens = dict(rows), dict(unit.gens)
            staged = unit.restore.staged_ids()
            faults.hit("unit.register.after_snapshot")
            # "attached": this process served an earlier controller, so the deployment it
            # belongs to is alive even if it holds no row (tag-only keys, all cleared)
            body = {"unit_id": unit.unit_id, "address": unit.address,
                    "attached": self.incarnation is not None,
                    "held": held_report(snapshot, gens), "staged": staged,
                    "checkpoint": {"applied": unit.checkpoints.applied,
                                   "staged": list(unit.checkpoints.staged),
                                   "failed": unit.checkpoints.failed}}
            if unit.replayed is not None:  # the first registration after a replayed row log
                body["replayed"] = unit.replayed
            snapshot = gens = None
            reply = peer.call("REGISTER_UNIT", body, timeout=timeout) or {}
        except BaseException:
            unit.server.call_soon(lambda: self._unwatch(written))
            raise
        self.incarnation = reply.get("incarnation")
        unit.replayed = None
        if reply.get("apply_checkpoint"):
            # a restarted controller rolls a decided checkpoint load forward: switch (after
            # reading the rows again, if this unit restarted before it switched), then report
            # again (the next heartbeat registers: -1 matches no incarnation)
            switch = CheckpointSwitch(reply["apply_checkpoint"], int(reply["gen_base"]))
            self.incarnation = -1
            if reply.get("stage_checkpoint") is not None and \
                    not unit.checkpoints.stage_again(reply["stage_checkpoint"]):
                unit.server.call_soon(lambda: self._unwatch(written))
                return reply
            unit.server.call_soon(lambda: (self._unwatch(written),
                                           unit.checkpoints.switch(switch),
                                           unit.write_log()))
            return reply
        drop, drop_staged = reply.get("drop") or [], reply.get("drop_staged") or []
        log.info("unit %d registered with controller incarnation %s: holds %d rows, %d staged "
                 "restores; %d rows, %d restores to drop", unit.unit_id, self.incarnation,
                 len(body["held"]["indexes"]), len(staged), len(drop), len(drop_staged))
        unit.server.call_soon(lambda: self._apply_register_reply(rows, written, drop,
                                                                 drop_staged))
        return reply

    def _unwatch(self, written: set) -> None:
        with self._watch_lock:
            self.write_watch = [w for w in self.write_watch if w is not written]

    def _apply_register_reply(self, rows: dict, written: set, drop: list,
                              drop_staged: list) -> None:
        """On the request loop: drop the rows (``[index, generation]``) the controller does
        not know, except those written since the snapshot, and the staged restores it does
        not hold open."""
        self._unwatch(written)
        unit = self.unit
        if drop and unit.rows is not rows:
            log.warning("unit %d: a checkpoint replaced its rows while registering; not "
                        "dropping the %d rows the controller did not know", unit.unit_id,
                        len(drop))
        elif drop:
            kept = sum(1 for i, _ in drop if i in written)
            gone = [(i, g) for i, g in drop if i not in written]
            done = unit.drop_rows({"indexes": [i for i, _ in gone],
                                   "gens": [g for _, g in gone]}, None)
            log.info("unit %d dropped %d rows the controller does not know (kept %d written "
                     "since its report)", unit.unit_id, done["dropped"], kept)
            unit.write_log()
        for rid in drop_staged:
            unit.restore.drop_staged({"restore_id": rid}, None)

    # ---------------------------------------------------------------- heartbeat
    def start_heartbeat(self, period: float | None = None) -> threading.Thread | None:
        """Start the daemon thread that re-registers with a restarted controller."""
        period = heartbeat_period() if period is None else period
        if period <= 0:
            return None
        t = threading.Thread(target=self._heartbeat, args=(period,), daemon=True,
                             name=f"unit{self.unit.unit_id}-heartbeat")
        t.start()
        return t

    def _heartbeat(self, period: float) -> None:
        wait = max(1.0, 2 * period)  # per PING; a gone controller is noticed within that
        unit = self.unit
        peer = Peer(unit.controller_address, "controller", timeout=wait,
                    curve=unit.client_curve, connect_timeout=wait)
        trouble = ""  # what went wrong at the last beat: logged once, not once per beat
        try:
            while not pause(self.stopped, period):
                now, why = self._beat(peer, wait)
                if now and now != trouble:
                    log.warning("unit %d: %s; retrying every %gs", unit.unit_id, why, period)
                elif trouble and not now:
                    log.info("unit %d: controller at %s reachable and registered again",
                             unit.unit_id, unit.controller_address)
                trouble = now
        finally:
            peer.close()

    def _beat(self, peer: Peer, wait: float) -> tuple[str, str]:
        """One PING, and REGISTER_UNIT if the controller is a new incarnation. Returns
        ("", "") or the kind of failure and what happened."""
        where = f"controller at {self.unit.controller_address}"
        try:
            incarnation = (peer.call("PING", timeout=wait) or {}).get("incarnation")
        except Exception as exc:
            # the class only: the message's "is gone" would read as a failed report in the log
            return "ping", f"{where} unreachable ({type(exc).__name__} on PING)"
        if incarnation is None or incarnation == self.incarnation:
            return "", ""
        log.info("unit %d: %s is incarnation %s (registered with %s): registering again",
                 self.unit.unit_id, where, incarnation, self.incarnation)
        try:
            self.register(timeout=max(30.0, wait), peer=peer)
        except Exception as exc:
            return "register", f"{where} did not take REGISTER_UNIT ({type(exc).__name__}: {exc})"
        if self.incarnation is None:  # a reply without one: do not register every beat
            self.incarnation = incarnation
        return "", ""
