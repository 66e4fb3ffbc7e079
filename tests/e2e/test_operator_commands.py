"""Operator commands on a broken deployment (issue 33, item 4): ``tqtx stats``, ``tqtx
journal show`` and ``tqtx inspect`` print what they can reach, name what they cannot, exit
nonzero and print no traceback; ``--json`` says the same as data."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import api

ENV = {**os.environ, "TQTX_ADDRESS": "", "TQTX_CONNECT_TIMEOUT": "1", "COLUMNS": "200"}


def tqtx(*args, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "tqtx", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def _deployment(tq_start, tmp_path):
    cfg = tq_start(2)
    tq.kv_batch_put(["a", "b", "c"], "p", TensorDict({"x": torch.ones(3, 2)}, batch_size=[3]))
    tq.dump_data_by_key(tmp_path / "dump", ["a", "b"], "p")
    return cfg, api._deployment_handle()


@pytest.mark.slow
def test_stats_with_a_dead_unit_prints_the_rest_and_names_it(tq_start, tmp_path):
    cfg, dep = _deployment(tq_start, tmp_path)
    dead = dep.procs["unit 1"]
    dead.kill()
    dead.wait(10)
    res = tqtx("stats", "--json", "--address", cfg["address"])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    data = json.loads(res.stdout)
    assert data["controller"]["pid"] == cfg["pids"]["controller"]
    assert data["controller"]["keys"] == 3
    live, gone = data["units"]
    assert live["unit_id"] == 0 and live["pid"] == cfg["pids"]["unit 0"] and "ops" in live
    assert gone["unit_id"] == 1 and gone["address"] == cfg["units"][1]
    assert "is gone" in gone["error"]
    assert len(data["unreachable"]) == 1 and data["unreachable"][0].startswith("unit 1 at ")
    assert data["client"]["role"] == "client"

    res = tqtx("stats", "--address", cfg["address"])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "controller requests" in res.stdout and "unit 0 requests" in res.stdout
    assert "unit 1 requests" not in res.stdout
    assert f"unit 1 at {cfg['units'][1]}: unreachable" in res.stdout.replace("\n", " ")
    assert res.stderr.startswith("error: unit 1 at "), res.stderr


@pytest.mark.slow
def test_stats_with_a_dead_controller_names_it(tq_start, tmp_path):
    cfg, dep = _deployment(tq_start, tmp_path)
    dep.procs["controller"].kill()
    dep.procs["controller"].wait(10)
    res = tqtx("stats", "--json", "--address", cfg["address"])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    data = json.loads(res.stdout)
    assert data["controller"]["address"] == cfg["address"] and data["controller"]["error"]
    assert data["units"] == [] and data["unreachable"][0].startswith("controller at ")
    res = tqtx("stats", "--address", cfg["address"])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "controller at" in res.stderr and "unreachable" in res.stdout


def test_journal_show_and_inspect_need_no_live_process(tq_start, tmp_path):
    cfg, dep = _deployment(tq_start, tmp_path)
    for name in ("unit 1", "controller"):
        dep.procs[name].kill()
        dep.procs[name].wait(10)
    res = tqtx("journal", "show", "--json", "--state-dir", cfg["state_dir"])
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["buffer"] == [{"partition_id": "p", "keys": 3, "lost_rows": 0}]
    assert report["controller"]["running"] is False  # named: killed, not ended
    assert report["controller"]["pid"] == cfg["pids"]["controller"]
    assert report["controller"]["ended_at"] is None
    assert [d["keys"] for d in report["dumps"]] == [2]
    assert tqtx("journal", "show", tmp_path / "dump").returncode == 0
    res = tqtx("inspect", "--json", tmp_path / "dump")
    assert res.returncode == 0 and json.loads(res.stdout)["keys"] == 2


def test_inspect_of_a_damaged_dump_prints_its_manifest_and_names_what_is_missing(tq_start,
                                                                                 tmp_path):
    _deployment(tq_start, tmp_path)
    shard = tmp_path / "dump" / "shards" / "unit-1.bin"
    shard.unlink()
    res = tqtx("inspect", "--json", tmp_path / "dump")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] is False and str(shard) in out["error"] and "missing" in out["error"]
    assert out["manifest"]["keys"] == 2 and out["manifest"]["partition_id"] == "p"
    res = tqtx("inspect", tmp_path / "dump")
    assert res.returncode == 1 and "keys: 2" in res.stdout and str(shard) in res.stderr
