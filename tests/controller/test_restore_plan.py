"""The restore plan the controller journals with its commit decision: typed, and its bytes
stable (a plan an earlier controller stored must decode in a later one)."""
from __future__ import annotations

from tqtx.plan import BeginRow, RedoItem, RestorePlan, RestoreRow

# Encoded by the controller before RestorePlan became a dataclass: the journal holds such bytes.
STORED = (
    b'\x88\xaarestore_id\xa3r-1\xacpartition_id\xa5train\xa8dump_dir\xa7/d/dump\xacfield_schema'
    b'\x81\xa3obs\x82\xa5dtype\xa7float32\xa5shape\x91\x04\xa5units\x92\x00\x01\xabnew_indexes'
    b'\x91\t\xa7dump_id\xa6dump-7\xa4rows\x92\x97\xa2s1\x04\x92\xa3obs\xa3rew\x81\xa6status'
    b'\xa2ok\xc2\xcf\x00\x00\x01\x00\x00\x00\x00\x01\x00\x97\xa2s2\t\x90\xc0\xc3\xcf\x00\x00'
    b'\x01\x00\x00\x00\x00\x0e\xc0')
STORED_EMPTY = (b'\x88\xaarestore_id\xa3r-2\xacpartition_id\xa1p\xa8dump_dir\xa2/x\xacfield_schema'
                b'\x80\xa5units\x90\xabnew_indexes\x90\xa7dump_id\xc0\xa4rows\x90')


def _plan() -> RestorePlan:
    return RestorePlan(
        restore_id="r-1", partition_id="train", dump_dir="/d/dump",
        rows=[RestoreRow("s1", 4, ["obs", "rew"], {"status": "ok"}, False, 1099511627777, 0),
              RestoreRow("s2", 9, [], None, True, 1099511627790, None)],
        field_schema={"obs": {"dtype": "float32", "shape": [4]}}, units=[0, 1],
        new_indexes=[9], dump_id="dump-7")


def test_a_plan_encodes_to_the_bytes_the_journal_holds():
    assert _plan().encode() == STORED
    assert RestorePlan("r-2", "p", "/x", [], {}, [], []).encode() == STORED_EMPTY


def test_a_stored_plan_decodes_to_typed_rows():
    plan = RestorePlan.decode(STORED)
    assert plan == _plan()
    assert plan.rows[0].key == "s1" and plan.rows[0].tag == {"status": "ok"}
    assert plan.rows[1].is_new and plan.rows[1].src is None
    assert RestorePlan.decode(STORED_EMPTY) == RestorePlan("r-2", "p", "/x", [], {}, [], [])
    assert RestorePlan.decode(_plan().encode()).encode() == STORED


def test_redo_items_are_the_rows_a_unit_holds():
    plan = _plan()
    assert plan.redo_items(0, 2) == [RedoItem(4, 1099511627777, 0)]
    assert plan.redo_items(1, 2) == []  # s2 has no fields: nothing to re-read
    plan.rows[0].src = None
    assert plan.redo_items(0, 2) is None  # a source is unknown


def test_a_begin_row_reads_the_client_row_with_or_without_its_source():
    assert BeginRow.from_wire(["k", ["a"], {"t": 1}, 7]) == BeginRow("k", ["a"], {"t": 1}, 7)
    assert BeginRow.from_wire(["k", ["a"], None]).src is None
    assert BeginRow("k", ["a"], None, 3).to_wire() == ["k", ["a"], None, 3]
