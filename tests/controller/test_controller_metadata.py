"""The controller's in-memory metadata: shared field sets, DESCRIBE, held tags (no processes)."""
from __future__ import annotations

import pytest

from tqtx.controller.kv import HeldTags, KVRequests
from tqtx.controller.metadata import Metadata
from tqtx.wire.columns import unpack_int64

from after_reply import AfterReply


class _Describer(KVRequests):
    def __init__(self, meta: Metadata):
        self.server = AfterReply()
        super().__init__(meta=meta, journal=None, metajournal=None, units={}, num_units=4,
                         incarnation=0, restores=None, require_units=None, topology=lambda: 7,
                         after_reply=self.server.after_reply)


def _put(meta: Metadata, pid: str, keys: list[str], fields: list[str], tags=None):
    part = meta.partition(pid, create=True)
    for k in keys:
        if k not in part.keys and k not in part.pending:
            part.pending[k] = meta.allocate_rows(1)[0][0]
    for f in fields:
        part.schema.setdefault(f, {"kind": "tensor"})
    change, updates, common = meta.plan_commit(pid, keys, fields, tags)
    meta.apply_commit(pid, updates, change)
    return change, common


def test_rows_share_one_object_per_field_set():
    meta = Metadata()
    keys = [f"k{i}" for i in range(6)]
    _, common = _put(meta, "p", keys, ["a", "b"])
    assert common == ["a", "b"]
    _, common = _put(meta, "p", keys[:3], ["c"])  # a partial overwrite adds a field
    assert common == ["a", "b", "c"]
    part = meta.partitions["p"]
    sets = {id(part.fields[part.keys[k]]) for k in keys}
    assert len(sets) == 2
    assert part.fields[part.keys["k0"]] == {"a", "b", "c"}
    assert part.fields[part.keys["k5"]] == {"a", "b"}
    # a second partition with the same fields shares the object too
    _put(meta, "q", ["x"], ["b", "a"])
    assert meta.partitions["q"].fields[meta.partitions["q"].keys["x"]] is \
        part.fields[part.keys["k5"]]


def test_common_fields_of_a_put_over_rows_with_different_fields():
    meta = Metadata()
    _put(meta, "p", ["k0"], ["a"])
    _put(meta, "p", ["k1"], ["b"])
    _, common = _put(meta, "p", ["k0", "k1", "k2"], ["c"])
    assert common == ["c"]
    _, common = _put(meta, "p", ["k0", "k0"], ["d"])  # a key twice in one put
    assert common == ["a", "c", "d"]


def test_describe_numbers_field_sets_by_value_in_request_order():
    meta = Metadata()
    _put(meta, "p", ["k0", "k1"], ["a", "b"], tags=[{"t": 0}, {}])
    _put(meta, "p", ["k2"], ["a"])
    part = meta.partitions["p"]
    part.fields[part.keys["k1"]] = frozenset({"a", "b"})  # equal, not the shared object
    d = _Describer(meta)
    out = d.describe_rows({"partition_id": "p", "keys": ["k2", "k0", "k1"]}, None)
    assert out["field_sets"] == [["a"], ["a", "b"]]
    assert out["fields_of"] == [0, 1, 1]
    assert out["indexes"] == [part.keys[k] for k in ("k2", "k0", "k1")]
    packed = d.describe_rows({"partition_id": "p", "keys": ["k2", "k0", "k1"], "packed": True},
                             None)
    assert list(unpack_int64(packed["fields_of"])) == [0, 1, 1]
    assert list(unpack_int64(packed["indexes"])) == out["indexes"]
    one = d.describe_rows({"partition_id": "p", "keys": ["k0", "k1"], "packed": True}, None)
    assert one["field_sets"] == [["a", "b"]] and list(unpack_int64(one["fields_of"])) == [0, 0]
    assert out["tags"] == [{}, {"t": 0}, {}]
    assert sorted(out["field_schema"]) == ["a", "b"]


def test_describe_holds_tags_by_reference_until_taken():
    meta = Metadata()
    _put(meta, "p", ["k0", "k1"], ["a"], tags=[{"s": "old"}, {"s": "old1"}])
    d = _Describer(meta)
    out = d.describe_rows({"partition_id": "p", "keys": ["k1", "k0"], "hold_tags": "D"}, None)
    assert "tags" not in out and len(d.held_tags) == 0  # read once the reply has left
    d.server.run()  # the loop, before it reads the next request
    assert len(d.held_tags) == 1
    _put(meta, "p", ["k0"], ["a"], tags=[{"s": "new"}])  # re-tagged after the call
    assert d.take_dump_tags({"dump_id": "D"}, None) == {"tags": [{"s": "old1"}, {"s": "old"}]}
    with pytest.raises(KeyError, match="holds no tags for background dump D"):
        d.take_dump_tags({"dump_id": "D"}, None)


