#!/usr/bin/env python
"""Unit memory against live payload after put / clear / overwrite / restore steps.

    python benchmarks/unit_memory.py [--units 2] [--mb 256] [--dir /dev/shm] [--json P]
    python benchmarks/unit_memory.py --mb 2048

Starts a deployment, then after each step prints, per unit: RSS, the peak RSS during the
step (``VmHWM`` after resetting it with ``/proc/<pid>/clear_refs``), the live payload
bytes the unit reports (``bytes`` of GET_STATS) and ``RSS - (idle + live)`` as a share of
``idle + live``; idle is measured after a warm-up (put, dump, restore, get and clear of 64
rows), so imports and the unit's I/O threads count as idle. The issue's target: within 10% once a step settles; a restore that
overwrites keys peaks at most at idle + live + the new bytes it stages. Steps: put the
rollout buffer of ``benchmarks/get_throughput.py``; put it again (overwrite); dump it;
restore it over the live keys (overwrite); clear everything; restore into the empty
partition; clear again.
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
from get_throughput import MiB, rollout_buffer  # noqa: E402
from _common import proc_status, reset_peak  # noqa: E402  (VmRSS / VmHWM of a pid)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=2)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where the state dir and the dump go (a temp subdir)")
    p.add_argument("--settle", type=float, default=1.5,
                   help="seconds to wait after a step before reading RSS")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    import tqtx as tq

    keys, td, _ = rollout_buffer(a.mb)
    base = tempfile.mkdtemp(prefix="unitmem-", dir=a.dir)
    pid = "mem"
    results = []
    cfg = tq.init({"num_units": a.units, "state_dir": os.path.join(base, "state")})
    try:
        client = tq.get_client()
        pids = [client.fan_out("GET_STATS", {u: {}})[u]["pid"] for u in range(a.units)]
        time.sleep(a.settle)
        cold = [proc_status(x)["VmRSS"] for x in pids]
        # "idle": a unit that served every kind of request once and holds no rows (imports,
        # its I/O threads and their malloc arenas are part of a running unit)
        warm = os.path.join(base, "warm")
        w = min(64, len(keys))
        tq.kv_batch_put(keys[:w], pid, td[:w])
        tq.dump_data_by_key(warm, keys[:w], pid)
        tq.load_data_by_key(warm)
        tq.kv_batch_get(keys[:w], pid)
        tq.kv_clear(keys[:w], pid)
        time.sleep(a.settle)
        idle = [proc_status(x)["VmRSS"] for x in pids]
        dump_dir = os.path.join(base, "dump")

        def step(name, fn):
            for x in pids:
                reset_peak(x)
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
            time.sleep(a.settle)
            stats = client.fan_out("GET_STATS", {u: {} for u in range(a.units)})
            units = []
            for u, x in enumerate(pids):
                st = proc_status(x)
                live = stats[u]["bytes"]
                want = idle[u] + live
                units.append({"rss": st["VmRSS"], "peak": st["VmHWM"], "live": live,
                              "rows": stats[u]["rows"], "over": (st["VmRSS"] - want) / want})
            results.append({"step": name, "seconds": seconds, "units": units})
            print(f"{name:<34} {seconds:6.2f}s  " + "  ".join(
                f"u{i}: rss {r['rss'] / MiB:6.0f} peak {r['peak'] / MiB:6.0f} live "
                f"{r['live'] / MiB:6.0f} MiB ({r['over'] * 100:+4.0f}%)"
                for i, r in enumerate(units)), flush=True)

        print(f"{len(keys)} rows, {a.mb} MiB, {a.units} units; RSS at start " +
              ", ".join(f"{x / MiB:.0f}" for x in cold) + " MiB, idle after a warm-up "
              "(put, dump, restore, get, clear of 64 rows) " +
              ", ".join(f"{x / MiB:.0f}" for x in idle) + " MiB; (RSS vs idle + live)")
        step("put", lambda: tq.kv_batch_put(keys, pid, td))
        step("put again (overwrite every key)", lambda: tq.kv_batch_put(keys, pid, td))
        step("dump", lambda: tq.dump_data_by_key(dump_dir, keys, pid))
        step("restore over live keys", lambda: tq.load_data_by_key(dump_dir))
        step("clear all", lambda: tq.kv_clear(keys, pid))
        step("restore into empty", lambda: tq.load_data_by_key(dump_dir))
        step("clear all again", lambda: tq.kv_clear(keys, pid))
        step("put", lambda: tq.kv_batch_put(keys, pid, td))
    finally:
        tq.close()
        shutil.rmtree(base, ignore_errors=True)
    worst = max(abs(u["over"]) for r in results for u in r["units"])
    print(f"worst settled RSS vs idle + live: {worst * 100:.0f}% (target <= 10%)")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"mb": a.mb, "units": a.units, "idle": idle, "cold": cold, "config": {
                "num_units": cfg.get("num_units")}, "steps": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
