"""Indexes leased for puts of new keys (controller side, no processes): a lease is taken
only for keys that are all new, at indexes still leased at their generations; anything else
gives the lease back and changes nothing else."""
from __future__ import annotations

import pytest

from tqtx.controller import metadata as md
from tqtx.controller.metadata import Metadata

INT = {"kind": "tensor", "dtype": "int64", "ndim": 1}
FLOAT = {"kind": "tensor", "dtype": "float32", "ndim": 1}


def _leased(meta, n=4):
    indexes, gens = meta.grant_lease(n)
    assert all(meta.gens[i] == g for i, g in zip(indexes, gens))
    return indexes, gens


def test_new_keys_become_pending_at_their_leased_indexes():
    meta = Metadata(incarnation=3)
    indexes, gens = _leased(meta)
    assert meta.take_leased("p", ["a", "b"], indexes[:2], gens[:2], {"x": INT})
    part = meta.partition("p")
    assert part.pending == {"a": indexes[0], "b": indexes[1]} and part.schema["x"] == INT
    assert list(meta.leased) == indexes[2:]  # each leased index is used once
    assert not meta.take_leased("p", ["c"], indexes[:1], gens[:1], {})  # used already


def test_an_existing_key_refuses_the_lease_and_gives_its_indexes_back():
    meta = Metadata()
    old = meta.alloc("p", ["a"], {})[0][0]  # "a" is pending (an ALLOC of another client)
    indexes, gens = _leased(meta, 2)
    assert not meta.take_leased("p", ["new", "a"], indexes, gens, {})
    part = meta.partition("p")
    assert part.pending == {"a": old} and "new" not in part.pending
    assert meta.leased == {} and all(i not in meta.gens for i in indexes)  # free again
    again = meta.allocate_rows(2)
    assert sorted(again[0]) == sorted(indexes)
    assert min(again[1]) > max(gens)  # reused only with newer generations: the fence


@pytest.mark.parametrize("how", ["wrong generation", "never leased", "repeated key",
                                 "schema conflict"])
def test_a_lease_that_does_not_hold_changes_nothing(how):
    meta = Metadata()
    meta.alloc("p", ["a"], {"x": INT})
    indexes, gens = _leased(meta, 2)
    keys, schemas = ["k1", "k2"], {}
    if how == "wrong generation":
        gens = [gens[0], gens[1] + 1]
    elif how == "never leased":
        indexes = [indexes[0], indexes[1] + 100]
    elif how == "repeated key":
        keys = ["k1", "k1"]
    else:
        schemas = {"x": FLOAT}
    assert not meta.take_leased("p", keys, indexes, gens, schemas)
    assert meta.partition("p").pending.keys() == {"a"}
    assert meta.partition("p").schema == {"x": INT}


def test_old_leases_are_taken_back_at_the_next_grant(monkeypatch):
    meta = Metadata()
    now = [1000.0]
    monkeypatch.setattr(md.time, "monotonic", lambda: now[0])
    first, gens = meta.grant_lease(3)
    now[0] += md.LEASE_TTL + 1
    second, _ = meta.grant_lease(1)
    assert list(meta.leased) == second and second[0] in first  # reused, newer generation
    assert not meta.take_leased("p", ["a"], first[1:2], gens[1:2], {})


def test_a_checkpoint_load_ends_every_lease():
    meta = Metadata()
    indexes, gens = _leased(meta, 2)
    meta.replace({"next_index": 0, "partitions": {}})
    assert meta.leased == {}
    assert not meta.take_leased("p", ["a"], indexes[:1], gens[:1], {})
