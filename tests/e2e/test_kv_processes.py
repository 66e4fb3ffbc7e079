"""Deployments across processes: embedded start/stop, attaching, `tqtx serve`, failures."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import tqtx as tq
import tqtx.api as tq_api
from tqtx import PeerDiedError, PeerTimeoutError
from tq_procs import alive, wait_gone  # noqa: F401


# ---------------------------------------------------------------- helpers
def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TQTX_ADDRESS"}
    env.update(extra)
    return env


def start_serve(state_dir, units=2):
    """Run ``tqtx serve`` as a subprocess; returns (proc, announcement dict)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tqtx", "serve", "--units", str(units), "--port", "0",
         "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"tqtx serve printed nothing: {proc.stderr.read()}")
    # `tqtx serve` installs its SIGTERM handler before it announces itself (see
    # test_serve_sigterm_right_after_announcement); read up to its stderr banner, then
    # keep draining stderr (children log warnings there) so nobody blocks on a full pipe
    while "tqtx serving at" not in (proc.stderr.readline() or "tqtx serving at"):
        pass
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, json.loads(line)


def stop_serve(proc, timeout=15):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()
    return proc.returncode


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A deployment owned by a `tqtx serve` subprocess (2 units)."""
    state = tmp_path_factory.mktemp("serve-state")
    proc, info = start_serve(state)
    info["proc"] = proc
    yield info
    stop_serve(proc)


@pytest.fixture
def attach():
    """``attach(address, **config)`` attaches this process; disconnects after the test."""
    tq.close()

    def _attach(address, **config):
        tq.close()
        return tq.init(config or None, address=address)

    yield _attach
    tq.close()


# ---------------------------------------------------------------- embedded lifecycle
def test_init_without_arguments_starts_embedded_deployment(tmp_path, monkeypatch):
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    monkeypatch.setenv("TQTX_STATE_DIR", str(tmp_path / "state"))
    try:
        cfg = tq.init()
        assert cfg["mode"] == "embedded"
        assert cfg["num_units"] == 2 and cfg["host"] == "127.0.0.1"
        assert cfg["address"].startswith("tcp://127.0.0.1:")
        assert cfg["state_dir"] == str(tmp_path / "state")
        assert all(u.startswith("tcp://127.0.0.1:") for u in cfg["units"])
        pids = list(cfg["pids"].values())
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert tq.init() == cfg  # idempotent while initialized
        tq.kv_put("k", "p", {"v": 1})
        assert tq.kv_list() == {"p": {"k": {}}}
    finally:
        tq.close()
    assert wait_gone(pids, 5) == []
    with pytest.raises(tq.TqtxError, match="not initialized"):
        tq.kv_list()
    assert tq.close() == {"waited": [], "cancelled": []}  # close twice is fine


def test_init_with_config_dict(tq_start, tmp_path):
    state = tmp_path / "cfg-state"
    cfg = tq_start(num_units=1, state_dir=str(state), host="127.0.0.1")
    assert cfg["mode"] == "embedded" and cfg["num_units"] == 1
    assert cfg["state_dir"] == str(state) and cfg["address"].startswith("tcp://127.0.0.1:")
    assert set(cfg["pids"]) == {"controller", "unit 0"}
    assert (state / "logs" / "controller.log").exists()
    assert (state / "logs" / "unit-0.log").exists()
    tq.close()
    with pytest.raises(ValueError, match="unknown config keys"):
        tq.init({"num_unit": 2, "state_dir": str(state)})
    with pytest.raises(ValueError, match="num_units"):
        tq.init({"num_units": 0, "state_dir": str(state)})


_EMBEDDED_CHILD = textwrap.dedent("""
    import json, sys, time
    import tqtx as tq
    cfg = tq.init({"state_dir": sys.argv[1]})
    print(json.dumps(cfg["pids"]), flush=True)
    if sys.argv[2] == "sleep":
        time.sleep(120)
""")


def _spawn_embedded(state_dir, mode):
    proc = subprocess.Popen([sys.executable, "-c", _EMBEDDED_CHILD, str(state_dir), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)


def test_kill9_of_parent_leaves_no_orphans(tmp_path):
    proc, pids = _spawn_embedded(tmp_path / "s", "sleep")
    try:
        assert set(pids) == {"controller", "unit 0", "unit 1"}
        assert all(alive(p) for p in pids.values())
        proc.kill()
        proc.wait()
        assert wait_gone(pids.values(), 5) == [], f"orphans left: {pids}"
    finally:
        _reap(proc, pids)


def test_interpreter_exit_without_close_stops_children(tmp_path):
    proc, pids = _spawn_embedded(tmp_path / "s", "exit")
    try:
        assert proc.wait(30) == 0
        assert wait_gone(pids.values(), 5) == []
    finally:
        _reap(proc, pids)


def _reap(proc, pids):
    """Kill whatever a failed test left alive and close the launcher's pipes."""
    for p in pids.values():
        if alive(p):
            os.kill(p, signal.SIGKILL)
    proc.stdout.close()
    proc.stderr.close()


