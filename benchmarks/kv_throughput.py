#!/usr/bin/env python
"""KV put/get throughput against an in-process copy, and tiny kv_put latency.

    python benchmarks/kv_throughput.py [--units 4] [--mb 256] [--reps 5] [--tiny 1000] [--json P]

For a batch of --mb MiB in two shapes (256 rows x 1 MiB float32 and 4096 rows x 64 KiB),
median of --reps: kv_batch_put (into fresh keys: the partition is cleared before each
rep) and kv_batch_get, in GB/s, next to ``torch.Tensor.clone()`` of the same bytes.
Then the median latency of --tiny kv_put calls of one small row. Targets: put and get
within 4x of the clone time; tiny kv_put median under 2 ms.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

MiB = 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny", type=int, default=1000)
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    warnings.filterwarnings("ignore")
    import torch
    from rich.console import Console
    from rich.table import Table
    from tensordict import TensorDict

    import tqtx as tq
    for name in ("torch", "torch.fx", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
    con = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    nbytes = a.mb * MiB
    results = {"units": a.units, "bytes": nbytes, "reps": a.reps, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="tqtx-kvbench-") as state:
        tq.init({"num_units": a.units, "state_dir": state})
        try:
            for rows, row_bytes in ((nbytes // MiB, MiB), (nbytes // (64 * 1024), 64 * 1024)):
                x = torch.rand(rows, row_bytes // 4)
                keys = [f"r{i}" for i in range(rows)]
                pid = f"tp{row_bytes}"
                td = TensorDict({"x": x}, batch_size=[rows])
                put, get, clone = [], [], []
                for rep in range(a.reps):
                    t0 = time.perf_counter()
                    y = x.clone()
                    clone.append(time.perf_counter() - t0)
                    del y
                    t0 = time.perf_counter()
                    tq.kv_batch_put(keys, pid, td)
                    put.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    out = tq.kv_batch_get(keys, pid)
                    get.append(time.perf_counter() - t0)
                    if rep == 0 and not torch.equal(out["x"], x):
                        raise AssertionError("kv_batch_get returned different values")
                    del out
                    tq.kv_clear(keys, pid)
                m = {k: statistics.median(v) for k, v in
                     (("put", put), ("get", get), ("clone", clone))}
                results["shapes"][f"{rows}x{row_bytes // 1024}KiB"] = {
                    "rows": rows, "row_bytes": row_bytes, "seconds": m,
                    "all": {"put": put, "get": get, "clone": clone},
                    "gbps": {k: nbytes / v / 1e9 for k, v in m.items()},
                    "ratio_vs_clone": {"put": m["put"] / m["clone"], "get": m["get"] / m["clone"]}}
                con.print(f"{rows} x {row_bytes // 1024} KiB: put {m['put']:.3f}s, "
                          f"get {m['get']:.3f}s, clone {m['clone']:.3f}s")
            lat = []
            row = {"obs": torch.rand(16), "reward": torch.tensor(1.0)}
            for i in range(a.tiny + 20):
                t0 = time.perf_counter()
                tq.kv_put(f"tiny{i}", "tiny", row, tag={"step": i})
                if i >= 20:  # first calls open sockets
                    lat.append(time.perf_counter() - t0)
            lat.sort()
            results["tiny_kv_put"] = {"calls": len(lat), "median_ms": statistics.median(lat) * 1e3,
                                      "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3}
        finally:
            tq.close()
    t = Table(title=f"kv throughput, {a.mb} MiB batch, {a.units} units, median of {a.reps}")
    for c in ("shape", "op", "median s", "GB/s", "x clone", "target (<= 4x clone)"):
        t.add_column(c, justify="left" if c in ("shape", "op") else "right")
    for shape, r in results["shapes"].items():
        for op in ("put", "get", "clone"):
            ratio = r["seconds"][op] / r["seconds"]["clone"]
            t.add_row(shape, op, f"{r['seconds'][op]:.3f}", f"{r['gbps'][op]:.2f}",
                      f"{ratio:.2f}", "" if op == "clone" else ("met" if ratio <= 4 else "MISSED"))
    con.print(t)
    tiny = results["tiny_kv_put"]
    con.print(f"tiny kv_put: median {tiny['median_ms']:.3f} ms, p99 {tiny['p99_ms']:.3f} ms over "
              f"{tiny['calls']} calls (target < 2 ms: "
              f"{'met' if tiny['median_ms'] < 2 else 'MISSED'})")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
