"""The metrics registry and the Server's central request accounting (in-process)."""
from __future__ import annotations

import threading
import time

import pytest

from tqtx.metrics import BUCKETS_MS, Metrics, OpRecord, frames_nbytes, render_stats
from tqtx.wire.codec import INLINE_LIMIT, encode
from tqtx.wire.peer import Peer
from tqtx.wire.rpc import Server
from tqtx.wire.values import RawTensor


def test_record_counts_errors_bytes_and_buckets():
    m = Metrics("unit", 3, enabled=True)
    m.record("PUT_ROWS", 0.0004, 100, 20)
    m.record("PUT_ROWS", 0.002, 50, 10, error=True)
    m.record("PUT_ROWS", 1000.0)  # beyond every bound: the open bucket
    rec = m.ops["PUT_ROWS"]
    assert (rec.count, rec.errors, rec.bytes_in, rec.bytes_out) == (3, 1, 150, 30)
    assert sum(rec.buckets) == 3 and rec.buckets[-1] == 1
    assert rec.buckets[BUCKETS_MS.index(0.5)] == 1 and rec.buckets[BUCKETS_MS.index(2.5)] == 1
    d = m.ops_snapshot()["PUT_ROWS"]
    assert set(d) >= {"count", "errors", "p50_ms", "p99_ms", "bytes_in", "bytes_out"}
    assert d["max_ms"] == pytest.approx(1_000_000.0)


def test_quantiles_are_estimated_within_their_bucket():
    rec = OpRecord()
    assert rec.quantile_ms(0.5) is None
    m = Metrics("controller", enabled=True)
    for _ in range(98):
        m.record("LOOKUP", 0.0007)      # (0.5, 1] ms
    m.record("LOOKUP", 0.2)             # (100, 250] ms
    m.record("LOOKUP", 0.2)
    d = m.ops_snapshot()["LOOKUP"]
    assert 0.5 < d["p50_ms"] <= 1.0
    assert 100.0 < d["p99_ms"] <= 200.0  # never above the largest observation


def test_add_is_thread_safe_and_gauges_never_raise():
    m = Metrics("unit", 0, enabled=True)

    def work():
        for _ in range(10_000):
            m.add("load_rows_total", 1)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.totals_snapshot() == {"load_rows_total": 40_000}
    m.gauge("rows_held", lambda: 7)
    m.gauge("bytes_held", lambda: 1 / 0)
    assert m.read_gauges() == {"rows_held": 7, "bytes_held": None}
    snap = m.snapshot()
    assert snap["role"] == "unit" and snap["unit_id"] == 0 and snap["pid"] > 0


