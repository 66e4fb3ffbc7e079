"""Ray placement on a real local Ray cluster: a head and two extra nodes, all on 127.0.0.1.

One cluster (``ray.cluster_utils.Cluster``) is shared by the module. Nodes are told apart
by custom resources (``storage`` on the two extra nodes). Ray is told to use the loopback
address for every node (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray's own
address detection answer 127.0.0.1, and every node gets ``node_ip_address``), so no
traffic leaves loopback; the test checks the addresses Ray and tqtx really use.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported
ray = pytest.importorskip("ray", reason="Ray placement tests need `pip install 'tqtx[ray]'`")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tqtx as tq  # noqa: E402
from tqtx.errors import RowsLostError, TqtxError  # noqa: E402
from whole_job import kill_whole_job, wait_units_registered  # noqa: E402

LOOPBACK = "127.0.0.1"
# The first test also starts the module's cluster; under pytest-xdist every test of this
# module runs on one worker, so one Ray cluster serves them all.
# The tests compare dense columns: strict mode (the actors' processes, started by Ray, run
# with the default and read only 0-d fields, dense in both).
# A Ray cluster costs tens of seconds before its first test: the module is in the full
# suite only (the placement plan and probe without Ray: tests/deployment/test_placement.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray"), pytest.mark.strict,
              pytest.mark.slow]


def _proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_gone(pids, timeout=60.0) -> list:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _proc_alive(p)]
        time.sleep(0.2)
    return alive


def _procs_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and _proc_alive(int(name)):
            out.append(int(name))
    return out


def _tqtx_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == "tqtx"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="tqtx-ray-", dir="/tmp")  # short: Ray's socket paths
    # Ray's Cluster writes a "current cluster" address file under <RAY_TMPDIR>/ray whatever
    # the head's temp_dir (/tmp/ray by default, which a fresh machine lacks and a user's Ray
    # owns): ours goes into this test's own directory.
    old_ray_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir
    os.mkdir(os.path.join(temp_dir, "ray"))
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"head": 1}, "include_dashboard": False,
            "node_ip_address": LOOPBACK, "temp_dir": temp_dir})
        nodes = {"n1": c.add_node(num_cpus=2, resources={"storage": 1, "n1": 1},
                                  node_ip_address=LOOPBACK),
                 "n2": c.add_node(num_cpus=2, resources={"storage": 1, "n2": 1},
                                  node_ip_address=LOOPBACK)}
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        ids = {"head": ray.get_runtime_context().get_node_id()}
        for n in ray.nodes():
            for tag in ("n1", "n2"):
                if tag in n["Resources"]:
                    ids[tag] = n["NodeID"]
        yield {"cluster": c, "nodes": nodes, "ids": ids, "address": c.address,
               "temp_dir": temp_dir}
    finally:
        tq.close()
        ray.shutdown()
        if c is not None:
            c.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if old_ray_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_ray_tmpdir


@pytest.fixture
def ray_tq(cluster, tmp_path):
    """``start(**config)``: a Ray-placed deployment closed at the end of the test."""
    counter = {"n": 0}

    def start(**config):
        tq.close()
        counter["n"] += 1
        config.setdefault("state_dir", str(tmp_path / f"state{counter['n']}"))
        config.setdefault("ray_num_cpus", 0.5)
        config.setdefault("ray_start_timeout", 120)  # a loaded 2-core CI machine
        return tq.init({"placement": "ray", **config})

    yield start
    tq.close()
    assert _tqtx_actors() == []


def _put(keys, pid, base=0.0):
    n = len(keys)
    td = TensorDict({"reward": torch.arange(n, dtype=torch.float32) + base,
                     "tokens": torch.arange(n * 8, dtype=torch.int64).reshape(n, 8)},
                    batch_size=[n])
    tq.kv_batch_put(keys, pid, td, tags=[{"i": i} for i in range(n)])
    return td


def test_everything_stays_on_loopback(cluster, ray_tq):
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {LOOPBACK}
    assert cluster["address"].startswith(LOOPBACK + ":")
    info = ray_tq(num_units=2)
    assert info["address"].startswith(f"tcp://{LOOPBACK}:")
    assert all(u.startswith(f"tcp://{LOOPBACK}:") for u in info["units"])
    assert info["curve"] is False


def test_units_pinned_round_robin_and_reported(cluster, ray_tq):
    ids = cluster["ids"]
    info = ray_tq(num_units=4, unit_node_resource="storage")
    assert info["mode"] == "ray"
    order = sorted([ids["n1"], ids["n2"]])  # round-robin in node-ID order
    assert [u["node_id"] for u in info["unit_nodes"]] == [order[0], order[1], order[0], order[1]]
    assert info["controller_node"]["node_id"] == ids["head"]  # the state dir's node
    stats = tq.get_client().stats()
    assert [u["node"] for u in stats["units"]] == [u["node_id"] for u in info["unit_nodes"]]
    out = subprocess.run([sys.executable, "-m", "tqtx", "stats", "--address", info["address"],
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [u["node"] for u in json.loads(out.stdout)["units"]] == \
        [u["node_id"] for u in info["unit_nodes"]]
    # the units' server processes run on this machine: each one is alive
    assert all(_proc_alive(p) for p in info["pids"].values())


def test_the_durability_setting_reaches_units_on_other_nodes(cluster, ray_tq, monkeypatch):
    """A server's environment is its node's: the driver hands the mapped setting to every
    unit; a "~" unit data dir is expanded by the unit's node."""
    monkeypatch.delenv("TQTX_UNIT_DATA_DIR", raising=False)
    monkeypatch.setenv("TQTX_FLUSH_INTERVAL_S", "0.5")
    with pytest.warns(DeprecationWarning, match="'off' is deprecated; use 'memory'"):
        info = ray_tq(num_units=2, unit_node_resource="storage", durability="off",
                      unit_data_dir="~/tqtx-rows")
    assert info["durability"] == "memory"
    stats = tq.get_client().stats()
    assert (stats["controller"]["durability"], stats["controller"]["flush_interval_s"]) == \
        ("memory", 0.5)
    for uid in range(2):
        with open(f"/proc/{info['pids'][f'unit {uid}']}/environ", "rb") as f:
            env = dict(i.decode().split("=", 1) for i in f.read().split(b"\0") if b"=" in i)
        assert (env["TQTX_DURABILITY"], env["TQTX_FLUSH_INTERVAL_S"],
                env["TQTX_UNIT_DATA_DIR"]) == ("memory", "0.5",
                                               os.path.expanduser("~/tqtx-rows"))


