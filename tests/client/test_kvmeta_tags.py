"""KVBatchMeta copies the tags it is given as ``copy.deepcopy`` does (TransferQueue's class
deep-copies them), flat tags as plain dicts (tqtx.client.kvmeta.copy_tags)."""
from __future__ import annotations

import copy

import pytest

from tqtx.client.kvmeta import KVBatchMeta, copy_tags


def test_copies_are_equal_and_independent_of_what_was_given():
    nested = {"step": 3, "info": {"lens": [1, 2]}, "t": (1, [2])}
    flat = {"step": 1, "src": "rollout", "r": 0.5, "done": True, "x": None, "b": b"\x00"}
    given = [flat, nested, {}, {1: "int key"}]
    got = copy_tags(given)
    assert got == copy.deepcopy(given)
    for g, t in zip(got, given):
        assert g is not t
    got[0]["step"] = 9
    got[1]["info"]["lens"].append(3)
    got[1]["t"][1].append(4)
    assert flat["step"] == 1 and nested["info"]["lens"] == [1, 2] and nested["t"] == (1, [2])


def test_a_tag_given_twice_stays_shared_as_with_deepcopy():
    flat, nested, inner = {"a": 1}, {"l": [1]}, [7]
    given = [flat, flat, nested, nested, {"x": inner}, {"y": inner}]
    got, deep = copy_tags(given), copy.deepcopy(given)
    for i, j in ((0, 1), (2, 3)):
        assert (got[i] is got[j]) and (deep[i] is deep[j])
    assert got[4]["x"] is got[5]["y"] and deep[4]["x"] is deep[5]["y"]
    assert got[4]["x"] is not inner


def test_kv_batch_meta_holds_copies():
    tags = [{"k": 1}, {"k": {"deep": [1]}}]
    meta = KVBatchMeta(keys=["a", "b"], tags=tags, partition_id="p")
    meta.tags[0]["k"] = 2
    meta.tags[1]["k"]["deep"].append(2)
    assert tags == [{"k": 1}, {"k": {"deep": [1]}}]


def test_a_put_result_keeps_the_tags_made_for_it_and_checks_as_the_constructor():
    tags = [{"k": 1}, {}]
    own = KVBatchMeta._of_own_tags(["a", "b"], tags, partition_id="p", fields=["x"])
    assert own == KVBatchMeta(keys=["a", "b"], tags=tags, partition_id="p", fields=["x"])
    assert own.tags is tags and own.extra_info == {}
    for keys, tags, fields, msg in ((["a", "a"], [{}, {}], None, "distinct"),
                                    (["a"], [{}, {}], None, "same length"),
                                    (["a"], [{}], ["x", "x"], "fields must be distinct")):
        with pytest.raises(ValueError, match=msg):
            KVBatchMeta._of_own_tags(keys, tags, partition_id="p", fields=fields)