def test_frames_nbytes_counts_every_kind_of_frame():
    n = 2 * INLINE_LIMIT  # a frame of its own
    big = RawTensor("float32", (n // 4,), bytearray(n))
    frames = encode({"x": big, "y": 1})
    assert len(frames) == 2
    assert frames_nbytes(frames) == len(frames[0]) + n
    assert frames_nbytes([b"ab", memoryview(b"abcd").cast("B")]) == 6


# ---------------------------------------------------------------- Server accounting
@pytest.fixture
def server():
    srv = Server("unit-3")
    pool_done = threading.Event()

    def echo(body, req):
        return {"n": len(body.get("data", b""))}

    def boom(body, req):
        raise RuntimeError("no")

    def later(body, req):
        d = srv.deferred(req, srv.current_ident)

        def work():
            time.sleep(0.05)
            d.reply({"late": True})
            pool_done.set()
        threading.Thread(target=work, daemon=True).start()
        return d

    srv.add("ECHO", echo)
    srv.add("BOOM", boom)
    srv.add("LATER", later, mutating=True)
    srv.add("ACT", echo, mutating=True)
    srv.op_labels["ACT"] = lambda body: f"ACT:{body.get('how')}"
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(5)


def test_server_counts_times_and_sizes_every_request(server):
    assert server.metrics.role == "unit" and server.metrics.unit_id == 3
    peer = Peer(server.address, "unit 3", timeout=10)
    try:
        for _ in range(3):
            peer.call("ECHO", {"data": b"x" * 100})
        with pytest.raises(RuntimeError, match="^no$"):  # the handler's error, re-raised
            peer.call("BOOM")
        with pytest.raises(ValueError):
            peer.call("NOPE")
        assert peer.call("LATER") == {"late": True}
        peer.call("ACT", {"how": "claim"})
        peer.call("ACT", {"how": "claim"}, rid="same")
        peer.call("ACT", {"how": "claim"}, rid="same")  # a retry answered from the reply cache
        peer.call("ACT", {"how": "staged"})
    finally:
        peer.close()
    ops = server.metrics.ops_snapshot()
    assert ops["ECHO"]["count"] == 3 and ops["ECHO"]["errors"] == 0
    request = encode({"op": "ECHO", "rid": "0" * 32, "body": {"data": b"x" * 100}})
    assert ops["ECHO"]["bytes_in"] == 3 * frames_nbytes(request)
    reply = encode({"rid": "0" * 32, "ok": True, "result": {"n": 100}})
    assert ops["ECHO"]["bytes_out"] == 3 * frames_nbytes(reply)
    assert ops["BOOM"] == {**ops["BOOM"], "count": 1, "errors": 1}
    assert ops["?"]["count"] == 1 and ops["?"]["errors"] == 1  # unknown ops share one record
    assert "NOPE" not in ops
    # a Deferred reply is timed from receive to the reply sent by the worker thread
    assert ops["LATER"]["count"] == 1 and ops["LATER"]["max_ms"] >= 45
    assert ops["ACT:claim"]["count"] == 3 and ops["ACT:staged"]["count"] == 1


def test_recording_can_be_disabled(monkeypatch):
    srv = Server("controller")
    srv.metrics.enabled = False
    srv.add("ECHO", lambda body, req: {})
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    thread.start()
    peer = Peer(srv.address, "controller", timeout=10)
    try:
        peer.call("ECHO")
    finally:
        peer.close()
        srv.stop()
        thread.join(5)
    assert srv.metrics.ops == {}


def test_prometheus_collector_serves_documented_names():
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed "
                               "(pip install tqtx[metrics])")
    from tqtx.metrics import _Collector
    m = Metrics("unit", 1, enabled=True)
    m.record("PUT_ROWS", 0.001, 10, 5)
    m.add("dump_rows_total", 3)
    m.gauge("rows_held", lambda: 4)
    m.gauge("bytes_held", lambda: 64)
    m.gauge("open_restores", lambda: 0)
    reg = prom.CollectorRegistry(auto_describe=False)
    reg.register(_Collector(m))
    text = prom.generate_latest(reg).decode()
    for line in ['tqtx_requests_total{op="PUT_ROWS",role="unit",unit="1"} 1.0',
                 'tqtx_request_errors_total{op="PUT_ROWS",role="unit",unit="1"} 0.0',
                 'tqtx_request_bytes_in_total{op="PUT_ROWS",role="unit",unit="1"} 10.0',
                 'tqtx_request_bytes_out_total{op="PUT_ROWS",role="unit",unit="1"} 5.0',
                 'tqtx_request_seconds_count{op="PUT_ROWS",role="unit",unit="1"} 1.0',
                 'tqtx_request_seconds_bucket{le="+Inf",op="PUT_ROWS",role="unit",unit="1"} 1.0',
                 'tqtx_rows_held{role="unit",unit="1"} 4.0',
                 'tqtx_bytes_held{role="unit",unit="1"} 64.0',
                 'tqtx_open_restores{role="unit",unit="1"} 0.0',
                 'tqtx_dump_rows_total{role="unit",unit="1"} 3.0']:
        assert line in text, line


def test_render_stats_prints_every_process():
    from rich.console import Console
    m = Metrics("unit", 0, enabled=True)
    m.record("GET_ROWS", 0.001)
    unit = {**m.snapshot(), "rows": 2, "bytes": 32, "staged_restores": []}
    ctl = {**Metrics("controller", enabled=True).snapshot(), "rows": 2, "bytes": 0,
           "open_restores": [{"restore_id": "r1", "state": "active", "partition_id": "p",
                              "units": {0: "claimed"}}]}
    con = Console(record=True, width=140)
    render_stats({"controller": ctl, "units": [unit],
                  "client": {"puts": {"calls": 1, "rows": 2, "bytes": 32}}}, console=con)
    out = con.export_text()
    assert "GET_ROWS" in out and "unit 0 requests" in out and "r1" in out and "puts" in out


def test_exporter_port_offsets(monkeypatch):
    from tqtx.metrics import exporter_port_for
    monkeypatch.delenv("TQTX_METRICS_PORT", raising=False)
    assert exporter_port_for(0) is None
    monkeypatch.setenv("TQTX_METRICS_PORT", "9500")
    assert [exporter_port_for(o) for o in (0, 1, 2)] == [9500, 9501, 9502]


def test_no_heavy_imports_in_server_processes():
    import subprocess
    import sys
    code = ("import sys, tqtx.controller.server, tqtx.storage.unit, tqtx.metrics; "
            "print(','.join(m for m in ('torch', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""

