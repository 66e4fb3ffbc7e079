"""The client's lease for puts of new keys (no processes): which puts may use it, and when
it is dropped (another controller incarnation, another process, age)."""
from __future__ import annotations

import os

from tqtx.client import lease as lm
from tqtx.client.lease import LEASE_LOW, LEASE_SIZE, MAX_LEASED_KEYS, PutLease


def _lease(n=10, incarnation=7):
    lease = PutLease()
    lease.add([list(range(n)), list(range(100, 100 + n))], incarnation)
    return lease


def test_pairs_are_taken_once_in_order():
    lease = _lease()
    assert lease.take("p", ["a", "b"], 7) == ([0, 1], [100, 101])
    assert lease.take("p", ["c"], 7) == ([2], [102])


def test_a_put_the_lease_does_not_fit_takes_nothing():
    lease = _lease(3)
    assert lease.take("p", ["a", "a"], 7) is None  # a repeated key
    assert lease.take("p", [f"k{i}" for i in range(MAX_LEASED_KEYS + 1)], 7) is None
    assert lease.take("p", ["a", "b", "c", "d"], 7) is None  # more keys than pairs
    assert lease.take("p", ["a", "b", "c"], 7) == ([0, 1, 2], [100, 101, 102])


def test_keys_this_client_put_lately_are_updates():
    lease = _lease()
    lease.remember("p", ["a"])
    assert lease.take("p", ["a"], 7) is None and lease.take("q", ["a"], 7) == ([0], [100])
    lease.remember("p", [f"big{i}" for i in range(MAX_LEASED_KEYS + 1)])  # not remembered
    assert lease.take("p", ["big0"], 7) == ([1], [101])
    lease.forget("p", ["a"])  # cleared by this client: a put of it creates it again
    assert lease.take("p", ["a"], 7) == ([2], [102])


def test_another_controller_incarnation_drops_the_lease():
    lease = _lease()
    assert lease.take("p", ["a"], 8) is None
    assert lease.take("p", ["a"], 7) is None  # gone for good, not kept for the old one


def test_a_forked_child_holds_none_of_its_parents_lease():
    lease = _lease()
    child = os.fork()
    if child == 0:  # the child: the pairs are its parent's
        os._exit(0 if lease.take("p", ["a"], 7) is None else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lease.take("p", ["a"], 7) == ([0], [100])  # still the parent's


def test_an_old_lease_is_dropped(monkeypatch):
    lease = _lease()
    later = lm.time.monotonic() + lm.LEASE_MAX_AGE + 1
    monkeypatch.setattr(lm.time, "monotonic", lambda: later)
    assert lease.take("p", ["a"], 7) is None


def test_a_lease_is_asked_for_when_few_pairs_are_left():
    lease = PutLease()
    assert lease.wanted() == LEASE_SIZE
    lease.add([list(range(LEASE_LOW)), list(range(LEASE_LOW))], 1)
    assert lease.wanted() == 0
    lease.take("p", ["a"], 1)
    assert lease.wanted() == LEASE_SIZE
