"""Observability with real processes: per-op counters, `tqtx stats`, Prometheus, logs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import torch

import tqtx as tq
from tq_procs import free_port_run

ROW_BYTES = 8 * 4  # one float32[8] field per row


def _ops(proc: dict, op: str) -> dict:
    return proc["ops"].get(op) or {"count": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0}


def _count(proc: dict, op: str) -> int:
    return _ops(proc, op)["count"]


def _total(proc: dict, name: str) -> float:
    return proc["totals"].get(name, 0)


def _known_sequence(tmp_path, n=6, dumped=4):
    """n single puts, one batch get, dump ``dumped`` keys, clear them, restore them."""
    keys = [f"k{i}" for i in range(n)]
    for i, k in enumerate(keys):
        tq.kv_put(k, "p", {"x": torch.full((8,), float(i))})
    tq.kv_batch_get(keys, "p")
    mid = tq.get_client().stats()
    dump = tmp_path / "dump"
    dumped_keys = keys[:dumped]
    rep = tq.dump_data_by_key(dump, dumped_keys, "p")
    tq.kv_clear(dumped_keys, "p")
    out = tq.load_data_by_key(dump)
    return keys, mid, rep, out


def test_counters_move_by_exact_amounts(tq_start, tmp_path):
    tq_start(2)
    n, dumped = 6, 4
    keys, mid, rep, out = _known_sequence(tmp_path, n, dumped)
    st = tq.get_client().stats()
    ctl, units = st["controller"], st["units"]
    assert ctl["role"] == "controller" and [u["unit_id"] for u in units] == [0, 1]
    assert all(p["pid"] > 0 and p["uptime"] > 0 for p in [ctl, *units])

    # controller: one COMMIT_PUT per put; one ALLOC, by the first put (it leases the
    # indexes of the other puts of new keys: tqtx/client/lease.py); the rest once per operation
    assert _count(ctl, "ALLOC") == 1 and _count(ctl, "COMMIT_PUT") == n
    assert _count(ctl, "LOOKUP") == 1
    for op in ("DESCRIBE_ROWS_BY_KEY", "RECORD_DUMP", "CLEAR", "BEGIN_RESTORE", "FINISH_RESTORE"):
        assert _count(ctl, op) == 1, op
    restored_units = out["units"]
    assert _count(ctl, "RESTORE_UNIT:claim") == len(restored_units)
    assert _count(ctl, "RESTORE_UNIT:staged") == len(restored_units)
    assert _count(ctl, "RESTORE_UNIT:failed") == 0
    assert sum(r["errors"] for r in ctl["ops"].values()) == 0
    for op in ("ALLOC", "BEGIN_RESTORE", "FINISH_RESTORE"):
        r = ctl["ops"][op]
        assert r["bytes_in"] > 0 and r["bytes_out"] > 0
        assert 0 <= r["p50_ms"] <= r["p99_ms"]
    assert ctl["rows"] == n and ctl["open_restores"] == []

    # units: every put went to exactly one owner; each unit's share is what it held then
    held_mid = {u["unit_id"]: u["rows"] for u in mid["units"]}
    assert sum(held_mid.values()) == n
    for u in units:
        uid = u["unit_id"]
        assert _count(u, "PUT_ROWS") == held_mid[uid]
        assert _ops(u, "PUT_ROWS")["bytes_in"] > held_mid[uid] * ROW_BYTES
        assert _count(u, "GET_ROWS") == (1 if held_mid[uid] else 0)
        wrote = _total(u, "dump_rows_total")
        assert _count(u, "DUMP_ROWS") == (1 if wrote else 0)
        assert _count(u, "DROP_ROWS") == (1 if wrote else 0)  # the cleared keys are the dumped
        assert _total(u, "dump_bytes_total") > wrote * ROW_BYTES or not wrote
        loads = 1 if uid in restored_units else 0
        assert _count(u, "LOAD_ROWS") == loads and _count(u, "APPLY_STAGED") == loads
        assert _total(u, "loads_total") == loads
        assert _total(u, "load_bytes_total") == _total(u, "load_rows_total") * ROW_BYTES
        assert sum(r["errors"] for r in u["ops"].values()) == 0
        assert u["staged_restores"] == []
    assert sum(_total(u, "dump_rows_total") for u in units) == dumped
    assert sum(_total(u, "dumps_total") for u in units) == sum(_count(u, "DUMP_ROWS") for u in units)
    assert sum(_total(u, "load_rows_total") for u in units) == dumped
    # rows and bytes held are running totals: back to every key after clear + restore
    assert sum(u["rows"] for u in units) == n
    assert sum(u["bytes"] for u in units) == n * ROW_BYTES
    assert [u["bytes"] for u in mid["units"]] == [r * ROW_BYTES for r in held_mid.values()]

    # client totals
    c = st["client"]
    assert c["puts"] == {"calls": n, "rows": n, "bytes": n * ROW_BYTES}
    assert c["gets"]["calls"] == 1 and c["gets"]["rows"] == n
    # get bytes are the reply bytes the units sent
    assert c["gets"]["bytes"] == sum(_ops(u, "GET_ROWS")["bytes_out"] for u in units)
    assert c["dumps"] == {"calls": 1, "rows": dumped, "bytes": rep["bytes"]}
    assert c["restores"] == {"calls": 1, "rows": dumped, "bytes": out["bytes"]}


def test_stats_cli_json_reports_every_process(tq_start, tmp_path):
    cfg = tq_start(2)
    _known_sequence(tmp_path)
    env = {**os.environ, "TQTX_ADDRESS": ""}
    res = subprocess.run([sys.executable, "-m", "tqtx", "stats", "--json", "--address",
                          cfg["address"]], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) == {"controller", "units", "client"}
    ctl = data["controller"]
    assert ctl["role"] == "controller" and ctl["pid"] == cfg["pids"]["controller"]
    assert ctl["ops"]["COMMIT_PUT"]["count"] == 6 and ctl["ops"]["ALLOC"]["count"] == 1
    assert ctl["ops"]["BEGIN_RESTORE"]["count"] == 1
    assert set(ctl["ops"]["ALLOC"]) >= {"count", "errors", "p50_ms", "p99_ms", "bytes_in",
                                        "bytes_out"}
    assert [u["unit_id"] for u in data["units"]] == [0, 1]
    for u in data["units"]:
        assert u["pid"] == cfg["pids"][f"unit {u['unit_id']}"]
        assert {"rows", "bytes", "uptime", "staged_restores", "ops", "totals"} <= set(u)
    assert sum(u["ops"]["PUT_ROWS"]["count"] for u in data["units"]) == 6
    assert sum(u["totals"]["load_rows_total"] for u in data["units"]) == 4
    assert data["client"]["role"] == "client"  # the stats command's own client
    # the table form works too
    res = subprocess.run([sys.executable, "-m", "tqtx", "stats", "--address", cfg["address"]],
                         capture_output=True, text=True, timeout=120,
                         env={**env, "COLUMNS": "160"})
    assert res.returncode == 0, res.stderr
    assert "controller requests" in res.stdout and "unit 1 requests" in res.stdout
    assert "RESTORE_UNIT:claim" in res.stdout


def test_prometheus_endpoint_serves_documented_names(tq_start, tmp_path):
    pytest.importorskip("prometheus_client",
                        reason="prometheus_client not installed (pip install tqtx[metrics])")
    base = free_port_run(3)
    cfg = tq_start(2, metrics={"enabled": True, "port": base})
    assert cfg["metrics_port"] == base
    _known_sequence(tmp_path)
    texts = {}
    for name, port in [("controller", base), ("unit 0", base + 1), ("unit 1", base + 2)]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            texts[name] = r.read().decode()
    ctl = texts["controller"]
    assert re.search(r'^tqtx_requests_total\{op="COMMIT_PUT",role="controller",unit=""\} 6\.0$',
                     ctl, re.M)
    assert 'tqtx_requests_total{op="RESTORE_UNIT:claim",role="controller",unit=""}' in ctl
    for name in ("tqtx_request_errors_total", "tqtx_request_seconds_bucket",
                 "tqtx_request_seconds_count", "tqtx_request_seconds_sum",
                 "tqtx_request_bytes_in_total", "tqtx_request_bytes_out_total", "tqtx_rows_held",
                 "tqtx_bytes_held", "tqtx_open_restores", "tqtx_uptime_seconds"):
        for text in texts.values():
            assert f"\n{name}" in text, name
    assert re.search(r'^tqtx_rows_held\{role="controller",unit=""\} 6\.0$', ctl, re.M)
    held = 0.0
    for uid in (0, 1):
        text = texts[f"unit {uid}"]
        assert f'tqtx_requests_total{{op="PUT_ROWS",role="unit",unit="{uid}"}}' in text
        held += float(re.search(rf'^tqtx_bytes_held\{{role="unit",unit="{uid}"\}} (\S+)$', text,
                                re.M).group(1))
    assert held == 6 * ROW_BYTES
    assert sum(float(m) for t in texts.values() for m in re.findall(
        r'^tqtx_load_rows_total\{[^}]*\} (\S+)$', t, re.M)) == 4


def test_restore_log_lines_carry_the_restore_id_in_every_process(tq_start, tmp_path):
    assert os.environ.get("TQTX_LOG_LEVEL", "WARNING").upper() == "WARNING"
    cfg = tq_start(2)
    _, _, rep, out = _known_sequence(tmp_path)
    rid, dump_id = out["restore_id"], rep["dump_id"]
    logs = os.path.join(cfg["state_dir"], "logs")
    tq.close()  # flush and stop every process
    with open(os.path.join(logs, "controller.log")) as f:
        ctl = [line for line in f if rid in line]
    assert any("begun" in line for line in ctl) and any("committed" in line for line in ctl)
    for uid in out["units"]:
        assert any(f"restore {rid}: unit {uid} claimed" in line for line in ctl)
        with open(os.path.join(logs, f"unit-{uid}.log")) as f:
            lines = [line for line in f if rid in line]
        assert lines, f"unit {uid} logged nothing about restore {rid}"
        assert all(f"unit {uid}" in line for line in lines)
        assert any("staged" in line for line in lines) and any("applied" in line for line in lines)
    # the dump is followed the same way
    with open(os.path.join(logs, "controller.log")) as f:
        assert any(f"dump {dump_id}: recorded" in line for line in f)
    wrote = 0
    for uid in (0, 1):
        with open(os.path.join(logs, f"unit-{uid}.log")) as f:
            wrote += sum(1 for line in f if f"dump {dump_id}: unit {uid} wrote" in line)
    assert wrote >= 1


def test_metrics_can_be_disabled(tq_start):
    tq_start(1, env={"TQTX_METRICS": "0"})
    tq.kv_put("a", "p", {"x": torch.ones(8)})
    st = tq.get_client().stats()
    assert st["controller"]["metrics_enabled"] is False and st["controller"]["ops"] == {}
    assert st["units"][0]["ops"] == {} and st["units"][0]["bytes"] == ROW_BYTES
    assert st["client"]["puts"]["calls"] == 1
