"""The durability setting of a deployment: checked at init, mapped once, in every process's
environment, in STATS and the owner record; the buffer's durable cut; memory writes nothing;
close's SHUTDOWN of the units (tqtx.deploy.durable, tqtx.deploy.closing)."""
from __future__ import annotations

import json
import math
import os
import sqlite3
import time
import warnings

import pytest
import torch

import tqtx as tq
from tqtx.layout.paths import process_log
from tqtx import api
from tqtx import durability as dur
from tqtx.deploy import durable
from tqtx.deploy.initconfig import resolve

ENV_NAMES = (dur.ENV_DURABILITY, dur.ENV_FLUSH_INTERVAL, dur.ENV_UNIT_DATA_DIR)


@pytest.fixture(autouse=True)
def _no_durability_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def _proc_env(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(i.decode().split("=", 1) for i in items if b"=" in i)


def _controller_stats() -> dict:
    return api._client.controller.call("STATS")


def _journal_count(state_dir: str, sql: str) -> int:
    con = sqlite3.connect(f"file:{os.path.join(state_dir, 'journal.sqlite')}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def _put(keys, pid="p"):
    tq.kv_batch_put(keys, pid, {"x": torch.ones(len(keys), 3)})


# --------------------------------------------------------------------------- checking
@pytest.mark.parametrize("config, exc, words", [
    ({"durability": "fsync"}, ValueError, ["'durability'", "'memory', 'controller', 'buffer', "
                                                          "'sync'"]),
    ({"durability": 2}, TypeError, ["'durability'"]),
    ({"flush_interval_s": 0}, ValueError, ["'flush_interval_s'", "above 0"]),
    ({"flush_interval_s": -1.5}, ValueError, ["'flush_interval_s'"]),
    ({"flush_interval_s": math.inf}, ValueError, ["'flush_interval_s'"]),
    ({"flush_interval_s": "1"}, TypeError, ["'flush_interval_s'"]),
    ({"unit_data_dir": ""}, ValueError, ["'unit_data_dir'"]),
    ({"unit_data_dir": 5}, TypeError, ["'unit_data_dir'"]),
])
def test_bad_values_are_refused_naming_the_key_before_anything_starts(config, exc, words,
                                                                      tmp_path):
    with pytest.raises(exc) as ei:
        resolve(config)
    for word in words:
        assert word in str(ei.value), str(ei.value)
    with pytest.raises(exc):
        tq.init({**config, "state_dir": str(tmp_path / "state")})
    assert api._client is None
    assert not (tmp_path / "state" / "journal.sqlite").exists()


def test_the_refusal_names_only_the_current_values():
    with pytest.raises(ValueError) as ei:
        resolve({"durability": "fsync"})
    assert "full" not in str(ei.value) and "off" not in str(ei.value)


@pytest.mark.parametrize("name, value", [(dur.ENV_DURABILITY, "fast"),
                                         (dur.ENV_FLUSH_INTERVAL, "0"),
                                         (dur.ENV_FLUSH_INTERVAL, "soon")])
def test_bad_environment_values_are_refused_naming_the_variable(name, value, monkeypatch,
                                                                tmp_path):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"\\${name}"):
        tq.init({"state_dir": str(tmp_path / "state")})
    assert api._client is None
    assert not (tmp_path / "state" / "journal.sqlite").exists()


def test_sources_in_order_config_then_its_env_then_the_environment(tmp_path):
    state = str(tmp_path)
    environ = {dur.ENV_DURABILITY: "sync", dur.ENV_FLUSH_INTERVAL: "3"}
    assert durable.resolve({}, {}) == durable.DurabilitySetting("controller", 1.0, None)
    assert durable.resolve({}, environ) == durable.DurabilitySetting("sync", 3.0, None)
    assert durable.resolve({"env": {dur.ENV_DURABILITY: "memory"}}, environ).durability == \
        "memory"
    got = durable.resolve({"durability": "buffer", "flush_interval_s": 0.5,
                           "unit_data_dir": "rows"}, environ)
    assert got == durable.DurabilitySetting("buffer", 0.5, "rows")
    assert got.env(state) == {dur.ENV_DURABILITY: "buffer", dur.ENV_FLUSH_INTERVAL: "0.5",
                              dur.ENV_UNIT_DATA_DIR: os.path.join(state, "rows")}


def test_unit_data_dir_is_relative_to_the_state_dir_and_tilde_is_the_nodes():
    state = "/srv/state"
    assert durable.unit_data_base(None, state) == "/srv/state/units"
    assert durable.unit_data_base("rows", state) == "/srv/state/rows"
    assert durable.unit_data_base("/data/tq", state) == "/data/tq"
    assert durable.unit_data_base("~/tq", state) == os.path.expanduser("~/tq")
    # Ray: the unit's node expands "~" (tqtx.placement.ray_host.ServerHost.start)
    assert durable.unit_data_base("~/tq", state, expand_user=False) == "~/tq"
    assert durable.DurabilitySetting(unit_data_dir="~/tq").env(
        state, expand_user=False)[dur.ENV_UNIT_DATA_DIR] == "~/tq"


# --------------------------------------------------------------------------- deprecated values
def test_earlier_values_still_work_with_one_deprecation_warning(tq_start, tmp_path):
    with pytest.warns(DeprecationWarning) as caught:
        cfg = tq_start(1, durability="normal")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)
                    and "durability" in str(w.message)]
    assert len(deprecations) == 1
    assert "'normal' is deprecated; use 'controller'" in str(deprecations[0].message)
    # the warning names the caller's line (here conftest's tq_start), not tqtx's own
    package = os.path.dirname(os.path.abspath(tq.__file__)) + os.sep
    assert not os.path.abspath(deprecations[0].filename).startswith(package)
    assert cfg["durability"] == "controller"
    assert _controller_stats()["durability"] == "controller"
    for pid in cfg["pids"].values():  # every process got the new value: none warns again
        assert _proc_env(pid)[dur.ENV_DURABILITY] == "controller"


