"""Whole-system checkpoints: save_checkpoint / load_checkpoint against a real deployment.

load_checkpoint replaces the whole state, so every test here starts by clearing everything.
The unit-count test starts its own deployment and therefore runs last. The tests compare
dense columns, so they run in strict mode (tests/e2e/test_tq_checkpoint_suite.py covers the
default, TransferQueue's results).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq
from tqtx import DumpFormatError, KeysNotFoundError

pytestmark = pytest.mark.strict


def wipe():
    for p, keys in tq.kv_list().items():
        tq.kv_clear(list(keys), p)
    assert tq.kv_list() == {}


@pytest.fixture
def shared(tq_shared):
    wipe()
    yield tq_shared


def populate():
    """Two partitions with dense, jagged, non-tensor fields and tags; returns expectations."""
    keys = [f"k{i}" for i in range(7)]
    dense = torch.randn(7, 3, 2)
    bf = torch.arange(7, dtype=torch.bfloat16)
    rows = [torch.arange(i % 4, dtype=torch.int32) for i in range(7)]
    objs = ["a", {"t": torch.ones(2), "n": None}, None, b"\x01", 3, [1, "x"], True]
    tq.kv_batch_put(keys, "train", TensorDict(
        {"dense": dense, "bf": bf, "jag": torch.nested.nested_tensor(rows, layout=torch.jagged),
         "obj": NonTensorStack(*objs)}, batch_size=[7]),
        tags=[{"i": i, "status": "ready"} for i in range(7)])
    tq.kv_put("k0", "train", {"extra": torch.tensor([True, False])}, tag={"status": "used"})
    tq.kv_put("only-tag", "val", tag={"pending": True})
    tq.kv_put("v1", "val", {"mask": torch.ones(4, dtype=torch.uint8)})
    return {"keys": keys, "dense": dense, "bf": bf, "rows": rows, "objs": objs}


def check(exp):
    keys = exp["keys"]
    td = tq.kv_batch_get(keys, "train", select_fields=["dense", "bf", "jag", "obj"])
    assert torch.equal(td["dense"], exp["dense"])
    assert torch.equal(td["bf"], exp["bf"])
    assert [t.tolist() for t in td["jag"].unbind()] == [r.tolist() for r in exp["rows"]]
    got = td.get("obj").tolist()
    assert got[0] == "a" and got[2] is None and got[3] == b"\x01" and got[5] == [1, "x"]
    assert torch.equal(got[1]["t"], torch.ones(2))
    assert tq.kv_batch_get(["k0"], "train", "extra")["extra"].tolist() == [[True, False]]
    listed = tq.kv_list()
    assert listed["train"]["k0"] == {"i": 0, "status": "used"}
    assert listed["train"]["k3"] == {"i": 3, "status": "ready"}
    assert listed["val"] == {"only-tag": {"pending": True}, "v1": {}}
    assert tq.kv_batch_get(["v1"], "val")["mask"].tolist() == [[1, 1, 1, 1]]


def test_round_trip_replaces_whole_state(shared, tmp_path):
    exp = populate()
    ckpt = tmp_path / "ckpt"
    info = tq.save_checkpoint(ckpt, metadata={"step": 42, "note": "before"})
    assert info["num_units"] == 3 and info["keys"] == 9
    # on-disk layout
    assert json.loads((ckpt / "metadata.json").read_text()) == {
        "storage_saved": True, "user_metadata": {"step": 42, "note": "before"}}
    manifest = json.loads((ckpt / "checkpoint_info.json").read_text())
    assert manifest["kind"] == "tqtx-checkpoint" and manifest["num_units"] == 3
    assert (ckpt / "controller.msgpack").is_file()
    for u in range(3):
        assert (ckpt / "units" / f"unit-{u}.bin").is_file()
        assert (ckpt / "units" / f"unit-{u}.index").is_file()
    # change everything after the save
    tq.kv_put("k1", "train", {"dense": torch.zeros(3, 2)}, tag={"status": "changed"})
    tq.kv_clear(["k2", "k3"], "train")
    tq.kv_put("new", "train", {"dense": torch.ones(3, 2)})
    tq.kv_batch_put(["z0", "z1"], "other", TensorDict({"w": torch.ones(2)}, batch_size=[2]))
    tq.kv_clear(["only-tag"], "val")

    loaded = tq.load_checkpoint(ckpt)
    assert loaded["metadata"] == {"step": 42, "note": "before"}
    assert loaded["keys"] == 9
    check(exp)
    assert sorted(tq.kv_list()) == ["train", "val"]
    assert "new" not in tq.kv_list("train")["train"]
    with pytest.raises(KeysNotFoundError):
        tq.kv_batch_get(["z0"], "other")


def test_puts_after_load_do_not_clobber_restored_rows(shared, tmp_path):
    exp = populate()
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(ckpt)
    tq.kv_clear(exp["keys"], "train")
    tq.kv_batch_put([f"x{i}" for i in range(20)], "filler",
                    TensorDict({"f": torch.full((20, 3, 2), -1.0)}, batch_size=[20]))
    tq.load_checkpoint(ckpt)
    # new keys get fresh (or freed) indexes, never ones the checkpoint uses
    tq.kv_batch_put([f"n{i}" for i in range(10)], "train",
                    TensorDict({"dense": torch.full((10, 3, 2), 5.0)}, batch_size=[10]))
    check(exp)
    assert tq.kv_batch_get(["n9"], "train", "dense")["dense"].eq(5.0).all()
    client = tq.get_client()
    idx = client.controller.call("LOOKUP", {"partition_id": "train",
                                            "keys": exp["keys"] + [f"n{i}" for i in range(10)],
                                            "select_fields": None})["indexes"]
    assert len(set(idx)) == len(idx)


def test_empty_state_round_trip(shared, tmp_path):
    ckpt = tmp_path / "empty"
    tq.save_checkpoint(ckpt)
    populate()
    tq.load_checkpoint(ckpt)
    assert tq.kv_list() == {}
    assert json.loads((ckpt / "metadata.json").read_text()) == {
        "storage_saved": True, "user_metadata": {}}


def test_save_over_existing_checkpoint(shared, tmp_path):
    ckpt = tmp_path / "ckpt"
    tq.kv_put("a", "p", {"x": torch.ones(1)})
    tq.save_checkpoint(ckpt, metadata={"v": 1})
    tq.kv_put("b", "p", {"x": torch.zeros(1)})
    tq.save_checkpoint(ckpt, metadata={"v": 2})
    assert json.loads((ckpt / "metadata.json").read_text())["user_metadata"] == {"v": 2}
    assert not (tmp_path / "ckpt.old").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    wipe()
    assert tq.load_checkpoint(ckpt)["metadata"] == {"v": 2}
    assert sorted(tq.kv_list("p")["p"]) == ["a", "b"]


def test_non_json_metadata_refused_before_writing(shared, tmp_path):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(TypeError):
        tq.save_checkpoint(ckpt, metadata={"t": torch.ones(1)})
    assert not ckpt.exists()


def test_crash_left_old_dir_is_recovered_on_load(shared, tmp_path):
    """A crash between moving the previous checkpoint to <dir>.old and renaming the new one
    into place leaves only <dir>.old: the next access puts it back. A ``.tmp-*`` that no
    journal row accounts for is not tqtx's and stays."""
    exp = populate()
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(ckpt, metadata={"gen": 1})
    _journal_crashed_attempt(ckpt, "deadbeef0000", "synced")
    os.rename(ckpt, tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp-deadbeef0000").mkdir()  # its half-written staging dir
    (tmp_path / "ckpt.tmp-mine").mkdir()  # a user's
    wipe()
    assert tq.load_checkpoint(ckpt)["metadata"] == {"gen": 1}
    assert ckpt.is_dir() and not (tmp_path / "ckpt.old").exists()
    assert not (tmp_path / "ckpt.tmp-deadbeef0000").exists()
    assert (tmp_path / "ckpt.tmp-mine").is_dir()
    check(exp)


def _journal_crashed_attempt(ckpt, attempt_id: str, phase: str) -> None:
    """Journal a publication attempt of ``ckpt`` left at ``phase`` (as a crash leaves it)."""
    from tqtx.journal.dump import DumpJournal
    with DumpJournal(ckpt) as j:
        j.begin_publication(attempt_id=attempt_id, kind="checkpoint", dump_id=None,
                            staging_dir=f"{ckpt}.tmp-{attempt_id}")
        j.set_phase(attempt_id, phase)


def test_crash_left_old_dir_is_recovered_on_save(shared, tmp_path):
    ckpt = tmp_path / "ckpt"
    tq.kv_put("a", "p", {"x": torch.ones(1)})
    tq.save_checkpoint(ckpt, metadata={"gen": 1})
    # crash after publishing the new one but before deleting .old
    _journal_crashed_attempt(ckpt, "deadbeef0001", "published")
    shutil.copytree(ckpt, tmp_path / "ckpt.old")
    tq.save_checkpoint(ckpt, metadata={"gen": 2})
    assert not (tmp_path / "ckpt.old").exists()
    assert json.loads((ckpt / "metadata.json").read_text())["user_metadata"] == {"gen": 2}


def test_corrupt_or_missing_checkpoint_leaves_state_alone(shared, tmp_path):
    exp = populate()
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(ckpt)
    with pytest.raises(DumpFormatError, match="checkpoint directory not found.*nothing-here"):
        tq.load_checkpoint(tmp_path / "nothing-here")
    ctl = ckpt / "controller.msgpack"
    data = bytearray(ctl.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ctl.write_bytes(bytes(data))
    tq.kv_put("after", "train", {"dense": torch.ones(3, 2)})
    with pytest.raises(DumpFormatError, match="controller.msgpack"):
        tq.load_checkpoint(ckpt)
    check(exp)
    assert "after" in tq.kv_list("train")["train"]
    manifest = json.loads((ckpt / "checkpoint_info.json").read_text())
    manifest["format_version"] = 99
    (ckpt / "checkpoint_info.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpFormatError, match="format_version"):
        tq.load_checkpoint(ckpt)


def test_corrupt_unit_file_leaves_state_alone(shared, tmp_path):
    ckpt = tmp_path / "ckpt"
    keys = [f"k{i}" for i in range(30)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(30)}, batch_size=[30]))
    tq.save_checkpoint(ckpt)
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(30) + 100}, batch_size=[30]))
    unit2 = ckpt / "units" / "unit-2.bin"
    data = bytearray(unit2.read_bytes())
    data[-3] ^= 0xFF  # same size, bad payload
    unit2.write_bytes(bytes(data))
    with pytest.raises(DumpFormatError, match="unit-2.bin"):
        tq.load_checkpoint(ckpt)
    # the failed load changed nothing: units stage, and switch only once every one staged
    assert tq.kv_batch_get(keys, "p")["x"].tolist() == list(range(100, 130))


