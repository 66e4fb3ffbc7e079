"""Startup recovery replay for the controller journal and the dump journals it points at."""
from __future__ import annotations

from sqlalchemy.exc import SQLAlchemyError

from ..dump.publish import dump_lock, recover_publications
from ..errors import DumpFormatError
from ..paths import find_dump_journal
from .store import RESTART_REASON, ControllerJournal, DumpJournal

__all__ = ["recover_controller_journal", "recover_publications"]


def recover_controller_journal(journal: ControllerJournal, *, incarnation_id: int) -> list[dict]:
    """Finish every restore a previous incarnation left non-final as ``aborted``.

    Non-final claims become ``dropped`` (done by ``finish_restore``). Before that, for each
    such restore whose dump journal exists (beside the dump, or in this controller's state dir
    for a read-only dump), the dump journal's restore row is marked
    ``aborted`` and the dump's unfinished publications are settled, under the dump lock
    (a failure there is recorded as ``dump-recovery-failed`` and does not stop the replay). Every action is
    journaled with ``record_recovery`` and returned as ``{kind, target, action, detail}``.
    Must not be called while holding a dump lock of one of these dumps.
    """
    actions: list[dict] = []

    def act(kind: str, target: str, action: str, detail: str) -> None:
        journal.record_recovery(incarnation_id=incarnation_id, kind=kind, target=target,
                                action=action, detail=detail)
        actions.append({"kind": kind, "target": target, "action": action, "detail": detail})

    dumps_done: set[str] = set()
    for r in journal.unresolved_restores():
        if r["incarnation_id"] == incarnation_id:
            continue
        rid, dump_dir = r["restore_id"], r["dump_dir"]
        # The dump side goes first: if we crash in between, the controller row is still
        # non-final and the next replay redoes both sides (each is idempotent).
        try:
            dj_path = find_dump_journal(dump_dir, journal.state_dir)
        except OSError as exc:
            dj_path = None
            act("restore", rid, "dump-recovery-failed", f"dump {dump_dir}: {exc!r}")
        if dj_path is not None:
            try:
                with dump_lock(dump_dir, state_dir=journal.state_dir), \
                        DumpJournal(dump_dir, path=dj_path) as dj:
                    row = dj.get_restore(rid)
                    if row is not None and row["state"] == "reading":
                        dj.finish_restore(rid, "aborted")
                        act("restore", rid, "dump-journal-aborted", f"dump {dump_dir}")
                    if dump_dir not in dumps_done:
                        dumps_done.add(dump_dir)
                        for a in recover_publications(dump_dir, dj):
                            act(a["kind"], a["target"], a["action"], a["detail"])
            except (OSError, SQLAlchemyError, DumpFormatError) as exc:
                # An unreachable dump (unmounted, permissions) must not stop the controller
                # from starting; the dump is recovered by the next writer or by hand.
                act("restore", rid, "dump-recovery-failed", f"dump {dump_dir}: {exc!r}")
        live_units = [u["unit_id"] for u in r["units"]
                      if u["state"] not in ("applied", "failed", "dropped")]
        journal.finish_restore(rid, "aborted", RESTART_REASON)
        act("restore", rid, "aborted",
            f"was {r['state']} under incarnation {r['incarnation_id']}; "
            f"dropped units: {','.join(map(str, live_units)) or 'none'}")
    return actions
