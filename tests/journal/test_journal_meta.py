"""Durable metadata writes (tqtx.journal.meta): the multi-row upsert and a restore's publish."""
from __future__ import annotations

import pytest

from tqtx import states as st
from tqtx.journal.meta import _UPSERT_ROWS, MetaChange, MetaJournal
from tqtx.journal.controller import ControllerJournal
from tqtx.wire import codec
from tqtx.wire.values import RawTensor


@pytest.fixture
def journals(tmp_path):
    with ControllerJournal(tmp_path / "state") as cj:
        mj = MetaJournal(cj.engine, "sync")
        try:
            yield cj, mj
        finally:
            mj.close()


def _rows(n: int, start: int = 0, pid: str = "p"):
    return [(pid, f"k{i:05d}", start + i, frozenset({"x", "y"} if i % 3 else {"x"}),
             {"step": i} if i % 2 else {}, None, (7 << 40) + start + i) for i in range(n)]


@pytest.mark.parametrize("n", [1, _UPSERT_ROWS - 1, _UPSERT_ROWS, 2 * _UPSERT_ROWS + 5])
def test_upsert_rows_across_statement_chunks(journals, n):
    _cj, mj = journals
    mj.write(MetaChange(rows=_rows(n), next_index=n))
    got = mj.load()
    rows = got["partitions"]["p"]["rows"]
    assert got["next_index"] == n
    assert [r[0] for r in rows] == [f"k{i:05d}" for i in range(n)]
    assert [r[1] for r in rows] == list(range(n))
    assert all(r[2] == (["x", "y"] if i % 3 else ["x"]) for i, r in enumerate(rows))
    assert all(r[3] == ({"step": i} if i % 2 else {}) for i, r in enumerate(rows))
    assert [r[5] for r in rows] == [(7 << 40) + i for i in range(n)]  # the generations


def test_upsert_replaces_and_repeats_in_one_change(journals):
    _cj, mj = journals
    mj.write(MetaChange(rows=_rows(10)))
    # a key twice in one change: the later row wins, as with one statement per row
    again = _rows(_UPSERT_ROWS + 3, start=1000)
    again.append(("p", "k00001", 5000, frozenset({"z"}), {"last": True}, 2, 99))
    mj.write(MetaChange(rows=again))
    rows = {r[0]: r for r in mj.load()["partitions"]["p"]["rows"]}
    assert len(rows) == _UPSERT_ROWS + 3
    assert rows["k00001"][1:] == [5000, ["z"], {"last": True}, 2, 99]
    assert rows["k00002"][1] == 1002


def test_tags_with_sets_and_tensors_use_the_codec(journals):
    cj, mj = journals
    tensor = RawTensor("float32", (2,), b"\x00" * 8)
    tags = [{"s": {3, 1, 2}}, {"t": tensor, "n": 1}, {"plain": "x"}]
    mj.write(MetaChange(rows=[("p", f"k{i}", i, frozenset({"x"}), t, None, i)
                              for i, t in enumerate(tags)]))
    with cj.engine.connect() as conn:
        stored = dict(conn.exec_driver_sql("SELECT key, tag FROM meta_keys").fetchall())
    for i, t in enumerate(tags):
        assert stored[f"k{i}"] == codec.packb(t)


def test_restore_finish_publishes_in_its_transaction(journals):
    cj, mj = journals
    inc = cj.start_incarnation(pid=1, host="h", address="tcp://h:1", version="0")
    cj.begin_restore(restore_id="r1", partition_id="p", dump_dir="/d", dump_id=None,
                     incarnation_id=inc, units=[0], keys=300, rows=300, bytes=1)
    cj.claim_unit("r1", 0)
    cj.stage_unit("r1", 0, rows=300, bytes=1)
    cj.decide_commit("r1", b"plan")
    assert cj.restore_plan("r1") == b"plan"
    cj.apply_unit("r1", 0)
    done = cj.finish_restore("r1", st.COMMITTED, meta_change=MetaChange(rows=_rows(300),
                                                                        next_index=300))
    assert done["state"] == st.COMMITTED and done["units"][0]["state"] == st.APPLIED
    assert cj.get_restore("r1") == done
    assert cj.restore_plan("r1") is None
    assert len(mj.load()["partitions"]["p"]["rows"]) == 300


def test_answered_requests_are_kept_newest_first_out(journals, monkeypatch):
    """A change's request reply is stored with it; only the newest REQUESTS_KEPT stay, and a
    durability of "memory" keeps none (nothing may answer for a change it did not keep)."""
    from tqtx.journal import meta
    cj, mj = journals
    monkeypatch.setattr(meta, "REQUESTS_KEPT", 3)
    monkeypatch.setattr(meta, "_TRIM_EVERY", 1)
    for i in range(5):
        reply = codec.packb({"freed": [i], "gens": [100 + i]})
        mj.write(MetaChange(deleted=[("p", f"k{i}")], answered=(f"r{i}", reply)))
    answered = mj.load()["answered"]
    assert [rid for rid, _ in answered] == ["r2", "r3", "r4"]
    assert codec.unpackb(answered[-1][1]) == {"freed": [4], "gens": [104]}
    assert MetaChange(answered=("r", b"x"))  # a change that only records a reply is written
    off = MetaJournal(cj.engine, "memory")
    try:
        assert off.load()["answered"] == []
    finally:
        off.close()
    assert mj.load()["answered"] == []


def test_replayed_rows_with_equal_tags_share_one_dict(journals):
    from tqtx.controller.metadata import Metadata
    _cj, mj = journals
    shared = {"step": 3}
    rows = [("p", f"k{i}", i, frozenset({"x"}), shared if i < 4 else {"step": i}, None,
             (7 << 40) + i) for i in range(6)]
    rows.append(("p", "k6", 6, frozenset({"x"}), {"step": 3}, None, (7 << 40) + 6))
    mj.write(MetaChange(rows=rows, next_index=7))
    meta = Metadata(8)
    meta.replace(mj.load())
    tags = meta.partitions["p"].tags
    assert [tags[f"k{i}"] for i in range(7)] == \
        [{"step": 3}] * 4 + [{"step": 4}, {"step": 5}, {"step": 3}]
    assert len({id(tags[f"k{i}"]) for i in (0, 1, 2, 3, 6)}) == 1
