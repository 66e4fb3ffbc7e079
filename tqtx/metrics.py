"""Per-process request metrics: a cheap, plain-Python registry (no torch, no prometheus).

Every controller and unit :class:`~tqtx.wire.rpc.Server` owns one :class:`Metrics`.
The server loop records each request once, when its reply is sent (so a Deferred reply
finished later by a worker thread is timed from receive to reply): count, errors,
latency as fixed-bucket counts (p50/p99 are estimated from the buckets), and the
request/reply frame bytes. Processes also keep named totals (``dump_rows_total``,
``load_bytes_total``, ...) and gauges (rows held, bytes held, open restores).

``TQTX_METRICS=0`` disables request recording (used to measure its overhead).
Prometheus export is optional (:func:`start_exporter`, ``pip install tqtx[metrics]``):
a custom collector reads this registry on scrape, so the hot path never touches
``prometheus_client``.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from array import array
from bisect import bisect_left
from typing import Callable

from .layout.switches import switched_off

log = logging.getLogger("tqtx.metrics")

ENABLED = not switched_off("TQTX_METRICS")

# Upper bounds (milliseconds) of the latency buckets; a last, open bucket catches the rest.
BUCKETS_MS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0,
                                 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
                                 60000.0, 300000.0)
_NB = len(BUCKETS_MS) + 1


# An OpRecord's numbers live in one preallocated array of doubles, not in int and float
# objects: updating an attribute would leave a fresh number object alive until the next
# request of that op, and one allocated while a unit held many rows keeps the 1 MiB
# pymalloc arena it sits in mapped after the rows are gone (docs/performance.md, *Unit memory*).
# Doubles count exactly up to 2**53.
_COUNT, _ERRORS, _SECONDS, _MAX, _IN, _OUT, _BUCKET0 = range(7)


class OpRecord:
    """Counters of one request type."""

    __slots__ = ("_v",)

    def __init__(self):
        self._v = array("d", bytes(8 * (_BUCKET0 + _NB)))

    count = property(lambda self: int(self._v[_COUNT]))
    errors = property(lambda self: int(self._v[_ERRORS]))
    seconds = property(lambda self: self._v[_SECONDS])
    max_seconds = property(lambda self: self._v[_MAX])
    bytes_in = property(lambda self: int(self._v[_IN]))
    bytes_out = property(lambda self: int(self._v[_OUT]))

    @property
    def buckets(self) -> list[int]:
        return [int(n) for n in self._v[_BUCKET0:]]

    def add(self, seconds: float, bytes_in: int, bytes_out: int, error: bool) -> None:
        v = self._v
        v[_COUNT] += 1
        if error:
            v[_ERRORS] += 1
        v[_SECONDS] += seconds
        if seconds > v[_MAX]:
            v[_MAX] = seconds
        v[_IN] += bytes_in
        v[_OUT] += bytes_out
        v[_BUCKET0 + bisect_left(BUCKETS_MS, seconds * 1000.0)] += 1

    def quantile_ms(self, q: float) -> float | None:
        """Estimate the ``q`` quantile (0..1) in ms by interpolating within its bucket."""
        buckets = self.buckets
        total = sum(buckets)
        if total == 0:
            return None
        rank = q * total
        seen = 0
        max_ms = self.max_seconds * 1000.0
        for i, n in enumerate(buckets):
            if n and seen + n >= rank:
                lo = BUCKETS_MS[i - 1] if i > 0 else 0.0
                hi = BUCKETS_MS[i] if i < len(BUCKETS_MS) else max(max_ms, lo)
                hi = min(hi, max_ms) if max_ms > lo else hi
                return lo + (hi - lo) * max(0.0, min(1.0, (rank - seen) / n))
            seen += n
        return max_ms

    def to_dict(self) -> dict:
        p50, p99 = self.quantile_ms(0.5), self.quantile_ms(0.99)
        return {"count": self.count, "errors": self.errors,
                "p50_ms": None if p50 is None else round(p50, 4),
                "p99_ms": None if p99 is None else round(p99, 4),
                "mean_ms": round(self.seconds * 1000.0 / self.count, 4) if self.count else None,
                "max_ms": round(self.max_seconds * 1000.0, 4),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}


class Metrics:
    """The registry of one process: per-op records, named totals and gauges.

    :meth:`record` is called only by the server loop thread; :meth:`add` may be called
    from any thread (worker threads finishing a dump or a load).
    """

    def __init__(self, role: str, unit_id: int | None = None, *, enabled: bool | None = None):
        self.role = role
        self.unit_id = unit_id
        self.enabled = ENABLED if enabled is None else enabled
        self.started = time.time()
        self.ops: dict[str, OpRecord] = {}
        # named totals: a name's slot in one array of doubles (see OpRecord)
        self._total_index: dict[str, int] = {}
        self._totals = array("d", [math.nan]) * 32  # NaN: never added to
        self.gauges: dict[str, Callable[[], float]] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- recording
    def record(self, op: str, seconds: float, bytes_in: int = 0, bytes_out: int = 0,
               error: bool = False) -> None:
        rec = self.ops.get(op)
        if rec is None:
            rec = self.ops[op] = OpRecord()
        rec.add(seconds, bytes_in, bytes_out, error)

    def declare(self, ops=(), totals=()) -> None:
        """Make the records of ``ops`` and the named ``totals`` now (a server does it for
        every op it serves, at start-up), so that none is first made while many rows are held."""
        if self.enabled:
            for op in ops:
                if op not in self.ops:
                    self.ops[op] = OpRecord()
        with self._lock:
            for name in totals:
                self._total_slot(name)

    def _total_slot(self, name: str) -> int:
        i = self._total_index.get(name)
        if i is None:
            i = self._total_index[name] = len(self._total_index)
            if i >= len(self._totals):
                self._totals.extend(array("d", [math.nan]) * len(self._totals))
        return i

    def add(self, name: str, value: float = 1) -> None:
        """Add to a named total (thread-safe)."""
        with self._lock:
            i = self._total_slot(name)
            v = self._totals[i]
            self._totals[i] = value if v != v else v + value

    def gauge(self, name: str, fn: Callable[[], float]) -> None:
        """Register a gauge read on demand (``rows_held``, ``bytes_held``, ``open_restores``)."""
        self.gauges[name] = fn

    # ---------------------------------------------------------------- reading
    def uptime(self) -> float:
        return time.time() - self.started

    def read_gauges(self) -> dict:
        out = {}
        for name, fn in list(self.gauges.items()):
            try:
                out[name] = fn()
            except Exception as exc:  # a gauge must never break stats or a scrape
                log.debug("gauge %s failed: %s", name, exc)
                out[name] = None
        return out

    def ops_snapshot(self) -> dict:
        return {op: rec.to_dict() for op, rec in sorted(list(self.ops.items())) if rec.count}

    @property
    def totals(self) -> dict[str, float]:
        """The named totals that were added to (a copy)."""
        with self._lock:
            out = {}
            for name, i in self._total_index.items():
                v = self._totals[i]
                if v == v:
                    out[name] = int(v) if v.is_integer() else v
            return out

    def totals_snapshot(self) -> dict:
        return dict(sorted(self.totals.items()))

    def snapshot(self) -> dict:
        """Everything, as plain JSON-able data (what GET_STATS returns under ``ops``/``totals``)."""
        return {"role": self.role, "unit_id": self.unit_id, "pid": os.getpid(),
                "uptime": self.uptime(), "metrics_enabled": self.enabled,
                "ops": self.ops_snapshot(), "totals": self.totals_snapshot()}


def frames_nbytes(frames) -> int:
    """Total byte size of message frames (bytes, memoryviews or zmq frames)."""
    n = 0
    for f in frames:
        if isinstance(f, memoryview):
            n += f.nbytes
        else:
            try:
                n += len(f)
            except TypeError:
                n += memoryview(f).nbytes
    return n


# ---------------------------------------------------------------- Prometheus export
METRIC_NAMES = {
    "tqtx_requests_total": "requests handled, by role, unit and op (counter)",
    "tqtx_request_errors_total": "requests answered with an error (counter)",
    "tqtx_request_seconds": "time from receiving a request to sending its reply (histogram)",
    "tqtx_request_bytes_in_total": "request frame bytes received (counter)",
    "tqtx_request_bytes_out_total": "reply frame bytes sent (counter)",
    "tqtx_rows_held": "rows (units) or keys (controller) held now (gauge)",
    "tqtx_bytes_held": "payload bytes held now (gauge; 0 on the controller)",
    "tqtx_open_restores": "unresolved restores (controller) or staged restores (unit) (gauge)",
    "tqtx_uptime_seconds": "seconds since the process started (gauge)",
}


class _Collector:
    """A prometheus_client collector reading a :class:`Metrics` on each scrape."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        m = self.metrics
        base = [m.role, "" if m.unit_id is None else str(m.unit_id)]
        labels = ["role", "unit", "op"]
        req = CounterMetricFamily("tqtx_requests_total", METRIC_NAMES["tqtx_requests_total"],
                                  labels=labels)
        err = CounterMetricFamily("tqtx_request_errors_total",
                                  METRIC_NAMES["tqtx_request_errors_total"], labels=labels)
        bin_ = CounterMetricFamily("tqtx_request_bytes_in_total",
                                   METRIC_NAMES["tqtx_request_bytes_in_total"], labels=labels)
        bout = CounterMetricFamily("tqtx_request_bytes_out_total",
                                   METRIC_NAMES["tqtx_request_bytes_out_total"], labels=labels)
        hist = HistogramMetricFamily("tqtx_request_seconds", METRIC_NAMES["tqtx_request_seconds"],
                                     labels=labels)
        for op, rec in sorted(list(m.ops.items())):
            lv = base + [op]
            req.add_metric(lv, rec.count)
            err.add_metric(lv, rec.errors)
            bin_.add_metric(lv, rec.bytes_in)
            bout.add_metric(lv, rec.bytes_out)
            cum, buckets = 0, []
            counts = list(rec.buckets)
            for bound, n in zip(BUCKETS_MS, counts):
                cum += n
                buckets.append((_fmt_bound(bound / 1000.0), cum))
            cum += counts[-1]
            buckets.append(("+Inf", cum))
            hist.add_metric(lv, buckets, rec.seconds)
        yield from (req, err, bin_, bout, hist)
        gauges = m.read_gauges()
        for name, key in (("tqtx_rows_held", "rows_held"), ("tqtx_bytes_held", "bytes_held"),
                          ("tqtx_open_restores", "open_restores")):
            g = GaugeMetricFamily(name, METRIC_NAMES[name], labels=["role", "unit"])
            value = gauges.get(key)
            if value is not None:
                g.add_metric(base, value)
            yield g
        g = GaugeMetricFamily("tqtx_uptime_seconds", METRIC_NAMES["tqtx_uptime_seconds"],
                              labels=["role", "unit"])
        g.add_metric(base, m.uptime())
        yield g
        for name, value in m.totals_snapshot().items():
            c = CounterMetricFamily(f"tqtx_{name}", f"process total {name}",
                                    labels=["role", "unit"])
            c.add_metric(base, value)
            yield c


