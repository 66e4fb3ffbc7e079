"""Crash matrix: every fault point x {kill, raise, drop-reply, delay}, with real processes,
then recovery and every invariant (see crash.py), and the outcome crash_table.py expects
for that point and action. Unit-side points run in each role of the faulty unit: the one
that gets there first, the one that gets there last, and the unit alone (a 1-unit
deployment).

The full product is marked ``slow`` (``pytest tests/faults -m slow``); a representative
subset with ``kill`` (a unit and the controller or client in each protocol) runs in the
quick loop (``-m "not slow"``).
"""
from __future__ import annotations

import pytest

import tqtx as tq
from crash import Run, dump_case, make_reference_dump, restore_case
from crash_meta import ROLE as UNITS_ALIVE, meta_case
from crash_table import (ABORT_TRIGGER, BACKGROUND_DUMP, COMMITTED, DUMP, META, META_CHANGED,
                         META_KEPT, NEW, OLD, RESTORE, RESTORE_ABORT, ROLLED_BACK)

ROLES = ["first", "last", "alone"]

# (point, role) run with kill in the default suite; everything else is slow
FAST_DUMP = {("unit.dump.after_write", "first"), ("publish.after_old_moved", None)}
FAST_BACKGROUND = {("unit.reply.DUMP_SNAPSHOT", "last")}
FAST_RESTORE = {("unit.load.after_read_batch", "last"),
                ("controller.restore.after_commit_decision", None),
                ("unit.apply.after_apply", "last"), ("client.restore.before_finish", None)}
FAST_RESTORE_ABORT = {("controller.restore.after_abort_decision", None)}
FAST_META = {("controller.meta.commit_put.after_commit", UNITS_ALIVE),
             ("controller.meta.unit_lost.after_commit", UNITS_ALIVE)}


# (point, action) -> extra marks: the known gaps the matrix shows (each fails its invariants
# today; strict, so a fix turns it into a failure that asks to remove the mark)
KNOWN: dict = {}


def _cases(table: dict, fast: set, roles: list | None = None):
    """One case per point, role and action of ``table``, with its expected outcome."""
    out = []
    for point, expected in table.items():
        for role in (roles or (ROLES if point.startswith("unit.") else [None])):
            for action, outcome in expected.items():
                marks = list(KNOWN.get((point, action), []))
                if not (action == "kill" and (point, role) in fast):
                    marks.append(pytest.mark.slow)
                ident = f"{point}:{action}" + (f":{role}" if role else "")
                out.append(pytest.param(point, action, role, outcome, id=ident, marks=marks))
    return out


@pytest.fixture(scope="module")
def ref_dump(tmp_path_factory):
    return make_reference_dump(tmp_path_factory.mktemp("ref") / "dump")


@pytest.fixture
def clean_api():
    tq.close()
    yield
    tq.close()


@pytest.mark.parametrize("point,action,role,expected", _cases(DUMP, FAST_DUMP))
def test_dump_crash(tmp_path, clean_api, point, action, role, expected):
    res = dump_case(tmp_path, point, action, role)
    assert (NEW if res["which"] == "new" else OLD) == expected, res


@pytest.mark.parametrize("point,action,role,expected", _cases(BACKGROUND_DUMP, FAST_BACKGROUND))
def test_background_dump_crash(tmp_path, clean_api, point, action, role, expected):
    res = dump_case(tmp_path, point, action, role, background=True)
    assert (NEW if res["which"] == "new" else OLD) == expected, res


@pytest.mark.parametrize("point,action,role,expected", _cases(RESTORE, FAST_RESTORE))
def test_restore_crash(tmp_path, clean_api, ref_dump, point, action, role, expected):
    res = restore_case(tmp_path, ref_dump, point, action, role)
    # a restore is only decided by the controller's journaled commit decision; after it,
    # a unit that dies comes back empty and is rolled forward from the dump
    assert (COMMITTED if res["committed"] else ROLLED_BACK) == expected, res
    assert not res["cancel_needed"], res


@pytest.mark.parametrize("point,action,role,expected", _cases(RESTORE_ABORT, FAST_RESTORE_ABORT))
def test_restore_abort_crash(tmp_path, clean_api, ref_dump, point, action, role, expected):
    res = restore_case(tmp_path, ref_dump, point, action, role, trigger=ABORT_TRIGGER)
    assert (COMMITTED if res["committed"] else ROLLED_BACK) == expected, res
    assert not res["cancel_needed"], res


@pytest.mark.parametrize("point,action,role,expected", _cases(META, FAST_META, [UNITS_ALIVE]))
def test_meta_crash(tmp_path, clean_api, ref_dump, point, action, role, expected):
    res = meta_case(tmp_path, point, ref_dump)
    # the journal transaction decides: after it the change is there, before it not (a put
    # and a clear the client sends again once the controller is back are done anyway)
    assert (META_CHANGED if res["which"] == "new" else META_KEPT) == expected, res
    if point.startswith("controller.meta.restore_publish."):   # decided before the publish
        assert not res["cancel_needed"], res


# --------------------------------------------------------------------------- reply points
@pytest.mark.slow
def test_deferred_reply_points_fire(tmp_path, clean_api, ref_dump):
    run = Run(tmp_path, "unit.reply.LOAD_ROWS", "kill", 1)
    from crash import _copy_dump
    dump = _copy_dump(ref_dump["path"], tmp_path / "dump")
    run.start()
    try:
        run.run_op(lambda: tq.load_data_by_key(dump), ["load", dump])
        assert "unit 1" in run.dead("unit 1"), run.outcome
    finally:
        run.close()
