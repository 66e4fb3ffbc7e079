"""Create or attach: every process of a job calls a bare ``tq.init()``; exactly one creates.

Real processes (``tq_procs.JobProcess``): they race on ``<state_dir>/init.lock`` and the
owner record ``<state_dir>/deployment.json``.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import tqtx as tq
from tqtx import PeerDiedError, StateDirInUseError, TqtxError, api
from tqtx.deploy import owner
from tq_procs import alive, job_context, job_env, job_processes, race_member, wait_gone


@pytest.fixture
def procs():
    """Start job processes with ``start(n, env)``; all are killed after the test."""
    with job_processes() as start:
        yield start


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _silent_address() -> str:
    """A loopback address where nothing listens (a port that was just free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def _stale_record(state_dir, **over) -> dict:
    rec = {"version": owner.RECORD_VERSION, "state_dir": str(state_dir),
           "address": _silent_address(), "incarnation": 7, "num_units": 2,
           "pids": {"controller": _dead_pid()}, "owner_pid": _dead_pid(),
           "owner_started": None, "hostname": socket.gethostname(), "curve": False,
           "server_key": None, "keys_dir": None, "created": time.time()}
    rec.update(over)
    os.makedirs(state_dir, exist_ok=True)
    owner.write_record(str(state_dir), rec)
    return rec


# ---------------------------------------------------------------- the race
def _next(results, kind: str, timeout: float = 120.0) -> tuple:
    msg = results.get(timeout=timeout)
    assert msg[0] == kind, f"process {msg[2]}: {msg[5] or msg}"
    return msg


# Four racers already have both init styles, a killed attacher and the creator's close;
# eight (each importing torch at once) is the heavier variant, run in the full suite.
# Eight processes importing torch at once beside the suite's other workers on 2 cores can
# take two minutes: that case has four.
@pytest.mark.slow
@pytest.mark.parametrize("n", [4, pytest.param(8, marks=[pytest.mark.slow,
                                                         pytest.mark.timeout(240)])])
def test_processes_calling_init_at_once_create_exactly_one(tmp_path, n):
    state = str(tmp_path / "state")
    ctx = job_context()
    sync = {"go": ctx.Event(), "put": ctx.Barrier(n), "exit": str(tmp_path / "exit"),
            "close": str(tmp_path / "close")}
    # one queue per process: a process killed while its queue's feeder thread still holds
    # the queue's lock (just after its last message) would block every other writer of a
    # shared queue for good
    results = [ctx.Queue() for _ in range(n)]
    # half call a bare init() ($TQTX_STATE_DIR), half name the state dir
    job = [ctx.Process(target=race_member,
                       args=(i, n, None if i % 2 else {"state_dir": state},
                             job_env({"TQTX_STATE_DIR": state}), sync, results[i]))
           for i in range(n)]
    try:
        for p in job:
            p.start()
        sync["go"].set()  # all at once
        reads = [_next(results[i], "read") for i in range(n)]
        cfgs = [m[3] for m in reads]
        modes = [c["mode"] for c in cfgs]
        assert modes.count("embedded") == 1 and modes.count("attached") == n - 1, modes
        made = cfgs[modes.index("embedded")]
        creator_pid = reads[modes.index("embedded")][2]
        assert made["owner_pid"] == creator_pid
        assert {c["address"] for c in cfgs} == {made["address"]}
        assert {c["incarnation"] for c in cfgs} == {made["incarnation"]}
        assert {c["owner_pid"] for c in cfgs} == {creator_pid}
        assert {c["state_dir"] for c in cfgs} == {state}
        record = owner.read_record(state)
        assert record["owner_pid"] == creator_pid and record["address"] == made["address"]
        # every process read every other process's key
        expected = [[i, i * i, 7] for i in range(n)]
        assert all(m[4] == expected for m in reads)

        # attached processes exit (one of them killed): the deployment keeps running
        attached = [p for p in job if p.pid != creator_pid]
        attached[0].kill()
        open(sync["exit"], "w").close()
        for p in attached:
            p.join(30)
            assert not p.is_alive()
        deployment = list(made["pids"].values())
        assert all(alive(pid) for pid in deployment)
        assert owner.read_record(state)["owner_pid"] == creator_pid

        # the creator still reads everything, then its close stops the deployment
        open(sync["close"], "w").close()
        creator_results = results[reads[modes.index("embedded")][1]]
        assert _next(creator_results, "reread")[4] == expected
        _next(creator_results, "closed")
        assert wait_gone(deployment) == []
        assert owner.read_record(state) is None
    finally:
        for p in job:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.mark.slow
def test_attached_process_is_told_the_creator_exited(tmp_path, procs, monkeypatch):
    tq.close()
    state = str(tmp_path / "state")
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    (creator,) = procs(1)
    made = creator.call("init", config={"state_dir": state, "num_units": 1})
    assert made["mode"] == "embedded"
    try:
        cfg = tq.init({"state_dir": state})
        assert cfg["mode"] == "attached" and cfg["address"] == made["address"]
        assert cfg["num_units"] == 1 and cfg["owner_pid"] == creator.pid
        tq.kv_put("a", "p", {"x": 1})
        creator.kill()
        assert wait_gone(made["pids"].values()) == []
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError, match="process that created this deployment") as ei:
            tq.kv_list()
        assert str(creator.pid) in str(ei.value)
        assert time.monotonic() - t0 < 30, "the creator's exit was noticed only at the timeout"
        tq.close()
        # the killed creator's record is stale: the next init creates a new deployment; its
        # controller replays the journaled metadata, but no unit kept a row (the whole job
        # died), so the buffer starts empty, as TransferQueue's does
        cfg = tq.init({"state_dir": state})
        assert cfg["mode"] == "embedded" and cfg["owner_pid"] == os.getpid()
        assert tq.kv_list() == {} and tq.list_lost_keys() == {}
        with pytest.raises(ValueError, match="not found"):
            tq.kv_batch_get(["a"], "p")
    finally:
        tq.close()