def _fmt_bound(x: float) -> str:
    return repr(float(x)) if math.isfinite(x) else "+Inf"


def exporter_port_for(offset: int) -> int | None:
    """This process's exporter port from ``TQTX_METRICS_PORT`` (base + offset), or None."""
    raw = os.environ.get("TQTX_METRICS_PORT", "").strip()
    if not raw:
        return None
    base = int(raw)
    return base + offset if base > 0 else None


def start_exporter(metrics: Metrics, port: int, host: str | None = None):
    """Serve ``metrics`` at ``http://host:port/metrics``; returns the HTTP server or None.

    Never fatal: without ``prometheus_client``, or when the port is taken, it logs and
    the process keeps serving requests.
    """
    host = host or os.environ.get("TQTX_METRICS_HOST") or "127.0.0.1"
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        log.warning("metrics export on port %d requested but prometheus_client is not "
                    "installed (pip install tqtx[metrics])", port)
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    try:
        server = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.error("metrics export: cannot listen on %s:%d: %s", host, port, exc)
        return None
    log.info("metrics export: %s%s serving Prometheus metrics at http://%s:%d/metrics",
             metrics.role, "" if metrics.unit_id is None else f" {metrics.unit_id}", host, port)
    return server


def maybe_start_exporter(metrics: Metrics, offset: int):
    """Start the exporter if ``TQTX_METRICS_PORT`` is set (controller offset 0, unit k 1+k)."""
    try:
        port = exporter_port_for(offset)
    except ValueError:
        log.error("TQTX_METRICS_PORT=%r is not a port number",
                  os.environ.get("TQTX_METRICS_PORT"))
        return None
    if port is None:
        return None
    return start_exporter(metrics, port)


