"""Placement without a Ray cluster: the unit plan, Ray staying unimported, the target probe."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tqtx.placement.plan import RayPlacementError, plan_units

A, B, C, D = ("01" * 28, "02" * 28, "03" * 28, "04" * 28)


def _node(node_id, alive=True, **resources):
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "127.0.0.1",
            "Resources": {"CPU": 4, **resources}}


def test_round_robin_over_alive_nodes_in_node_id_order():
    nodes = [_node(B), _node(C, alive=False), _node(A)]
    assert [n["NodeID"] for n in plan_units(nodes, 5, None, 1)] == [A, B, A, B, A]


def test_resource_filter_skips_nodes_without_it_or_with_zero():
    nodes = [_node(C, storage=2), _node(B, storage=0), _node(A, storage=1), _node(D, gpu=1)]
    assert [n["NodeID"] for n in plan_units(nodes, 4, "storage", 1)] == [A, C, A, C]


def test_full_nodes_are_skipped_and_fractional_cpus_count():
    nodes = [{**_node(A), "Resources": {"CPU": 1}}, _node(B)]
    assert [n["NodeID"] for n in plan_units(nodes, 4, None, 1)] == [A, B, B, B]
    one = [{**_node(A), "Resources": {"CPU": 1}}]
    assert len(plan_units(one, 10, None, 0.1)) == 10  # 1 / 0.1 is 10 slots, not 9
    assert len(plan_units(one, 50, None, 0)) == 50     # 0 CPU: no limit


def test_impossible_plans_name_what_is_missing():
    with pytest.raises(RayPlacementError, match=r"resource 'ssd'.*resources: \['CPU', 'gpu'\]"):
        plan_units([_node(A, gpu=1)], 1, "ssd", 1)
    with pytest.raises(RayPlacementError, match=r"9 units of 1 CPU .* at most 8 fit"):
        plan_units([_node(A), _node(B)], 9, None, 1)
    with pytest.raises(RayPlacementError, match="no alive node"):
        plan_units([_node(A, alive=False)], 1, None, 1)


def test_tqtx_and_its_servers_never_import_ray():
    code = ("import sys, tqtx, tqtx.api, tqtx.cli, tqtx.storage.unit, tqtx.controller.server, "
            "tqtx.placement.probe, tqtx.placement.plan, tqtx.placement.ray_init\n"
            "import tqtx.storage.__main__, tqtx.controller.__main__\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_embedded_init_does_not_import_ray(tmp_path):
    code = ("import sys, tqtx as tq\n"
            f"tq.init({{'num_units': 1, 'state_dir': {str(tmp_path / 's')!r}}})\n"
            "tq.close()\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_unknown_placement_is_refused(tq_start):
    with pytest.raises(ValueError, match="'placement' must be one of 'local', 'ray'"):
        tq_start(placement="k8s")


def _probe_counts(tq) -> list[int]:
    return [u["ops"].get("PROBE_PATH", {}).get("count", 0)
            for u in tq.get_client().stats()["units"]]


def test_embedded_dumps_skip_the_probe(tq_start, tmp_path, pid):
    import tqtx as tq
    tq_start(num_units=2)
    tq.kv_batch_put(["a", "b"], pid, {"x": __import__("torch").tensor([1.0, 2.0])})
    tq.dump_data_by_key(tmp_path / "d", ["a", "b"], pid)
    assert _probe_counts(tq) == [0, 0]


def test_attached_by_address_probes_every_unit_once_and_cleans_up(tmp_path, pid):
    import torch

    import tqtx as tq
    from tqtx.deploy import LocalDeployment
    dep = LocalDeployment(num_units=2, state_dir=str(tmp_path / "state"), owner_record=False)
    try:
        tq.close()
        tq.init({"address": dep.address})
        tq.kv_batch_put(["a", "b"], pid, {"x": torch.tensor([1.0, 2.0])})
        tq.dump_data_by_key(tmp_path / "d", ["a", "b"], pid)
        assert _probe_counts(tq) == [1, 1]
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tqtx-probe-")]
        tq.save_checkpoint(tmp_path / "ckpt")
        assert _probe_counts(tq) == [2, 2]
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tqtx-probe-")]
    finally:
        tq.close()
        dep.stop()


def test_a_unit_that_cannot_see_the_target_is_named(tmp_path, pid):
    """The unit answers PROBE_PATH from its own view of the filesystem: a probe the client
    did not write (another host's directory) is refused, naming the path."""
    from tqtx.client import Client
    from tqtx.deploy import LocalDeployment
    from tqtx.wire.peer import Peer
    dep = LocalDeployment(num_units=1, state_dir=str(tmp_path / "state"), owner_record=False)
    try:
        client = Client(dep.address, timeout=30)
        unit = Peer(client.unit_addresses[0], "unit 0", timeout=30)
        client.close()
        name = ".tqtx-probe-feedface"
        with pytest.raises(FileNotFoundError, match=f"{name}.*not on a filesystem shared"):
            unit.call("PROBE_PATH", {"dir": str(tmp_path), "name": name, "token": "t"})
        with pytest.raises(ValueError, match="not a probe file name"):
            unit.call("PROBE_PATH", {"dir": str(tmp_path), "name": "../etc", "token": "t"})
        unit.close()
    finally:
        dep.stop()


def test_transferqueue_required_node_resource_is_unit_node_resource():
    from tqtx.deploy.initconfig import resolve
    cfg = resolve({"backend": {"SimpleStorage": {"num_data_storage_units": 4,
                                                 "required_node_resource": "storage_pool"}}})
    assert cfg == {"num_units": 4, "unit_node_resource": "storage_pool"}
    cfg = resolve({"placement": "ray", "ray_start_timeout": 5, "ray_num_cpus": 0.5,
                   "ray_name": "x", "unit_node_resource": "r"})
    assert cfg["placement"] == "ray" and cfg["ray_name"] == "x"