def test_held_tags_are_bounded_in_number_and_age(monkeypatch):
    held = HeldTags(limit=2, ttl=10.0)
    now = [100.0]
    monkeypatch.setattr("tqtx.controller.kv.time.monotonic", lambda: now[0])
    held.hold("a", [1])
    held.hold("b", [2])
    held.hold("c", [3])  # over the limit: the oldest goes
    assert len(held) == 2
    with pytest.raises(KeyError):
        held.take("a")
    now[0] = 105.0
    held.hold("d", [4])  # "b" is now the oldest (and over the limit)
    assert held.take("c") == [3] and held.take("d") == [4]
    held.hold("e", [5])
    now[0] = 120.0
    held.hold("f", [6])  # "e" expired
    with pytest.raises(KeyError):
        held.take("e")
    assert held.take("f") == [6]


def test_describe_packs_its_columns_as_little_endian_int64():
    import numpy as np
    meta = Metadata()
    keys = [f"k{i}" for i in range(300)]
    _put(meta, "p", keys, ["a"])
    _put(meta, "p", keys[::3], ["b"])
    d = _Describer(meta)
    plain = d.describe_rows({"partition_id": "p", "keys": keys}, None)
    packed = d.describe_rows({"partition_id": "p", "keys": keys, "packed": True}, None)
    for col in ("indexes", "fields_of"):
        assert isinstance(packed[col], bytes)
        assert np.frombuffer(packed[col], dtype="<i8").tolist() == plain[col]
    assert packed["field_sets"] == plain["field_sets"] == [["a", "b"], ["a"]]


def test_int64_columns_round_trip_and_refuse_a_torn_column():
    from tqtx.wire.columns import pack_int64, unpack_int64
    values = [0, 1, -1, 2**62, -(2**63)]
    assert list(unpack_int64(pack_int64(values))) == values
    assert pack_int64([1]) == b"\x01" + b"\x00" * 7  # little-endian on every host
    assert unpack_int64([3, 4]) == [3, 4]  # a plain list passes through
    with pytest.raises(ValueError, match="int64 column of 9 bytes"):
        unpack_int64(b"\x00" * 9)


def test_keys_given_equal_tags_share_one_tag_dict():
    meta = Metadata()
    keys = [f"k{i}" for i in range(4)]
    # separate but equal dicts, as msgpack decodes a batch's tags
    _put(meta, "p", keys, ["a"], tags=[{"step": 1, "ok": True} for _ in keys])
    part = meta.partitions["p"]
    assert len({id(part.tags[k]) for k in keys}) == 1
    assert part.tags["k0"] == {"step": 1, "ok": True}
    # a merge into one key makes a new dict: the others keep theirs
    _put(meta, "p", ["k0"], ["a"], tags=[{"ok": False}])
    assert part.tags["k0"] == {"step": 1, "ok": False}
    assert part.tags["k1"] == {"step": 1, "ok": True}
    # keys without a tag share the one empty tag
    _put(meta, "p", ["x", "y"], ["a"])
    assert part.tags["x"] == {} and part.tags["x"] is part.tags["y"]


@pytest.mark.parametrize("first, second", [
    (1, True), (1, 1.0), (0.0, -0.0), ("1", 1), (None, 0)])
def test_tags_equal_only_across_value_types_are_not_shared(first, second):
    meta = Metadata()
    _put(meta, "p", ["a", "b"], ["f"], tags=[{"v": first}, {"v": second}])
    part = meta.partitions["p"]
    assert type(part.tags["a"]["v"]) is type(first) and part.tags["a"]["v"] == first
    assert type(part.tags["b"]["v"]) is type(second)
    assert str(part.tags["b"]["v"]) == str(second)  # -0.0 stays -0.0


def test_tags_with_container_values_are_kept_per_key():
    meta = Metadata()
    _put(meta, "p", ["a", "b"], ["f"], tags=[{"v": [1, 2]}, {"v": [1, 2]}])
    part = meta.partitions["p"]
    assert part.tags["a"] == part.tags["b"] == {"v": [1, 2]}
    assert part.tags["a"] is not part.tags["b"]