def test_dump_by_units_on_two_nodes_restores_on_other_count_and_nodes(cluster, ray_tq, tmp_path,
                                                                    pid):
    ids = cluster["ids"]
    info = ray_tq(num_units=2, unit_node_resource="storage")
    assert {u["node_id"] for u in info["unit_nodes"]} == {ids["n1"], ids["n2"]}
    keys = [f"k{i}" for i in range(40)]
    td = _put(keys, pid)
    dump = tmp_path / "dump"
    report = tq.dump_data_by_key(dump, keys, pid)
    assert report["shards"] == 2 and report["via"] == "units"
    manifest = json.loads((dump / "dump_info.json").read_text())
    assert sorted(s["unit"] for s in manifest["shards"]) == [0, 1]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tqtx-probe-")]
    pids = list(info["pids"].values())
    tq.close()
    assert _wait_gone(pids, 30) == []

    info = ray_tq(num_units=3)  # head, n1 and n2: one unit each
    assert {u["node_id"] for u in info["unit_nodes"]} == set(ids.values())
    tq.load_data_by_key(dump)
    got = tq.kv_batch_get(keys, pid)
    assert torch.equal(got["reward"], td["reward"]) and torch.equal(got["tokens"], td["tokens"])
    assert tq.kv_list(pid)[pid]["k7"] == {"i": 7}