# ---------------------------------------------------------------- dead peers
@pytest.mark.slow
def test_unit_killed_raises_peer_died_quickly(tq_start):
    import torch
    from tensordict import TensorDict
    cfg = tq_start(num_units=2)
    keys = [f"k{i}" for i in range(8)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(8)}, batch_size=[8]))
    victim = cfg["pids"]["unit 1"]
    os.kill(victim, signal.SIGKILL)
    assert wait_gone([victim], 5) == []
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="unit 1") as ei:
        tq.kv_batch_get(keys, "p")
    assert time.monotonic() - t0 < 5, "dead unit detected only after a long wait"
    assert "gone" in str(ei.value)
    # the controller is still fine: metadata operations work
    assert sorted(tq.kv_list("p")["p"]) == sorted(keys)
    ctl = cfg["pids"]["controller"]
    os.kill(ctl, signal.SIGKILL)
    assert wait_gone([ctl], 5) == []
    # a client waits up to reconnect_timeout for a restarted controller, then says so
    tq_api._client.reconnect_timeout = 1.0
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="controller") as ei:
        tq.kv_list()
    assert "did not come back within 1s" in str(ei.value)
    assert time.monotonic() - t0 < 1.0 + 5


def test_bare_init_attaches_to_the_serve_deployment_of_its_state_dir(served, attach):
    """`tqtx serve` owns the state dir: init() there attaches instead of failing."""
    tq.close()
    try:
        cfg = tq.init({"state_dir": served["state_dir"]})
        assert cfg["mode"] == "attached" and cfg["address"] == served["address"]
        assert cfg["state_dir"] == served["state_dir"]
    finally:
        tq.close()
    # only disconnected: the running deployment is unharmed
    assert all(alive(p) for p in served["pids"].values())
    cfg = attach(served["address"])
    assert cfg["state_dir"] == served["state_dir"]


def test_init_attaches_to_embedded_deployment_of_another_process(tmp_path):
    tq.close()
    state = tmp_path / "s"
    proc, pids = _spawn_embedded(state, "sleep")
    try:
        cfg = tq.init({"state_dir": str(state)})
        assert cfg["mode"] == "attached" and cfg["owner_pid"] == proc.pid
        assert cfg["pids"] == pids
        tq.close()
        assert all(alive(p) for p in pids.values())
    finally:
        tq.close()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        wait_gone(pids.values(), 5)


# ---------------------------------------------------------------- tqtx serve / attach
def test_serve_attach_put_get_and_close_only_disconnects(served, attach):
    import torch
    cfg = attach(served["address"])
    assert cfg["mode"] == "attached" and cfg["num_units"] == 2
    assert cfg["address"] == served["address"]
    tq.kv_put("a", "serve-p", {"x": torch.arange(3)}, tag={"by": "test"})
    assert [t.tolist() for t in tq.kv_batch_get(["a"], "serve-p")["x"].unbind()] == [[0, 1, 2]]
    tq.close()
    assert all(alive(p) for p in served["pids"].values())
    attach(served["address"])
    assert tq.kv_list("serve-p") == {"serve-p": {"a": {"by": "test"}}}
    tq.kv_clear(["a"], "serve-p")


def test_attach_via_env_var(served, attach, monkeypatch):
    monkeypatch.setenv("TQTX_ADDRESS", served["address"])
    tq.close()
    cfg = tq.init()
    assert cfg["mode"] == "attached" and cfg["address"] == served["address"]
    tq.close()


_ATTACHED_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from tensordict import TensorDict
    import tqtx as tq
    cfg = tq.init()
    keys = ["c0", "c1", "c2"]
    tq.kv_batch_put(keys, "shared-p", TensorDict(
        {"x": torch.arange(6, dtype=torch.float16).reshape(3, 2)}, batch_size=[3]),
        tags=[{"from": "child"}] * 3)
    tq.kv_put("c3", "shared-p", {"txt": "hi", "x": torch.ones(2, dtype=torch.float16)})
    print(json.dumps({"mode": cfg["mode"]}), flush=True)
    if sys.argv[1] == "close":
        tq.close()
