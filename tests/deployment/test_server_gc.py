"""Servers freeze their start-up objects (``gc.freeze``) before they serve.

A controller holds the journal's ORM and the metadata it recovered; a unit, its code and
sockets. A full collection that walks all of them while a request waits cost a restore's
publish 26 ms here; frozen, they are left out of every later collection and a full one
walks only what requests made since."""
from __future__ import annotations

import torch

import tqtx as tq


def test_the_controller_and_every_unit_froze_their_start_up_objects(tq_shared, pid):
    tq.kv_batch_put([f"k{i}" for i in range(8)], pid, {"x": torch.ones(8, 2)})
    stats = tq.get_client().stats()
    # tens of thousands of objects from the imports alone; 0 if nothing was frozen
    assert stats["controller"]["gc_frozen"] > 10_000
    assert len(stats["units"]) == tq_shared["num_units"]
    for unit in stats["units"]:
        assert unit["gc_frozen"] > 5_000, unit["unit_id"]