def test_bare_init_in_a_ray_actor_attaches_with_the_deployments_keys(cluster, ray_tq, pid):
    # CURVE forced on loopback: fresh keys made for this deployment reach every server
    # through Ray, and attachers through the named actor's record
    keys_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tqtx-keys-*")))
    info = ray_tq(num_units=2, unit_node_resource="storage", env={"TQTX_CURVE": "1"})
    assert info["curve"] is True
    # each server read its keys at start; no copy of them stays on any node
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tqtx-keys-*"))) <= keys_before
    _put(["a", "b"], pid, base=10.0)
    from tqtx.client import Client
    from tqtx.errors import PeerTimeoutError
    with pytest.raises(PeerTimeoutError):  # no keys: the controller never answers
        Client(info["address"], timeout=3, wait_ready=3)

    @ray.remote(num_cpus=0, resources={"n1": 0.01})
    class Trainer:
        def run(self, pid):
            import torch
            from tensordict import TensorDict

            import tqtx as tq
            cfg = tq.init()  # bare: finds the job's deployment through its named actor
            seen = tq.kv_batch_get(["a", "b"], pid)["reward"].tolist()
            tq.kv_batch_put(["c"], pid, TensorDict({"reward": torch.tensor([7.0]),
                                                    "tokens": torch.zeros(1, 8, dtype=torch.int64)},
                                                   batch_size=[1]))
            tq.close()  # an attached process never stops the deployment
            return cfg["mode"], cfg["address"], seen

    trainer = Trainer.remote()
    mode, address, seen = ray.get(trainer.run.remote(pid), timeout=120)
    ray.kill(trainer)
    assert (mode, address, seen) == ("attached", info["address"], [10.0, 11.0])
    assert tq.kv_batch_get(["c"], pid)["reward"].tolist() == [7.0]


def test_bare_init_in_a_ray_job_places_the_deployment_on_ray(cluster, tmp_path, pid):
    """No placement given, Ray initialized in this process: the deployment goes on the
    cluster (as TransferQueue's does) and a bare init() in a task attaches to it;
    placement "local" still starts the embedded one."""
    tq.close()
    try:
        info = tq.init({"num_units": 2, "state_dir": str(tmp_path / "s"), "ray_num_cpus": 0.5,
                        "ray_start_timeout": 120})
        assert (info["placement"], info["mode"]) == ("ray", "ray")
        assert len(info["unit_nodes"]) == 2

        @ray.remote(num_cpus=0)
        def attach(pid):
            import tqtx as tq
            cfg = tq.init()
            tq.kv_put("from-task", pid, tag={"t": 1})
            tq.close()
            return cfg["mode"], cfg["address"]
        assert ray.get(attach.remote(pid), timeout=120) == ("attached", info["address"])
        assert tq.kv_list(pid)[pid] == {"from-task": {"t": 1}}
    finally:
        tq.close()
    assert _tqtx_actors() == []
    try:
        local = tq.init({"placement": "local", "num_units": 1,
                         "state_dir": str(tmp_path / "local")})
        assert local["mode"] == "embedded" and "placement" not in local
    finally:
        tq.close()


def test_a_recorded_deployment_that_does_not_answer_is_an_error(cluster, tmp_path,
                                                               monkeypatch):
    """The job's deployment record names a controller this process cannot reach: init
    says so, naming the address, and starts nothing."""
    from tqtx.placement import ray_cluster, ray_init
    tq.close()
    monkeypatch.setattr(ray_init, "ATTACH_TIMEOUT", 3.0)
    silent = "tcp://127.0.0.1:9"  # loopback's discard port: nothing listens there

    @ray.remote(num_cpus=0)
    class Record:
        def get_record(self):
            return {"name": ray_cluster.default_name(), "address": silent, "num_units": 1,
                    "nodes": {}, "pids": {}, "curve": False}
    holder = Record.options(name=ray_cluster.default_name(), namespace="tqtx").remote()
    try:
        ray.get(holder.get_record.remote(), timeout=60)
        with pytest.raises(TqtxError, match=r"found the job's tqtx deployment .* cannot reach "
                                            r"its controller at tcp://127\.0\.0\.1:9 .*does "
                                            r"not start a second deployment"):
            tq.init({"state_dir": str(tmp_path / "s")})
        from tqtx import api
        assert api._client is None
        assert _tqtx_actors() == [ray_cluster.default_name()]  # only the record's holder
    finally:
        ray.kill(holder)


