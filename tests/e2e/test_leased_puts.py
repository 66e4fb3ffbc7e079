"""Small puts of new keys through the client's lease (tqtx/client/lease.py), with real
processes: no ALLOC round trip, and every case the lease does not fit goes through ALLOC
with the same outcome and leaves no row behind."""
from __future__ import annotations

import pytest
import torch

import tqtx as tq
from tqtx import SchemaConflictError


def _ops(op: str) -> int:
    return tq.get_client().controller.call("STATS")["ops"].get(op, {}).get("count", 0)


def _rows(got, field) -> list:
    return [row.reshape(-1).tolist() for row in got[field].unbind()]


def _unit_rows() -> int:
    client = tq.get_client()
    return sum(client.unit(u).call("STATS")["rows"] for u in range(client.num_units))


def test_puts_of_new_keys_need_no_alloc(tq_start):
    tq_start(num_units=2)
    tq.kv_put("first", "p", {"x": torch.tensor([0])})  # an ALLOC, which leases indexes
    allocs = _ops("ALLOC")
    for i in range(20):
        tq.kv_put(f"k{i}", "p", {"x": torch.tensor([i])}, tag={"i": i})
    assert _ops("ALLOC") == allocs
    got = tq.kv_batch_get([f"k{i}" for i in range(20)], "p")
    assert _rows(got, "x") == [[i] for i in range(20)]
    assert tq.kv_list("p")["p"]["k7"] == {"i": 7}
    assert _unit_rows() == 21


def test_a_key_that_exists_goes_through_alloc_and_its_rows_are_not_left(tq_start):
    tq_start(num_units=2)
    tq.kv_put("a", "p", {"x": torch.tensor([1, 2])})
    tq.kv_put("b", "p", {"x": torch.tensor([3, 4])})
    lease = tq.get_client().lease
    lease._known.clear()  # as a client that never put "a": it believes the key new
    allocs = _ops("ALLOC")
    tq.kv_put("a", "p", {"y": torch.tensor([5.0])})  # refused by the lease, then ALLOC
    assert _ops("ALLOC") == allocs + 1
    assert _rows(tq.kv_batch_get(["a", "b"], "p"), "x") == [[1, 2], [3, 4]]
    assert _rows(tq.kv_batch_get(["a"], "p"), "y") == [[5.0]]
    assert _unit_rows() == 2  # the rows written at the leased index were dropped


def test_a_schema_conflict_is_the_same_error_with_or_without_a_lease(tq_start):
    tq_start(num_units=2)
    tq.kv_put("a", "p", {"x": torch.tensor([1])})
    with pytest.raises(SchemaConflictError, match="'x'"):
        tq.kv_put("new", "p", {"x": torch.tensor([1.5])})  # float into an int64 field
    assert sorted(tq.kv_list("p")["p"]) == ["a"] and _unit_rows() == 1


def test_a_restarted_controller_refuses_an_old_lease_and_the_put_still_lands(tq_start):
    from tqtx import api
    tq_start(num_units=2)
    tq.kv_put("a", "p", {"x": torch.tensor([1])})
    api._deployment_handle().restart_controller()
    tq.kv_put("b", "p", {"x": torch.tensor([2])})
    tq.kv_put("c", "p", {"x": torch.tensor([3])})
    assert _rows(tq.kv_batch_get(["a", "b", "c"], "p"), "x") == [[1], [2], [3]]
    assert _unit_rows() == 3