def test_a_commit_journals_only_the_schemas_and_next_index_that_changed():
    """Every COMMIT_PUT wrote each field's schema and next_index again; now only those
    that differ from what the journal holds (schema dicts are replaced when they change)."""
    from tqtx.schema import merge_schema
    meta = Metadata()
    part = meta.partition("p", create=True)
    part.schema["a"] = {"kind": "tensor", "dtype": "float32", "shape": [4], "ndim": 1}
    part.schema["b"] = {"kind": "object"}
    # both keys' indexes allocated before the first commit, as a client's lease has them
    part.pending.update(zip(["k0", "k1"], meta.allocate_rows(2)[0]))
    first, _ = _put(meta, "p", ["k0"], ["a", "b"])
    assert [f for _, f, _ in first.schemas] == ["a", "b"]
    assert first.next_index == meta.next_index
    again, _ = _put(meta, "p", ["k1"], ["a", "b"])
    assert again.schemas == [] and again.next_index is None and len(again.rows) == 1
    # a row of another shape makes the field jagged: a new schema object, written once
    part.schema["a"] = merge_schema(part.schema["a"], {"kind": "tensor", "dtype": "float32",
                                                       "shape": [7], "ndim": 1})
    widened, _ = _put(meta, "p", ["k2"], ["a", "b"])
    assert widened.schemas == [("p", "a", part.schema["a"])]
    assert _put(meta, "p", ["k3"], ["a"])[0].schemas == []
    # an index allocated since the last journaled change is written with the next commit
    meta.allocate_rows(3)
    assert _put(meta, "p", ["k4"], ["a"])[0].next_index == meta.next_index
    # a change planned but never journaled (its write failed) is written by the next one
    part.schema["c"] = {"kind": "object"}
    part.pending["k5"] = meta.allocate_rows(1)[0][0]
    lost_change, _, _ = meta.plan_commit("p", ["k5"], ["c"], None)
    assert [f for _, f, _ in lost_change.schemas] == ["c"]
    retried, _ = _put(meta, "p", ["k5"], ["c"])
    assert [f for _, f, _ in retried.schemas] == ["c"] and retried.next_index == meta.next_index


def test_replaced_metadata_counts_as_journaled():
    """After a replace (a checkpoint load writes every schema with it; a restart reads them
    from the journal) a commit writes no schema the replace held; a partition created
    afresh (after a clear dropped it) writes them all again."""
    meta = Metadata()
    schema = {"a": {"kind": "tensor", "dtype": "int64", "shape": None, "jagged": True,
                    "ndim": 1}}
    meta.replace({"next_index": 4, "partitions": {"p": {"schema": schema,
                                                        "rows": [["k0", 0, ["a"], {}]]}}})
    change, _ = _put(meta, "p", ["k9"], ["a"])
    assert change.schemas == []
    part = meta.partition("p")
    gone = list(part.keys)
    meta.apply_clear(part, meta.plan_clear(part, gone)[1])
    assert meta.partition("p") is None
    new = meta.partition("p", create=True)
    new.schema["a"] = schema["a"]
    assert [f for _, f, _ in _put(meta, "p", ["k1"], ["a"])[0].schemas] == ["a"]


def test_a_restore_publish_merges_fields_and_tags_per_key():
    from tqtx.plan import RestoreRow
    meta = Metadata()
    _put(meta, "p", ["a0", "a1"], ["x"], tags=[{"s": 0}, {"s": 1}])
    _put(meta, "p", ["b0"], ["y"])
    part = meta.partitions["p"]
    part.lost[part.keys["a1"]] = 1  # a lost row comes back with the restore's fields only
    (new_idx,), (new_gen,) = meta.allocate_rows(1)
    rows = [RestoreRow("a0", part.keys["a0"], ["z"], {"r": 1}, False, 5, 0),
            RestoreRow("b0", part.keys["b0"], ["z"], None, False, 6, 1),
            RestoreRow("a1", part.keys["a1"], ["z"], {"r": 1}, False, 7, 2),
            RestoreRow("c0", new_idx, ["z"], {"r": 1}, True, new_gen, 3),
            RestoreRow("c1", part.keys["a0"] + 100, ["x", "z"], None, True, 9, 4)]
    change, schema = meta.plan_publish("p", rows, {"z": {"kind": "tensor"}})
    got = {r[1]: (r[3], r[4], r[6]) for r in change.rows}
    assert got == {"a0": ({"x", "z"}, {"s": 0, "r": 1}, 5), "b0": ({"y", "z"}, {}, 6),
                   "a1": ({"z"}, {"r": 1}, 7), "c0": ({"z"}, {"r": 1}, new_gen),
                   "c1": ({"x", "z"}, {}, 9)}
    assert got["a0"][0] is got["c1"][0] is meta.share(["x", "z"])  # one object per set
    assert got["a1"][0] is got["c0"][0]
    assert got["a1"][1] is got["c0"][1]  # equal merges share one tag dict
    assert "z" in schema
    meta.apply_publish("p", change, schema)
    assert part.fields[part.keys["a0"]] == {"x", "z"} and part.keys["c0"] == new_idx
    assert part.tags["a0"] == {"s": 0, "r": 1} and part.lost == {}
