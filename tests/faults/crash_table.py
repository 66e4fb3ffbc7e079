"""The crash matrix as data: fault point x action -> the outcome every case must end in.

Read by test_crash_matrix.py (which runs each case and asserts its outcome) and by
test_fault_points.py (which ties every point named here to a ``faults.hit`` site in tqtx/).
The outcomes follow docs/reliability.md ("What survives what"): a dump is the complete old
or the complete new one, and only a dump that reported success must be the new one; a
restore is decided by the controller's journaled commit decision alone, rolled back before
it and rolled forward after it.
"""
from __future__ import annotations

DELAY = "delay:0.5"

# dump outcomes (the dump directory once the next access settled it)
OLD = "old dump kept"
NEW = "new dump published"
# restore outcomes (the controller journal once recover_data_load settled it)
ROLLED_BACK = "restore rolled back"
COMMITTED = "restore committed"
# metadata outcomes (the controller's metadata after it restarted alone)
META_KEPT = "metadata unchanged"
META_CHANGED = "change kept"


def server(kill: str, raise_: str, drop: str, delay: str) -> dict:
    """A request or reply point of a server: every action, ``drop-reply`` included."""
    return {"kill": kill, "raise": raise_, "drop-reply": drop, DELAY: delay}


def step(kill: str, raise_: str, delay: str) -> dict:
    """A point inside a step (client or server side): no reply of its own to drop."""
    return {"kill": kill, "raise": raise_, DELAY: delay}


# A delay never changes an outcome: the operation succeeds late, and a dump or restore that
# reported success is the new one. Every fault before the publication's point of no return
# (the rename of staging into place) keeps the old dump; a crash after that rename rolls the
# publication forward. RECORD_DUMP is the audit row written after the publication: best
# effort, the dump is published whatever happens to it.
DUMP = {
    "controller.request.DESCRIBE_ROWS_BY_KEY": server(OLD, OLD, OLD, NEW),
    "controller.reply.DESCRIBE_ROWS_BY_KEY": server(OLD, OLD, OLD, NEW),
    "unit.request.DUMP_ROWS": server(OLD, OLD, OLD, NEW),
    "unit.dump.before_write": step(OLD, OLD, NEW),
    "unit.dump.after_write": step(OLD, OLD, NEW),
    "unit.dump.after_fsync": step(OLD, OLD, NEW),
    "unit.reply.DUMP_ROWS": server(OLD, OLD, OLD, NEW),
    "client.dump.after_units_written": step(OLD, OLD, NEW),
    "publish.after_staging": step(OLD, OLD, NEW),
    "publish.after_written": step(OLD, OLD, NEW),
    "publish.after_synced": step(OLD, OLD, NEW),
    # old moved aside, the synced staging dir not yet renamed: a crash is rolled forward by
    # the next access (the staging dir is complete), an error in-process puts .old back
    "publish.after_old_moved": step(NEW, OLD, NEW),
    "publish.after_published": step(NEW, NEW, NEW),
    "publish.after_cleaned": step(NEW, NEW, NEW),
    "controller.request.RECORD_DUMP": server(NEW, NEW, NEW, NEW),
    "controller.reply.RECORD_DUMP": server(NEW, NEW, NEW, NEW),
}

# a background dump (block=False): the call, then result(); the tags the controller holds
# for it are taken once the units hold their snapshot, and a dump without them is not
# published
BACKGROUND_DUMP = {
    "controller.request.DESCRIBE_ROWS_BY_KEY": server(OLD, OLD, OLD, NEW),
    "unit.request.DUMP_SNAPSHOT": server(OLD, OLD, OLD, NEW),
    "unit.reply.DUMP_SNAPSHOT": server(OLD, OLD, OLD, NEW),
    "client.dump.after_snapshot": step(OLD, OLD, NEW),
    "controller.request.TAKE_DUMP_TAGS": server(OLD, OLD, OLD, NEW),
    "controller.reply.TAKE_DUMP_TAGS": server(OLD, OLD, OLD, NEW),
    "unit.request.DUMP_WAIT": server(OLD, OLD, OLD, NEW),
    "unit.dump.after_write": step(OLD, OLD, NEW),
    "publish.after_written": step(OLD, OLD, NEW),
    "publish.after_published": step(NEW, NEW, NEW),
}

