"""A checkpoint load's keys in the controller journal: decided as one blob, written row by
row once the reply has left, and always before any later change of keys."""
from __future__ import annotations

import errno

import pytest

from tqtx.controller.kv import KVRequests
from tqtx.controller.metadata import Metadata
from tqtx.errors import JournalWriteError
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.meta import CHECKPOINT_KEYS, MetaChange, MetaJournal, buffer_summary
from tqtx.wire import codec

from after_reply import AfterReply

SCHEMA = {"a": {"kind": "tensor", "dtype": "int64", "shape": [2], "ndim": 1}}
CHECKPOINT = {"next_index": 5, "partitions": {"p": {"schema": SCHEMA, "rows": [
    ["k0", 0, ["a"], {"step": 1}, None, 17], ["k1", 3, ["a"], {}, None, 18],
    ["k2", 4, ["a"], None, 1, 19]]}}}


class _NoRestores:
    def refuse(self, what, pid=None):
        pass


@pytest.fixture
def rig(tmp_path):
    with ControllerJournal(tmp_path / "state") as cj:
        mj = MetaJournal(cj.engine, "controller")
        loop = AfterReply()
        meta = Metadata(1)
        kv = KVRequests(meta=meta, journal=cj, metajournal=mj, units={}, num_units=2,
                        incarnation=1, restores=_NoRestores(),
                        require_units=lambda what: None, topology=lambda: 0,
                        after_reply=loop.after_reply)
        try:
            yield kv, mj, loop
        finally:
            mj.close()


def mj_engine(kv: KVRequests):
    return kv.journal.engine


def _keys(mj: MetaJournal) -> dict:
    return {row[0]: tuple(row[1:]) for part in mj.load()["partitions"].values() for row in part["rows"]}


def _load(kv: KVRequests) -> None:
    kv.checkpoint_replace({"metadata_packed": codec.packb(CHECKPOINT)}, {})


def test_the_decision_holds_the_keys_as_one_blob_written_row_by_row_after_the_reply(rig):
    kv, mj, loop = rig
    _load(kv)
    decided = mj.load()
    assert decided["partitions"] == {} and decided["next_index"] == 5
    gen_base, packed = codec.unpackb(decided["blobs"][CHECKPOINT_KEYS])
    assert codec.unpackb(packed) == CHECKPOINT
    assert kv.meta.gens == {0: gen_base, 3: gen_base + 3, 4: gen_base + 4}
    summary = [{"partition_id": "p", "keys": 3, "lost_rows": 1}]
    assert buffer_summary(mj_engine(kv)) == summary  # journal show, from the blob
    loop.run()
    written = mj.load()
    assert CHECKPOINT_KEYS not in written["blobs"] and kv.checkpoint_keys is None
    assert _keys(mj) == {"k0": (0, ["a"], {"step": 1}, None, gen_base),
                         "k1": (3, ["a"], {}, None, gen_base + 3),
                         "k2": (4, ["a"], {}, 1, gen_base + 4)}
    assert written["partitions"]["p"]["schema"] == SCHEMA
    assert buffer_summary(mj_engine(kv)) == summary


def test_keys_whose_write_failed_are_written_before_the_next_change_of_keys(rig):
    kv, mj, loop = rig
    write = mj.write

    def full_disk(change):
        if change.blobs.get(CHECKPOINT_KEYS, b"") is None:
            raise JournalWriteError(errno.ENOSPC, "No space left on device", mj.path)
        write(change)
    mj.write = full_disk
    _load(kv)
    with pytest.raises(JournalWriteError):
        loop.run()
    assert kv.checkpoint_keys is not None and _keys(mj) == {}
    # a change of markers alone leaves the blob where it is
    kv.journal_meta("checkpoint_replace", MetaChange(markers={"probe": "1"}))
    assert CHECKPOINT_KEYS in mj.load()["blobs"]
    mj.write = write
    # a clear of k0: the checkpoint's keys first, then the clear on top of them
    kv.journal_meta("clear", MetaChange(deleted=[("p", "k0")]))
    assert sorted(_keys(mj)) == ["k1", "k2"]
    assert CHECKPOINT_KEYS not in mj.load()["blobs"] and kv.checkpoint_keys is None


def test_a_replace_supersedes_keys_not_yet_written(rig):
    kv, mj, loop = rig
    _load(kv)
    kv.journal_meta("end_buffer", MetaChange(replace=True))
    loop.run()  # nothing left to write
    assert kv.checkpoint_keys is None
    assert _keys(mj) == {} and mj.load()["blobs"] == {}