def test_impossible_placements_fail_fast_and_leave_nothing(cluster, ray_tq, tmp_path):
    with pytest.raises(TqtxError, match="'gpu-pool'"):
        ray_tq(num_units=2, unit_node_resource="gpu-pool")
    with pytest.raises(TqtxError, match="do not fit"):
        ray_tq(num_units=5, unit_node_resource="storage", ray_num_cpus=1)
    assert _tqtx_actors() == []

    # Fits on paper, but other actors hold the CPUs: bounded by ray_start_timeout
    @ray.remote(num_cpus=2)
    class Hog:
        def ready(self):
            return True

    hogs = [Hog.options(resources={tag: 0.01}).remote() for tag in ("n1", "n2")]
    try:
        ray.get([h.ready.remote() for h in hogs], timeout=120)
        state_dir = str(tmp_path / "starved")
        with pytest.raises(TqtxError, match=r"did not schedule 2 .*unit 0.*unit 1"):
            ray_tq(num_units=2, unit_node_resource="storage", ray_num_cpus=1,
                   ray_start_timeout=3, state_dir=state_dir)
        assert _tqtx_actors() == []
        assert _wait_gone(_procs_mentioning(state_dir), 30) == []  # the controller too
    finally:
        for h in hogs:
            ray.kill(h)
    # nothing of the failed start is in the way: the same init succeeds once CPUs are free
    info = ray_tq(num_units=2, unit_node_resource="storage", ray_num_cpus=1, state_dir=state_dir)
    assert info["mode"] == "ray" and len(info["unit_nodes"]) == 2


DRIVER = textwrap.dedent("""
    import json, os, sys, time
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)
    import tqtx as tq
    info = tq.init({"placement": "ray", "num_units": 2, "state_dir": sys.argv[2],
                    "ray_num_cpus": 0.5, "ray_name": "tqtx-killed-driver"})
    print(json.dumps(info["pids"]), flush=True)
    time.sleep(600)
""")


def test_driver_sigkill_stops_actors_and_servers(cluster, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, cluster["address"],
                             str(tmp_path / "state")], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the driver did not start its deployment"
        pids = list(json.loads(line).values())
        assert all(_proc_alive(p) for p in pids) and "tqtx-killed-driver" in _tqtx_actors()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert _wait_gone(pids, 90) == []
        deadline = time.monotonic() + 60
        while "tqtx-killed-driver" in _tqtx_actors() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "tqtx-killed-driver" not in _tqtx_actors()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


BUFFER_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)
    import torch
    from tensordict import TensorDict
    import tqtx as tq
    info = tq.init({"placement": "ray", "num_units": 2, "state_dir": sys.argv[2],
                    "ray_num_cpus": 0.5, "unit_node_resource": "storage",
                    "durability": "buffer", "flush_interval_s": 0.2})
    keys = [f"k{i}" for i in range(16)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(64).reshape(16, 4)},
                                          batch_size=[16]))
    time.sleep(1.0)  # the units' row logs written and fsynced
    print(json.dumps(info["pids"]), flush=True)
    time.sleep(600)