# Before the commit decision a fault aborts the restore: the client abandons it when a unit
# fails, and a restarted controller aborts every restore it had not decided; a restore left
# open with every unit staged (the client gone before FINISH_RESTORE) is committed by
# recover_data_load. Once the decision is journaled only forward is possible: a unit that
# dies comes back empty and is rolled forward from the dump.
RESTORE = {
    "controller.request.BEGIN_RESTORE": server(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "controller.reply.BEGIN_RESTORE": server(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "controller.restore.after_begin": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "client.restore.after_begin": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "unit.request.LOAD_ROWS": server(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "controller.request.RESTORE_UNIT": server(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK, COMMITTED),
    # the claim is journaled before the reply: a unit that asks again is answered from the
    # controller's reply cache and loads on
    "controller.reply.RESTORE_UNIT": server(ROLLED_BACK, ROLLED_BACK, COMMITTED, COMMITTED),
    "controller.restore.after_claim": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "unit.load.after_claim": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "unit.load.after_read_batch": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "unit.load.after_stage": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    # kill: the unit dies after reporting staged; the client aborts
    "unit.reply.LOAD_ROWS": server(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK, COMMITTED),
    "controller.restore.after_staged": step(ROLLED_BACK, ROLLED_BACK, COMMITTED),
    # every unit staged, the restore open: recover_data_load commits it, unless the controller
    # restarts first (a restarted controller aborts every restore it had not decided)
    "client.restore.before_finish": step(COMMITTED, COMMITTED, COMMITTED),
    "controller.request.FINISH_RESTORE": server(ROLLED_BACK, COMMITTED, COMMITTED, COMMITTED),
    "controller.restore.after_commit_decision": step(COMMITTED, COMMITTED, COMMITTED),
    # kill: staged, dies before applying; rolled forward from the dump
    "unit.request.APPLY_STAGED": server(COMMITTED, COMMITTED, COMMITTED, COMMITTED),
    # kill: dies during apply; rolled forward from the dump
    "unit.apply.after_apply": step(COMMITTED, COMMITTED, COMMITTED),
    "unit.reply.APPLY_STAGED": server(COMMITTED, COMMITTED, COMMITTED, COMMITTED),
    "controller.restore.after_apply": step(COMMITTED, COMMITTED, COMMITTED),
    "controller.restore.after_publish": step(COMMITTED, COMMITTED, COMMITTED),
    "controller.reply.FINISH_RESTORE": server(COMMITTED, COMMITTED, COMMITTED, COMMITTED),
    "client.restore.after_finish": step(COMMITTED, COMMITTED, COMMITTED),
}

# The abort path of a restore: unit 1 fails its load (ABORT_TRIGGER, armed in unit 1 only),
# the client asks the controller to abandon the restore, and the fault is armed on that
# path. Whatever it does, the restore ends rolled back.
ABORT_TRIGGER = "unit.load.after_stage@1:raise"   # the first load only
RESTORE_ABORT = {
    "controller.restore.after_abort_decision": step(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK),
    "client.restore.after_abort": step(ROLLED_BACK, ROLLED_BACK, ROLLED_BACK),
}

# The controller killed at every metadata write (``controller.meta.<op>.<stage>``), restarted
# alone, the units alive. The journal transaction decides: after it the change is kept,
# before it not, but for a put and a clear the client sends again once the controller is
# back (done anyway), a restore whose commit was decided before the publish (rolled
# forward) and a lost unit's rows (the re-registering unit reports them missing again).
META_OPS = ("commit_put", "clear", "checkpoint_replace", "restore_publish", "unit_lost",
            "end_buffer")
META_STAGES = ("before_commit", "after_commit", "before_reply")
_KEPT_BEFORE_COMMIT = {"checkpoint_replace", "end_buffer"}
META = {f"controller.meta.{op}.{stage}":
        {"kill": META_KEPT if stage == "before_commit" and op in _KEPT_BEFORE_COMMIT
         else META_CHANGED}
        for op in META_OPS for stage in META_STAGES}
# A checkpoint load's keys written row by row after its reply: the load was decided and
# answered, so its metadata is back either way (from the decision's blob before the write).
META.update({f"controller.meta.checkpoint_keys.{stage}": {"kill": META_CHANGED}
             for stage in ("before_commit", "after_commit")})

# A unit's row log (durability sync) at every point of its append, seal, compaction and
# fsync: the unit is killed there (or the step raises), then the whole job is killed and
# started again on the same state dir. Every put acknowledged before is back bit for bit;
# the put in flight at the fault is back with its own value or not at all (never another
# key's value, never a half row).
ACKED_KEPT = "acknowledged puts kept"
ROWLOG_POINTS = ("unit.rowlog.before_append", "unit.rowlog.after_append",
                 "unit.rowlog.after_seal", "unit.rowlog.before_fsync",
                 "unit.rowlog.compact.before_relog", "unit.rowlog.compact.before_unlink",
                 "unit.rowlog.compact.after_unlink")
# The controller's durable cut (durability buffer): killed there or failing, it keeps what
# it committed (the WAL is in the page cache; a failed cut is tried again).
ROWLOG_POINTS += ("controller.meta.durable_cut.before_fsync",)
ROWLOG = {point: {"kill": ACKED_KEPT, "raise": ACKED_KEPT} for point in ROWLOG_POINTS}