""")


def test_second_process_puts_first_reads(served, attach):
    import torch
    res = subprocess.run([sys.executable, "-c", _ATTACHED_CHILD, "exit"], capture_output=True,
                         text=True, timeout=120, env=_env(TQTX_ADDRESS=served["address"]))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {"mode": "attached"}
    # the child's exit did not shut the deployment down
    assert all(alive(p) for p in served["pids"].values())
    attach(served["address"])
    td = tq.kv_batch_get(["c2", "c0", "c1", "c3"], "shared-p", select_fields=["x"])
    assert td["x"].dtype == torch.float16
    assert [t.tolist() for t in td["x"].unbind()] == [[4, 5], [0, 1], [2, 3], [1, 1]]
    assert tq.kv_list("shared-p")["shared-p"]["c0"] == {"from": "child"}
    assert tq.kv_batch_get(["c3"], "shared-p").get("txt").tolist() == ["hi"]
    tq.kv_clear(["c0", "c1", "c2", "c3"], "shared-p")


def test_timeout_names_the_unit(served, attach):
    import torch
    from tensordict import TensorDict
    attach(served["address"], timeout=1.0)
    keys = [f"t{i}" for i in range(4)]
    tq.kv_batch_put(keys, "timeout-p", TensorDict({"x": torch.arange(4)}, batch_size=[4]))
    pid = served["pids"]["unit 0"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError) as ei:
            tq.kv_batch_get(keys, "timeout-p")
        elapsed = time.monotonic() - t0
        assert elapsed < 5
        assert "unit" in str(ei.value) and "GET_ROWS" in str(ei.value)
        assert isinstance(ei.value, TimeoutError)
    finally:
        os.kill(pid, signal.SIGCONT)
    # after the unit resumes, the next request works (the late reply is not mistaken)
    assert tq.kv_batch_get(keys, "timeout-p")["x"].tolist() == [0, 1, 2, 3]
    ctl = served["pids"]["controller"]
    os.kill(ctl, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="controller"):
            tq.kv_list()
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(ctl, signal.SIGCONT)
    tq.kv_clear(keys, "timeout-p")
    assert tq.kv_list("timeout-p") == {}


def test_attach_to_nothing_times_out_naming_controller(attach):
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="controller"):
        attach(f"tcp://127.0.0.1:{port}", timeout=1.0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(tq.TqtxError, match="not initialized"):
        tq.get_client()


def test_serve_sigterm_stops_everything(tmp_path):
    proc, info = start_serve(tmp_path / "s", units=2)
    assert set(info) >= {"address", "num_units", "state_dir", "pids"}
    assert info["num_units"] == 2 and info["address"].startswith("tcp://127.0.0.1:")
    pids = list(info["pids"].values())
    assert all(alive(p) for p in pids)
    t0 = time.monotonic()
    rc = stop_serve(proc)
    assert rc == 0 and time.monotonic() - t0 < 10
    assert wait_gone(pids, 5) == []


def test_serve_sigterm_right_after_announcement(tmp_path):
    import fcntl
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(w, False)
    try:  # fill the stderr pipe so the banner write after the JSON line blocks
        while True:
            os.write(w, b"x" * 512)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tqtx", "serve", "--units", "1", "--port", "0",
         "--state-dir", str(tmp_path / "s")],
        stdout=subprocess.PIPE, stderr=w, text=True, env=_env())
    os.close(w)
    def _drain():
        while os.read(r, 65536):
            pass
        os.close(r)

    drain = threading.Thread(target=_drain, daemon=True)
    try:
        info = json.loads(proc.stdout.readline())
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        drain.start()  # let the banner through: a handled SIGTERM now stops serve cleanly
        rc = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        wait_gone(info["pids"].values(), 5)
    assert rc == 0


# ---------------------------------------------------------------- concurrency
def test_concurrent_conflicting_dtype_puts_write_nothing_for_the_loser(tq_start):
    import torch
    # slow every PUT_ROWS down so both ALLOCs happen before either COMMIT_PUT
    tq_start(num_units=1, env={"TQTX_FAULTS": "unit.request.PUT_ROWS:delay:0.5"})
    errors = {}

    def put(key, dtype):
        try:
            tq.kv_put(key, "race", {"x": torch.zeros(2, dtype=dtype)})
        except Exception as exc:  # noqa: BLE001
            errors[key] = exc

    threads = [threading.Thread(target=put, args=("a", torch.float32)),
               threading.Thread(target=put, args=("b", torch.int64))]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert len(errors) == 1 and isinstance(next(iter(errors.values())), ValueError)
    loser = next(iter(errors))
    # the rejected put must not have created its key
    assert loser not in tq.kv_list("race").get("race", {})