def test_a_record_of_another_key_is_refused_and_leaves_state_alone(shared, tmp_path):
    """The metadata gives two keys each other's rows (same sizes, valid checksums): the
    unit that reads the records finds a record naming another key and the load fails,
    every unit's staging dropped, nothing switched."""
    from tqtx import format as fmt
    from tqtx.dump.checkpoint import MANIFEST
    from tqtx.wire.codec import packb, unpackb
    keys = ["a", "b"]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]))
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(ckpt)
    ctl = ckpt / "controller.msgpack"
    meta = unpackb(ctl.read_bytes())
    rows = meta["partitions"]["p"]["rows"]
    ra, rb = (next(r for r in rows if r[0] == k) for k in keys)
    ra[0], rb[0] = "b", "a"   # each key now claims the other's record
    data = packb(meta)
    ctl.write_bytes(data)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["controller"].update(size=len(data), crc32=fmt.checksum(data))
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.tensor([7, 8])}, batch_size=[2]))
    with pytest.raises(DumpFormatError, match="record") as ei:
        tq.load_checkpoint(ckpt)
    assert "unit-" in str(ei.value) and "global index" in str(ei.value)
    assert tq.kv_batch_get(keys, "p")["x"].tolist() == [7, 8]


def test_async_twins(shared, tmp_path):
    tq.kv_put("a", "p", {"x": torch.ones(2)}, tag={"t": 1})

    async def main():
        await tq.async_save_checkpoint(tmp_path / "c", metadata={"async": True})
        tq.kv_clear(["a"], "p")
        return await tq.async_load_checkpoint(tmp_path / "c")

    res = asyncio.run(main())
    assert res["metadata"] == {"async": True}
    assert tq.kv_list() == {"p": {"a": {"t": 1}}}