# ---------------------------------------------------------------- stale records
@pytest.mark.parametrize("what", ["dead-owner", pytest.param("silent-controller",
                                                              marks=pytest.mark.slow), "garbage"])
def test_stale_owner_record_never_blocks_a_start(tmp_path, monkeypatch, what):
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    state = tmp_path / "state"
    if what == "dead-owner":           # creator gone, nothing at the address
        _stale_record(state)
    elif what == "silent-controller":  # a live owner pid (ours), nothing at the address
        _stale_record(state, owner_pid=os.getpid(),
                      owner_started=owner.process_started(os.getpid()))
    else:
        os.makedirs(state)
        (state / "deployment.json").write_text("{not json")
    try:
        cfg = tq.init({"state_dir": str(state), "num_units": 1})
        assert cfg["mode"] == "embedded"
        rec = owner.read_record(str(state))
        assert rec["owner_pid"] == os.getpid() and rec["address"] == cfg["address"]
        tq.kv_put("k", "p", {"x": 1})
        assert list(tq.kv_list("p")["p"]) == ["k"]
    finally:
        tq.close()
    assert owner.read_record(str(state)) is None


def test_record_made_on_another_host_that_does_not_answer_is_an_error(tmp_path, monkeypatch):
    """A shared state dir whose deployment runs on another host this one cannot reach:
    refused, naming the host and address, rather than a second, invisible deployment."""
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    state = tmp_path / "state"
    rec = _stale_record(state, hostname="another-host", owner_pid=4242)
    with pytest.raises(TqtxError, match=r"made on host 'another-host' \(pid 4242\) and its "
                                        r"controller at " + re.escape(rec["address"])):
        tq.init({"state_dir": str(state), "num_units": 1})
    assert owner.read_record(str(state)) == rec  # left as it was
    assert api._client is None


def test_record_of_a_reused_pid_is_stale(tmp_path, monkeypatch):
    """The owner pid is alive but is another process (its start time differs)."""
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    state = tmp_path / "state"
    _stale_record(state, owner_pid=os.getpid(), owner_started="1")
    assert owner.live_record(str(state), {}) is None
    try:
        assert tq.init({"state_dir": str(state), "num_units": 1})["mode"] == "embedded"
    finally:
        tq.close()


def test_controller_without_record_still_refuses_the_state_dir(tmp_path, monkeypatch):
    """A controller that wrote no owner record (not started by tq.init / tqtx serve): the
    state dir is in use, and init says so instead of starting a second controller."""
    from tqtx.testing import InProcessDeployment
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    state = tmp_path / "state"
    with InProcessDeployment(1, state):
        with pytest.raises(StateDirInUseError, match="state dir"):
            tq.init({"state_dir": str(state)})
    assert tq.get_client.__module__ == "tqtx.api"
    with pytest.raises(tq.TqtxError, match="not initialized"):
        tq.get_client()


def test_close_of_the_creator_leaves_no_record_for_a_later_init(tmp_path, monkeypatch):
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    state = str(tmp_path / "state")
    first = tq.init({"state_dir": state, "num_units": 1})
    tq.close()
    assert wait_gone(first["pids"].values()) == []
    try:
        again = tq.init({"state_dir": state, "num_units": 1})
        assert again["mode"] == "embedded" and again["incarnation"] != first["incarnation"]
    finally:
        tq.close()