""")


def test_a_killed_ray_job_brings_its_buffer_back_on_the_same_nodes(cluster, ray_tq, tmp_path):
    """Durability buffer on Ray: each unit logs on its node; the driver is SIGKILLed (its
    servers go with it), and a new deployment on the same state dir and nodes serves every
    row again."""
    state = str(tmp_path / "state")
    proc = subprocess.Popen([sys.executable, "-c", BUFFER_DRIVER, cluster["address"], state],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the driver did not start its deployment"
        pids = list(json.loads(line).values())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert _wait_gone(pids, 90) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    ray_tq(num_units=2, unit_node_resource="storage", durability="buffer", state_dir=state)
    wait_units_registered()
    keys = [f"k{i}" for i in range(16)]
    assert sorted(tq.kv_list()["p"]) == sorted(keys) and tq.list_lost_keys() == {}
    assert tq.kv_batch_get(keys, "p")["x"].tolist() == torch.arange(64).reshape(16, 4).tolist()


def _victim(cluster, tag):
    node = cluster["cluster"].add_node(num_cpus=1, resources={tag: 1}, node_ip_address=LOOPBACK)
    node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and tag in n["Resources"])
    return node, node_id


def _remove_when(cluster, node, ready, timeout=120.0):
    """Remove ``node`` from another thread as soon as ``ready()`` is true (polled)."""
    def run():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ready():
                    break
            except Exception:
                pass
            time.sleep(0.05)
        cluster["cluster"].remove_node(node)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _writing(dump):
    """The dump's staging dir exists: its units are being asked to write their shards."""
    return any(p.name.startswith(dump.name + ".tmp-") for p in dump.parent.iterdir())


def _claimed():
    """Some unit claimed its part of a running restore (and now waits at the fault point)."""
    return any(u["state"] == "claimed" for r in tq.list_restores() for u in r["units"])