# ---------------------------------------------------------------- `tqtx stats` rendering
def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_stats(data: dict, console=None) -> None:
    """Print ``Client.stats()`` as rich tables: one summary, then requests per process."""
    from rich.console import Console
    from rich.table import Table
    con = console or Console()
    procs = [("controller", data["controller"])] + [
        (f"unit {u.get('unit_id')}", u) for u in data.get("units", [])]
    t = Table("process", "pid", "node", "uptime s", "rows", "bytes", "open restores",
              title="tqtx processes")
    for name, p in procs:
        if p.get("error"):  # not reached: named below the table
            t.add_row(name, "-", "-", "-", "-", "-", "unreachable")
            continue
        opened = p.get("open_restores") if p.get("role") == "controller" else \
            p.get("staged_restores", [])
        t.add_row(name, str(p.get("pid", "-")), str(p.get("node") or "-")[:16],
                  f"{p.get('uptime', 0):.0f}",
                  str(p.get("rows", p.get("keys", "-"))), str(p.get("bytes", "-")),
                  str(len(opened or [])))
    con.print(t)
    for name, p in procs:
        if p.get("error"):
            con.print(f"  {name} at {p.get('address') or '(no address)'}: unreachable: "
                      f"{p['error']}")
    procs = [(name, p) for name, p in procs if not p.get("error")]
    ctl = data["controller"]
    if ctl.get("lost_rows"):
        con.print(f"  lost rows: {ctl['lost_rows']} (left out of kv_list, RowsLostError on "
                  f"read; `tqtx stats --lost` or tq.list_lost_keys() names them: put them "
                  f"again, restore a dump holding them, or kv_clear them)")
    for pid, keys in (data.get("lost_keys") or {}).items():
        for key, info in keys.items():
            con.print(f"  lost: partition {pid!r} key {key!r} (unit {info['unit']}, fields "
                      f"{info['fields']}, tag {info['tag']})")
    for r in data["controller"].get("open_restores") or []:
        if isinstance(r, dict):
            units = ", ".join(f"unit {u}: {s}" for u, s in sorted(r.get("units", {}).items()))
            con.print(f"  open restore {r['restore_id']} ({r.get('state')}, partition "
                      f"{r.get('partition_id')!r}): {units}")
    for name, p in procs:
        ops = p.get("ops") or {}
        t = Table("request", "count", "errors", "p50 ms", "p99 ms", "bytes in", "bytes out",
                  title=f"{name} requests" + ("" if p.get("metrics_enabled", True)
                                              else " (recording disabled)"))
        for op, r in ops.items():
            t.add_row(op, str(r["count"]), str(r["errors"]), _ms(r.get("p50_ms")),
                      _ms(r.get("p99_ms")), str(r.get("bytes_in", 0)),
                      str(r.get("bytes_out", 0)))
        con.print(t)
        totals = p.get("totals") or {}
        if totals:
            con.print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in totals.items()))
    client = data.get("client")
    if client:
        t = Table("client (this process)", "calls", "rows", "bytes")
        for kind in ("puts", "gets", "dumps", "restores"):
            c = client.get(kind) or {}
            t.add_row(kind, str(c.get("calls", 0)), str(c.get("rows", 0)),
                      str(c.get("bytes", 0)))
        con.print(t)