# ---------------------------------------------------------------- CURVE
@pytest.mark.slow
def test_bare_init_attaches_to_a_curve_deployment(tmp_path, procs, monkeypatch):
    """The creator forces CURVE; an attacher without TQTX_CURVE learns it from the record
    and authenticates with the state dir's client key."""
    from tqtx.wire import security
    tq.close()
    monkeypatch.delenv("TQTX_ADDRESS", raising=False)
    for var in ("TQTX_INSECURE", "TQTX_KEYS_DIR", "TQTX_SERVER_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TQTX_CURVE", "1")
    state = str(tmp_path / "state")
    keys = security.init_keys(state)
    try:
        made = tq.init({"state_dir": state, "num_units": 1})
        rec = owner.read_record(state)
        assert rec["curve"] is True and rec["server_key"] == keys["server_key"]
        tq.kv_put("secret", "p", {"v": __import__("torch").tensor([4, 2])})
        (worker,) = procs(1, {"TQTX_CURVE": None, "TQTX_STATE_DIR": state})
        cfg = worker.call("init")
        assert cfg["mode"] == "attached" and cfg["address"] == made["address"]
        assert worker.call("get_values", keys=["secret"], pid="p") == [[4, 2]]
    finally:
        tq.close()


# --------------------------------------------------------------------------- jobs
_ATTACH = ("import sys, tqtx as tq\n"
           "try:\n"
           "    print('MODE', tq.init({'state_dir': sys.argv[1]})['mode'])\n"
           "except tq.StateDirInUseError as e:\n"
           "    print('REFUSED', e)\n")


def _attach_as(state_dir, job: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in owner.JOB_ENV}
    if job is not None:
        env["TQTX_JOB_ID"] = job
    out = subprocess.run([sys.executable, "-c", _ATTACH, str(state_dir)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_another_job_is_refused_not_attached(tmp_path, monkeypatch):
    """Two jobs sharing a state dir must not share a buffer: a known, different job id is
    refused with StateDirInUseError naming both jobs; the same job (or none) attaches."""
    state = tmp_path / "state"
    monkeypatch.setenv("TQTX_JOB_ID", "job-a")
    tq.close()
    try:
        assert tq.init({"state_dir": str(state)})["mode"] == "embedded"
        assert owner.read_record(str(state))["job"] == "TQTX_JOB_ID=job-a"
        refused = _attach_as(state, "job-b")
        assert refused.startswith("REFUSED") and "TQTX_JOB_ID=job-a" in refused \
            and "TQTX_JOB_ID=job-b" in refused, refused
        assert _attach_as(state, "job-a") == "MODE attached"
        assert _attach_as(state, None) == "MODE attached"
    finally:
        tq.close()


_CREATOR = ("import os, subprocess, sys, tqtx as tq\n"
            "tq.init({'state_dir': sys.argv[1]})\n"
            "child = subprocess.run([sys.executable, '-c', 'import tqtx as tq; "
            "print(tq.init()[\"mode\"], tq.init()[\"state_dir\"])'], capture_output=True, "
            "text=True, timeout=120)\n"
            "print('CHILD', child.stdout.strip(), child.stderr.strip()[-300:])\n"
            "tq.close()\n")


def test_creator_exports_its_state_dir_to_the_processes_it_starts(tmp_path):
    """A trainer that names its state dir in the config starts workers later; their bare
    init() must join its deployment, not start one in the default state dir."""
    state = str(tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if k != "TQTX_STATE_DIR"}
    env["HOME"] = str(tmp_path / "home")   # a default state dir that is surely not used
    env.pop("XDG_STATE_HOME", None)
    out = subprocess.run([sys.executable, "-c", _CREATOR, state], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert f"CHILD attached {state}" in out.stdout, out.stdout
    assert not (tmp_path / "home").exists()


_WARMED = ("import sys, json, threading, tqtx as tq\n"
           "conf = {'state_dir': sys.argv[1]}\n"
           "if sys.argv[2] != 'auto':\n"
           "    conf['warm_dump'] = sys.argv[2] == 'on'\n"
           "mode = tq.init(conf)['mode']\n"
           "for t in threading.enumerate():  # init starts the warm-up thread, if at all\n"
           "    if t.name == 'tqtx-warm-dump':\n"
           "        t.join(120)\n"
           "print(json.dumps([mode, 'tqtx.journal.dump' in sys.modules]))\n"
           "tq.close()\n")


@pytest.mark.parametrize("warm,expect", [("auto", False), ("on", True)])
def test_an_attaching_process_warms_the_dump_path_only_when_asked(tmp_path, warm, expect):
    """The creator warms the dump path for its first dump; an attaching worker does not
    pay ~0.4 s of CPU and ~24 MiB for a dump it will rarely make, unless its config asks."""
    state = str(tmp_path / "state")
    tq.close()
    try:
        assert tq.init({"state_dir": state})["mode"] == "embedded"
        out = subprocess.run([sys.executable, "-c", _WARMED, state, warm],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1]) == ["attached", expect]
    finally:
        tq.close()
