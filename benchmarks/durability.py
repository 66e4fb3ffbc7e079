#!/usr/bin/env python
"""The cost of durable metadata: durability "sync" vs "buffer" vs "controller" vs "memory".

    python benchmarks/durability.py [--units 4] [--reps 5] [--tiny 200] [--rows 5000]
                                    [--cols 13422] [--restart-keys 200000] [--restart-reps 3]
                                    [--dir DIR] [--quick] [--json P]

One worker process per durability setting, each with its own deployment
(``tq.init(config={"durability": ...})``) on its own fresh state dir under --dir (default:
the temp dir, on disk, so "sync" pays its fsyncs). Every repetition asks the workers in
turn, the order rotating per repetition, to run one op:

* ``tiny kv_put``: --tiny ``kv_put`` calls of one key with one small tensor (median of
  every call of every repetition). Target: < 2 ms at "sync".
* ``5k-row kv_batch_put``: a --rows x --cols float32 field (default 5000 x 13422 =
  256 MiB) into fresh keys; ``kv_clear`` of them is timed too. Target: sync/memory,
  buffer/memory and controller/memory <= 1.10.
* ``restart``: --restart-keys small keys (batches of 10k, a tag each) put once (timed:
  metadata-bound puts; then a ``kv_list`` of them, median of 3), then per repetition
  ``restart_controller()`` (kill -9, start, replay, ready announcement) and the time until
  a ``kv_list`` returns every key, and until a ``kv_batch_get`` of a sample works (the
  units re-registered). Target: < 5 s at "sync". The journal's size
  (``journal.sqlite`` + WAL) after the puts is reported. With "memory" nothing is replayed.

--quick: small sizes, finishes in under a minute.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    JsonWorker, MiB, error_reply, fs_type, median, replay_logged, serve)

SETTINGS = ("sync", "buffer", "controller", "memory")
BASE = "memory"  # the ratios' denominator
DURABLE = ("sync", "buffer", "controller")
FILL_BATCH = 10_000


# ---------------------------------------------------------------- worker (one deployment)
def _journal_bytes(state_dir: str) -> dict:
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = os.path.join(state_dir, "journal.sqlite" + suffix)
        out["db" + suffix] = os.path.getsize(p) if os.path.exists(p) else 0
    return out


class Bench:
    """The ops of one worker, on its own deployment with durability ``setting``."""

    def __init__(self, setting: str, units: int, base: str):
        import torch
        import tqtx as tq
        self.torch, self.tq = torch, tq
        self.setting = setting
        self.state = tempfile.mkdtemp(prefix=f"durbench-{setting}-", dir=base)
        tq.init(config={"num_units": units, "state_dir": self.state, "durability": setting})
        self.filled = 0
        self.rep = 0

    def tiny(self, n: int) -> dict:
        tq, row = self.tq, {"x": self.torch.rand(16)}
        self.rep += 1
        keys, lat = [f"t{self.rep}-{i}" for i in range(n + 10)], []
        for i, k in enumerate(keys):
            t0 = time.perf_counter()
            tq.kv_put(k, "tiny", row)
            if i >= 10:  # the first calls of a rep are not measured
                lat.append(time.perf_counter() - t0)
        tq.kv_clear(keys, "tiny")
        return {"lat": lat}

    def batch(self, rows: int, cols: int) -> dict:
        from tensordict import TensorDict
        if getattr(self, "_td", None) is None or self._td.batch_size[0] != rows:
            x = self.torch.rand(rows, cols, generator=self.torch.Generator().manual_seed(0))
            self._td = TensorDict({"x": x}, batch_size=[rows])
            self._keys = [f"row-{i:06d}" for i in range(rows)]
        t0 = time.perf_counter()
        self.tq.kv_batch_put(self._keys, "batch", self._td)
        put = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.tq.kv_clear(self._keys, "batch")
        return {"put": put, "clear": time.perf_counter() - t0}

    def restart(self, keys: int) -> dict:
        from tensordict import TensorDict
        import tqtx.api
        tq, out = self.tq, {}
        if self.filled != keys:
            t0 = time.perf_counter()
            for b in range(0, keys, FILL_BATCH):
                n = min(FILL_BATCH, keys - b)
                tq.kv_batch_put([f"k{i:07d}" for i in range(b, b + n)], "replay",
                                TensorDict({"x": self.torch.zeros(n, 4)}, batch_size=[n]),
                                tags=[{"step": b // FILL_BATCH}] * n)
            out["fill_s"] = time.perf_counter() - t0
            out["journal"] = _journal_bytes(self.state)
            self.filled = keys
            lists = []
            for _ in range(3):  # with "memory" the keys are gone after a restart: list them now
                t0 = time.perf_counter()
                tq.kv_list("replay")
                lists.append(time.perf_counter() - t0)
            out["list_steady_s"] = median(lists)
        t0 = time.perf_counter()
        tqtx.api._deployment.restart_controller()
        out["ready_s"] = time.perf_counter() - t0
        listed = tq.kv_list("replay").get("replay", {})
        out["list_s"] = time.perf_counter() - t0
        out["listed"] = len(listed)
        if listed:
            sample = sorted(listed)[:: max(1, len(listed) // 100)]
            got = tq.kv_batch_get(sample, "replay")
            out["get_s"] = time.perf_counter() - t0
            rows = got["x"].unbind(0)  # dense or jagged (TransferQueue's result layout)
            if len(rows) != len(sample) or any(tuple(r.shape) != (4,) for r in rows):
                raise AssertionError(f"kv_batch_get after restart: {len(rows)} rows of "
                                     f"shapes {sorted({tuple(r.shape) for r in rows})}")
        out["replay_logged"] = replay_logged(self.state)
        return out

    def close(self):
        try:
            self.tq.close()
        finally:
            shutil.rmtree(self.state, ignore_errors=True)


def worker(a) -> int:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    res = os.fdopen(a.result_fd, "w", buffering=1)
    try:
        bench = Bench(a.worker, a.units, a.dir)
    except Exception as exc:
        res.write(error_reply(exc))
        return 1
    res.write(json.dumps({"ready": True, "state_dir": bench.state}) + "\n")
    try:
        serve(res, lambda cmd: getattr(bench, cmd["op"])(*cmd["args"]))
    finally:
        bench.close()
    return 0


# ---------------------------------------------------------------- parent
def _start_worker(setting: str, a) -> JsonWorker:
    """The worker process of one durability setting (its ready line not yet read)."""
    return JsonWorker(
        setting, [sys.executable, os.path.abspath(__file__), "--worker", setting,
                  "--units", str(a.units), "--dir", a.dir],
        a.log, env={**os.environ, "TQTX_LOG_LEVEL": "WARNING"})


def _rotations(reps: int):
    for rep in range(reps):
        k = rep % len(SETTINGS)
        yield rep, SETTINGS[k:] + SETTINGS[:k]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, help="units per deployment (default 4, --quick 2)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of tiny and batch")
    p.add_argument("--tiny", type=int, default=200, help="kv_put calls per repetition")
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--cols", type=int, default=13422, help="float32 per row (13422: 256 MiB)")
    p.add_argument("--restart-keys", type=int, default=200_000)
    p.add_argument("--restart-reps", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the state dirs go (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small sizes (< 1 minute)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "durability_bench.log"),
                   help="the workers' stderr (default: %(default)s)")
    p.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    p.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.quick:
        a.reps, a.tiny, a.rows, a.restart_keys, a.restart_reps = 3, 50, 500, 10_000, 2
    a.units = a.units or (2 if a.quick else 4)
    a.dir = os.path.abspath(a.dir)
    load0 = os.getloadavg()
    mib = a.rows * a.cols * 4 / MiB
    print(f"state dirs under {a.dir} ({fs_type(a.dir)}); {a.units} units; load average "
          f"{load0[0]:.2f} on {os.cpu_count()} cpus", flush=True)
    workers: dict[str, JsonWorker] = {}
    tiny = {s: [] for s in SETTINGS}
    batch = {s: {"put": [], "clear": []} for s in SETTINGS}
    restart = {s: [] for s in SETTINGS}
    t_start = time.perf_counter()
    try:
        for s in SETTINGS:  # start the deployments in parallel
            workers[s] = _start_worker(s, a)
        for w in workers.values():
            w.read()
        for rep, order in _rotations(a.reps):
            for s in order:
                tiny[s] += workers[s].call("tiny", args=[a.tiny])["lat"]
            for s in order:
                r = workers[s].call("batch", args=[a.rows, a.cols])
                batch[s]["put"].append(r["put"])
                batch[s]["clear"].append(r["clear"])
            print(f"rep {rep + 1}/{a.reps}: batch put " + ", ".join(
                f"{s} {batch[s]['put'][-1]:.3f}s" for s in SETTINGS), flush=True)
        for rep, order in _rotations(a.restart_reps):
            for s in order:
                restart[s].append(workers[s].call("restart", args=[a.restart_keys]))
            print(f"restart {rep + 1}/{a.restart_reps}: " + ", ".join(
                f"{s} {restart[s][-1]['ready_s']:.2f}s" for s in SETTINGS), flush=True)
    finally:
        for w in workers.values():
            w.stop()
    load1 = os.getloadavg()
    k = f"{a.restart_keys // 1000}k"
    med = {s: {"tiny kv_put": median(tiny[s]),
               f"{a.rows}-row kv_batch_put": median(batch[s]["put"]),
               f"{a.rows}-row kv_clear": median(batch[s]["clear"]),
               f"{k} small keys put ({FILL_BATCH // 1000}k a batch)":
                   median([r["fill_s"] for r in restart[s] if "fill_s" in r]),
               f"kv_list of {k} keys, no restart": median(
                   [r["list_steady_s"] for r in restart[s] if "list_steady_s" in r]),
               "restart: ready": median([r["ready_s"] for r in restart[s]]),
               "restart: kv_list of all": median([r["list_s"] for r in restart[s]]),
               "restart: kv_batch_get": median([r["get_s"] for r in restart[s] if "get_s" in r]),
               "replay (controller log)": median([r["replay_logged"][1] for r in restart[s]
                                                  if r.get("replay_logged")])}
           for s in SETTINGS}
    journal = {s: restart[s][0].get("journal", {}) for s in SETTINGS}
    listed = {s: [r["listed"] for r in restart[s]] for s in SETTINGS}
    _print_table(med, a, mib, journal, listed)
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
          f"{time.perf_counter() - t_start:.0f}s in all")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"args": vars(a), "fs": fs_type(a.dir), "load": [load0, load1],
                       "median_s": med, "journal_bytes": journal,
                       "listed": listed, "tiny_s": tiny, "batch_s": batch,
                       "restart": restart}, f, indent=2)
    return 0


def _fmt(op: str, t: float) -> str:
    if t != t:  # NaN: not measured
        return "-"
    return f"{t * 1e3:.3f} ms" if op.startswith("tiny") else f"{t:.3f} s"


def _print_table(med, a, mib, journal, listed):
    print(f"\ntiny: median of {a.reps} x {a.tiny} calls; batch: {a.rows} x {a.cols} float32 "
          f"({mib:.0f} MiB), median of {a.reps}; restart: {a.restart_keys} keys, median of "
          f"{a.restart_reps}")
    head = ["op", *SETTINGS, *(f"{s}/{BASE}" for s in DURABLE)]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for op in med[SETTINGS[0]]:
        row = [op] + [_fmt(op, med[s][op]) for s in SETTINGS]
        base = med[BASE][op]
        for s in DURABLE:
            row.append(f"{med[s][op] / base:.2f}" if base == base and base > 0 else "-")
        print(" | ".join(row))
    pad = [""] * len(DURABLE)
    row = [f"journal after the {a.restart_keys // 1000}k puts"]
    for s in SETTINGS:
        j = journal[s]
        row.append(f"{j.get('db', 0) / MiB:.1f} + {j.get('db-wal', 0) / MiB:.1f} MiB WAL")
    print(" | ".join(row + pad))
    print(" | ".join(["keys listed after restart"] +
                     [",".join(map(str, listed[s])) for s in SETTINGS] + pad))
    batch = f"{a.rows}-row kv_batch_put"
    targets = [("tiny kv_put at sync < 2 ms", med["sync"]["tiny kv_put"] < 2e-3)]
    targets += [(f"batch put {s}/{BASE} <= 1.10", med[s][batch] <= 1.10 * med[BASE][batch])
                for s in DURABLE]
    targets.append((f"restart with {a.restart_keys} keys at sync < 5 s (kv_list)",
                    med["sync"]["restart: kv_list of all"] < 5.0))
    what = "targets (--quick sizes: indicative only)" if a.quick else "targets"
    print(f"{what}: " + "; ".join(f"{t}: {'met' if ok else 'MISSED'}" for t, ok in targets))


if __name__ == "__main__":
    sys.exit(main())