def test_checkpoint_with_a_non_str_partition_id_is_refused_before_anything(shared, tmp_path):
    """A checkpoint holding an int partition id (an earlier tqtx let
    load_data_by_key(partition_id=5) create one) is refused naming the file and the id,
    before any unit stages a row: partition ids are str on every path (issue 33)."""
    from tqtx import format as fmt
    from tqtx.dump.checkpoint import MANIFEST
    from tqtx.wire.codec import packb, unpackb
    tq.kv_put("a", "p", {"x": torch.ones(3)})
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(ckpt)
    ctl = ckpt / "controller.msgpack"
    meta = unpackb(ctl.read_bytes())
    meta["partitions"] = {5: meta["partitions"]["p"]}
    data = packb(meta)
    ctl.write_bytes(data)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["controller"].update(size=len(data), crc32=fmt.checksum(data))
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    tq.kv_put("b", "p", {"x": torch.zeros(3)})
    before = tq.kv_list()

    def loads():
        return [u["ops"].get("LOAD_CHECKPOINT", {}).get("count", 0)
                for u in tq.get_client().stats()["units"]]
    loads_before = loads()
    with pytest.raises(DumpFormatError) as ei:
        tq.load_checkpoint(ckpt)
    assert str(ctl) in str(ei.value) and "partition id int 5" in str(ei.value)
    assert tq.kv_list() == before
    assert tq.kv_batch_get(["a", "b"], "p")["x"].tolist() == [[1.0] * 3, [0.0] * 3]
    assert loads() == loads_before  # no unit was asked to stage anything