def test_node_lost_during_a_dump_keeps_the_old_dump(cluster, ray_tq, tmp_path, pid):
    node, node_id = _victim(cluster, "victim_dump")
    # one unit per node (head, n1, n2, victim); the second dump's writes wait 5 s, and the
    # victim node is removed as soon as that dump's staging dir exists
    fault = {"TQTX_FAULTS": "unit.dump.before_write@2:delay:5"}
    info = ray_tq(num_units=4, ray_num_cpus=1, unit_env={u: fault for u in range(4)})
    lost = next(u["unit"] for u in info["unit_nodes"] if u["node_id"] == node_id)
    keys = [f"k{i}" for i in range(16)]
    _put(keys, pid)
    dump = tmp_path / "dump"
    first = tq.dump_data_by_key(dump, keys, pid)
    _put(keys, pid, base=100.0)
    timer = _remove_when(cluster, node, lambda: _writing(dump))
    with pytest.raises(TqtxError, match=rf"unit {lost} \(node {node_id[:8]}") as err:
        tq.dump_data_by_key(dump, keys, pid)
    timer.join()
    assert "DUMP_ROWS" in str(err.value)  # lost while writing, not before
    assert tq.read_row_index(dump)["dump_id"] == first["dump_id"]  # old-or-new: the old one
    out = subprocess.run([sys.executable, "-m", "tqtx", "journal", "show", str(dump), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"unit {lost} (node {node_id[:8]}" in out.stdout
    assert str(err.value).split(" (node")[0] in out.stdout
    # a put that needs the lost unit fails naming it and its node
    with pytest.raises(TqtxError, match=rf"unit {lost} \(node {node_id[:8]}"):
        _put(keys, pid, base=200.0)
    readable = {}
    for i, k in enumerate(keys):  # rows on the surviving units still read, each whole
        try:
            readable[i] = tq.kv_batch_get([k], pid)["reward"].item()
        except TqtxError as exc:
            assert f"unit {lost} (node {node_id[:8]}" in str(exc)
    # a put is not a transaction across units: surviving units hold the failed put's
    # values (docs/deployment.md, "When a node is lost")
    assert len(readable) == 12 and all(v in (100.0 + i, 200.0 + i) for i, v in readable.items())
    pids = list(info["pids"].values())
    tq.close()
    assert _wait_gone(pids, 30) == []


def test_node_lost_during_a_restore_publishes_nothing(cluster, ray_tq, tmp_path, pid):
    info = ray_tq(num_units=2, unit_node_resource="storage")
    keys = [f"k{i}" for i in range(16)]
    _put(keys, pid)
    dump = tmp_path / "dump"
    tq.dump_data_by_key(dump, keys, pid)
    tq.close()

    node, node_id = _victim(cluster, "victim_restore")
    fault = {"TQTX_FAULTS": "unit.load.after_claim:delay:5"}
    info = ray_tq(num_units=4, ray_num_cpus=1, unit_env={u: fault for u in range(4)})
    lost = next(u["unit"] for u in info["unit_nodes"] if u["node_id"] == node_id)
    timer = _remove_when(cluster, node, _claimed)
    with pytest.raises(TqtxError, match=rf"unit {lost} \(node {node_id[:8]}"):
        tq.load_data_by_key(dump)
    timer.join()
    assert pid not in tq.kv_list()  # all or nothing: no key of the dump is visible
    assert tq.list_restores() == []
    def journal(*args):
        out = subprocess.run([sys.executable, "-m", "tqtx", "journal", "show", *args, "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    # the dump's journal: its reader ended aborted; the controller's journal says why
    assert [r["state"] for r in journal(str(dump))["restores"]] == ["aborted"]
    why = [r for r in journal("--state-dir", info["state_dir"])["restores"]
           if r["dump_dir"] == str(dump)]
    assert len(why) == 1 and why[0]["state"] == "aborted"
    assert f"unit {lost} (node {node_id[:8]}" in why[0]["reason"]
    pids = list(info["pids"].values())
    tq.close()
    assert _wait_gone(pids, 30) == []


def test_rows_of_a_lost_node_are_named_lost_after_a_restart(cluster, ray_tq, tmp_path):
    """Durability buffer on Ray, one unit per storage node: a node is lost with its disk
    (its unit's row log goes with it), then the job is killed and started again on the
    nodes left. The rows the other units logged are back bit for bit; every key of the lost
    node's unit is named lost (list_lost_keys, RowsLostError naming the key), none silently
    missing, and the journal's recovery event for that unit counts them."""
    node = cluster["cluster"].add_node(num_cpus=1, resources={"storage": 1, "victim_rows": 1},
                                       node_ip_address=LOOPBACK)
    node_id = next(n["NodeID"] for n in ray.nodes()
                   if n["Alive"] and "victim_rows" in n["Resources"])
    state, data = str(tmp_path / "state"), str(tmp_path / "rows")
    cfg = {"num_units": 3, "unit_node_resource": "storage", "durability": "buffer",
           "flush_interval_s": 0.2, "state_dir": state, "unit_data_dir": data}
    info = ray_tq(**cfg)  # a unit on each storage node: n1, n2 and the victim
    lost_unit = next(u["unit"] for u in info["unit_nodes"] if u["node_id"] == node_id)
    keys = [f"k{i}" for i in range(24)]
    values = torch.arange(24 * 4).reshape(24, 4)
    tq.kv_batch_put(keys, "p", TensorDict({"x": values}, batch_size=[24]))
    time.sleep(1.0)  # every unit's row log written and fsynced
    cluster["cluster"].remove_node(node)     # the node, its unit and its disk are gone
    shutil.rmtree(os.path.join(data, f"unit-{lost_unit}"))
    kill_whole_job()                         # then the job dies

    ray_tq(**cfg)                            # started again on the nodes left
    wait_units_registered(90)
    on_lost = {k for i, k in enumerate(keys) if i % 3 == lost_unit}
    kept = [k for k in keys if k not in on_lost]
    # every key is either readable (listed) or named lost: none is silently missing
    assert set(tq.kv_list()["p"]) == set(kept) and len(on_lost) == 8
    assert set(tq.list_lost_keys().get("p", ())) == on_lost
    got = tq.kv_batch_get(kept, "p")["x"].tolist()
    assert got == [values[keys.index(k)].tolist() for k in kept]
    for k in sorted(on_lost)[:2]:
        with pytest.raises(RowsLostError, match=k):
            tq.kv_batch_get([k], "p")
    out = subprocess.run([sys.executable, "-m", "tqtx", "journal", "show", "--state-dir", state,
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = [e for e in json.loads(out.stdout)["recovery_events"]
              if e["kind"] == "buffer" and e["target"] == f"unit {lost_unit}"]
    assert [e["action"] for e in events] == ["rows_lost"]
    assert f"{len(on_lost)} rows of committed keys missing" in events[0]["detail"]
