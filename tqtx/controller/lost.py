"""Keys whose rows are gone: listing them, and dropping a dead deployment's buffer.

A key is *lost* when the unit that held its row came back without it (the row is named by
:class:`~tqtx.errors.RowsLostError` on read). A plain ``LIST`` leaves lost keys out, so
TransferQueue-shaped code that samples ``kv_list`` never picks a row it cannot read;
``LIST`` with ``lost`` returns only them, with their fields and unit, for re-generation.

After the whole job crashed (controller and every unit gone), the replayed metadata names
rows no process holds any more. When every unit of the new start reports that it holds no
row at all and none of them served an earlier controller (each is a new process), the
buffer is dropped: the controller starts empty, as TransferQueue does, logs
how many keys of the dead deployment went, and journals a recovery event of kind
``buffer`` (``tqtx journal show --state-dir D``). A controller that restarted alone finds
its units still holding their rows and keeps everything.
"""
from __future__ import annotations

import logging

from .. import states as st
from ..journal.meta import MetaChange

log = logging.getLogger("tqtx.controller")


def lost_keys(parts) -> dict:
    """``{partition: {key: {"tag", "fields", "unit"}}}`` of the lost keys of ``parts``."""
    out = {}
    for p in parts:
        if not p.lost:
            continue
        by_index = {i: k for k, i in p.keys.items() if i in p.lost}
        out[p.pid] = {k: {"tag": p.tags.get(k, {}), "fields": sorted(p.fields.get(i, ())),
                          "unit": p.lost[i]} for i, k in sorted(by_index.items())}
    return out


class DeadBufferCheck:
    """Decides, once every unit has re-registered after a replay, whether the replayed
    buffer belongs to a dead deployment (no unit holds any row of it)."""

    def __init__(self, ctl):
        self.keys = sum(len(p.keys) for p in ctl.meta.partitions.values())
        self.partitions = len(ctl.meta.partitions)
        self.kept: set[int] = set()  # units that reported rows (or did not report)
        self.done = self.keys == 0

    def unit_reported(self, uid: int, held, attached: bool) -> None:
        """``attached``: the unit's process served an earlier controller of this
        deployment (it outlived a controller restart), so the deployment is alive."""
        if held is None or held.get("indexes") or attached:
            self.kept.add(uid)

    def settle(self, ctl) -> None:
        """Drop the buffer if no unit kept a row and nothing is being restored or
        switched to a checkpoint (those re-read their rows themselves)."""
        if self.done:
            return
        self.done = True
        if self.kept or ctl.restores or ctl.kv.checkpoint_load:
            return
        detail = (f"{self.keys} keys in {self.partitions} partitions of the previous "
                  f"deployment: no unit held any of their rows at this start (incarnation "
                  f"{ctl.incarnation})")
        ctl.kv.journal_meta("unit_lost", MetaChange(replace=True))
        ctl.meta.drop_all()
        ctl.journal.record_recovery(incarnation_id=ctl.incarnation, kind="buffer",
                                    target=ctl.state_dir, action=st.DROPPED, detail=detail)
        log.warning("startup: dropped %s; the buffer starts empty (load a checkpoint or a "
                    "dump to bring rows back)", detail)