def test_unit_count_mismatch(shared, tmp_path, tq_start):
    """Runs last: it replaces the shared deployment with a 2-unit one."""
    tq.kv_put("a", "p", {"x": torch.ones(2)})
    ckpt = tmp_path / "ckpt3"
    tq.save_checkpoint(ckpt)
    tq_start(num_units=2)
    tq.kv_put("b", "q", {"y": torch.zeros(1)})
    with pytest.raises(ValueError, match="count mismatch"):
        tq.load_checkpoint(ckpt)
    assert tq.kv_list() == {"q": {"b": {}}}


def test_unit_failing_mid_load_leaves_state_alone(tq_start, tmp_path):
    """Runs last (own deployment): unit 1 fails every LOAD_CHECKPOINT."""
    tq_start(num_units=2, unit_env={1: {"TQTX_FAULTS": "unit.request.LOAD_CHECKPOINT:raise"}})
    keys = [f"k{i}" for i in range(8)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(8)}, batch_size=[8]))
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(ckpt)
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(8) + 100}, batch_size=[8]))
    with pytest.raises(RuntimeError, match="fault injected at unit.request.LOAD_CHECKPOINT"):
        tq.load_checkpoint(ckpt)
    assert tq.kv_batch_get(keys, "p")["x"].tolist() == list(range(100, 108))