@pytest.mark.parametrize("old, new", sorted(dur.DEPRECATED.items()))
def test_every_earlier_value_maps_to_its_replacement(old, new):
    with pytest.warns(DeprecationWarning, match=f"use '{new}'"):
        assert durable.normalise_config({"durability": old}) == {"durability": new}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert durable.normalise_config({"durability": new}) == {"durability": new}


def test_an_earlier_value_in_the_environment_is_mapped_with_a_warning(monkeypatch, tq_start):
    monkeypatch.setenv(dur.ENV_DURABILITY, "off")
    with pytest.warns(DeprecationWarning, match="\\$TQTX_DURABILITY 'off'"):
        assert durable.resolve({}).durability == "memory"
    with pytest.warns(DeprecationWarning) as caught:
        cfg = tq_start(1)
    assert len([w for w in caught if "TQTX_DURABILITY" in str(w.message)]) == 1
    assert _controller_stats()["durability"] == "memory"
    assert _proc_env(cfg["pids"]["unit 0"])[dur.ENV_DURABILITY] == "memory"


# --------------------------------------------------------------------------- every process
def test_every_process_gets_the_setting_and_the_record_names_it(tq_start, tmp_path):
    state = str(tmp_path / "state")
    cfg = tq_start(2, state_dir=state, durability="buffer", flush_interval_s=0.25,
                   unit_data_dir="rows")
    assert (cfg["durability"], cfg["flush_interval_s"], cfg["unit_data_dir"]) == \
        ("buffer", 0.25, os.path.join(state, "rows"))
    assert set(cfg["pids"]) == {"controller", "unit 0", "unit 1"}
    for pid in cfg["pids"].values():
        env = _proc_env(pid)
        assert (env[dur.ENV_DURABILITY], env[dur.ENV_FLUSH_INTERVAL],
                env[dur.ENV_UNIT_DATA_DIR]) == ("buffer", "0.25", os.path.join(state, "rows"))
    st = _controller_stats()
    assert (st["durability"], st["flush_interval_s"]) == ("buffer", 0.25)
    with open(os.path.join(state, "deployment.json")) as f:
        rec = json.load(f)
    assert (rec["durability"], rec["flush_interval_s"], rec["unit_data_dir"]) == \
        ("buffer", 0.25, os.path.join(state, "rows"))
    from click.testing import CliRunner

    from tqtx.cli.journal import journal
    res = CliRunner().invoke(journal, ["show", "--state-dir", state, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["deployment"]["durability"] == "buffer"
    res = CliRunner().invoke(journal, ["show", "--state-dir", state, "--layout", "records"])
    assert "durability:     buffer (flush every 0.25 s)" in res.output


def test_the_default_is_controller_under_the_state_dir(tq_start, tmp_path):
    state = str(tmp_path / "state")
    cfg = tq_start(1, state_dir=state)
    assert _controller_stats()["durability"] == "controller"
    env = _proc_env(cfg["pids"]["unit 0"])
    assert env[dur.ENV_DURABILITY] == "controller"
    assert env[dur.ENV_UNIT_DATA_DIR] == os.path.join(state, "units")


def test_the_environment_of_init_reaches_the_processes(tq_start, monkeypatch):
    monkeypatch.setenv(dur.ENV_DURABILITY, "sync")
    monkeypatch.setenv(dur.ENV_FLUSH_INTERVAL, "2")
    cfg = tq_start(1)
    assert (_controller_stats()["durability"], _controller_stats()["flush_interval_s"]) == \
        ("sync", 2.0)
    assert _proc_env(cfg["pids"]["unit 0"])[dur.ENV_DURABILITY] == "sync"


# --------------------------------------------------------------------------- the journal
def test_buffer_makes_one_durable_cut_per_interval_with_commits(tq_start, tmp_path):
    """Counted, not timed: a put is followed by a cut (STATS counts it); with nothing
    committed, no further cut is made."""
    state = str(tmp_path / "state")
    tq_start(1, state_dir=state, durability="buffer", flush_interval_s=0.05)
    # the start commits one marker (the unit count of the row logs): its cut comes first
    deadline = time.monotonic() + 30
    while _controller_stats()["durable_cuts"] < 1:
        assert time.monotonic() < deadline, "no durable cut after the start's commit"
        time.sleep(0.05)
    started = _controller_stats()["durable_cuts"]
    assert started == 1
    _put(["a", "b"])
    while _controller_stats()["durable_cuts"] == started:
        assert time.monotonic() < deadline, "no durable cut after a put"
        time.sleep(0.05)
    cuts = _controller_stats()["durable_cuts"]
    # idle: many intervals pass (the loop wakes every interval), no commit, no cut
    time.sleep(0.5)
    assert _controller_stats()["durable_cuts"] == cuts
    _put(["c"])
    deadline = time.monotonic() + 30
    while _controller_stats()["durable_cuts"] == cuts:
        assert time.monotonic() < deadline, "no durable cut after the second put"
        time.sleep(0.05)


def test_a_clean_stop_makes_the_last_cut(tq_start, tmp_path):
    """With an interval that never comes, the commits are made durable when the controller
    stops (SIGTERM at close); keep_buffer leaves them in the journal to see."""
    state = str(tmp_path / "state")
    tq_start(1, state_dir=state, durability="buffer", flush_interval_s=3600)
    _put(["a", "b"])
    assert _controller_stats()["durable_cuts"] == 0
    tq.close(keep_buffer=True)
    with open(process_log(state, "controller")) as f:
        assert "last commits made durable (cut 1)" in f.read()
    assert _journal_count(state, "SELECT count(*) FROM meta_keys") == 2


def test_no_cuts_with_controller(tq_start):
    tq_start(1, durability="controller")
    _put(["a"])
    time.sleep(0.3)
    assert _controller_stats()["durable_cuts"] == 0


def test_sync_answers_a_put_after_a_durable_cut_covers_it(tq_start):
    tq_start(1, durability="sync")
    before = _controller_stats()["durable_cuts"]
    _put(["a"])
    assert _controller_stats()["durable_cuts"] >= before + 1


def test_memory_writes_no_metadata(tq_start, tmp_path):
    state = str(tmp_path / "state")
    tq_start(1, state_dir=state, durability="memory")
    _put([f"k{i}" for i in range(20)])
    assert tq.kv_list("p")["p"].keys() == {f"k{i}" for i in range(20)}
    for table in ("meta_keys", "meta_schemas", "meta_counters", "meta_requests"):
        assert _journal_count(state, f"SELECT count(*) FROM {table}") == 0, table


# --------------------------------------------------------------------------- close
@pytest.mark.parametrize("keep", [False, True])
def test_close_sends_shutdown_to_the_units_after_the_controller(tq_start, tmp_path,
                                                                monkeypatch, keep):
    """close() ends the buffer (END_BUFFER) then SHUTDOWNs each unit with keep_buffer;
    close(keep_buffer=True) keeps the journaled metadata."""
    from tqtx.wire import peer
    state = str(tmp_path / "state")
    tq_start(2, state_dir=state, durability="buffer")
    _put(["a", "b", "c"])
    seen = []
    real = peer.call_many

    def spy(calls, **kw):
        seen.extend((op, body) for _p, op, body, *_ in calls)
        return real(calls, **kw)
    monkeypatch.setattr(peer, "call_many", spy)
    tq.close(keep_buffer=keep)
    assert seen == [("SHUTDOWN", {"keep_buffer": keep})] * 2
    kept = _journal_count(state, "SELECT count(*) FROM meta_keys")
    assert kept == (3 if keep else 0)
    assert not os.path.exists(os.path.join(state, "deployment.json"))


def test_close_keep_buffer_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_buffer"):
        tq.close(keep_buffer="yes")


# --------------------------------------------------------------------------- in-process
def test_in_process_deployments_take_the_setting(tmp_path, monkeypatch):
    from tqtx.testing import InProcessDeployment
    with InProcessDeployment(1, tmp_path / "state", durability="buffer",
                             flush_interval_s=0.5) as dep:
        st = dep.client.controller.call("STATS")
        assert (st["durability"], st["flush_interval_s"]) == ("buffer", 0.5)
        assert dep.durability.env(dep.state_dir)[dur.ENV_UNIT_DATA_DIR] == \
            os.path.join(dep.state_dir, "units")
    assert dur.ENV_DURABILITY not in os.environ  # set only while its units were made


# --------------------------------------------------------------------------- command lines
@pytest.mark.parametrize("given, want", [("buffer", "buffer"), ("normal", "controller")])
def test_the_controller_command_takes_the_setting(tmp_path, given, want):
    """``python -m tqtx.controller --durability`` (an earlier value mapped, with a logged
    warning) and ``--flush-interval-s``, over $TQTX_DURABILITY."""
    import subprocess
    import sys

    from tqtx.deploy.local import _read_announcement
    from tqtx.process.servers import controller_command, stop_child
    from tqtx.wire.peer import Peer
    args = controller_command(num_units=1, state_dir=str(tmp_path / "state"), host="127.0.0.1",
                              port=0)
    proc = subprocess.Popen([sys.executable, *args, "--durability", given,
                             "--flush-interval-s", "0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, dur.ENV_DURABILITY: "memory"})
    try:
        ready = _read_announcement(proc, "controller", 60)["ready"]
        peer = Peer(ready, "controller", timeout=10)
        try:
            st = peer.call("STATS")
        finally:
            peer.close()
        assert (st["durability"], st["flush_interval_s"]) == (want, 0.5)
    finally:
        stop_child(proc)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert (f"durability {given!r} is deprecated; use {want!r}" in err) == (given != want)


def test_a_refused_setting_is_the_controllers_start_error(tmp_path):
    import subprocess
    import sys

    from tqtx.deploy.local import _read_announcement
    from tqtx.process.servers import controller_command, stop_child
    args = controller_command(num_units=1, state_dir=str(tmp_path / "state"), host="127.0.0.1",
                              port=0)
    proc = subprocess.Popen([sys.executable, *args, "--durability", "fast"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        msg = _read_announcement(proc, "controller", 60)
    finally:
        stop_child(proc)
    assert msg["error"] == "ValueError" and "'fast'" in msg["message"]


def test_tqtx_serve_options_are_checked():
    import click

    from tqtx.cli.serve import _durability_env
    assert _durability_env("sync", 0.5, "rows") == {
        dur.ENV_DURABILITY: "sync", dur.ENV_FLUSH_INTERVAL: "0.5", dur.ENV_UNIT_DATA_DIR: "rows"}
    assert _durability_env(None, None, None) == {}
    with pytest.raises(click.BadParameter, match="--durability 'fast'"):
        _durability_env("fast", None, None)
    with pytest.raises(click.BadParameter, match="flush_interval_s"):
        _durability_env(None, 0, None)
