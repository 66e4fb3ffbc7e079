#!/usr/bin/env python
"""How each operation's cost grows with the number of small keys in a partition.

    python benchmarks/million_keys.py [--sizes 10000,100000,1000000] [--units 4]
                                      [--durability controller] [--dir DIR] [--quick] [--json P]

One deployment per size (``tq.init`` on a fresh state dir under --dir, closed afterwards).
Keys are put in batches of 10k, each a small row (one int64 tensor of 8 values) with a tag.
Per size, timed:

* ``put``: all keys (also per key, and the CPU time per key of the client, the controller
  and the units together during the puts);
* ``kv_batch_get 1k``: 1,000 keys spread over the partition;
* ``kv_list``: the whole partition;
* ``kv_clear 100k`` (or all keys if fewer), then ``re-put`` of them;
* ``dump 1k`` / ``dump 100k``: ``dump_data_by_key`` of that many selected keys;
* ``load 100k``: ``load_data_by_key`` of the 100k dump into the partition (a merge);
* ``restart: ready``: ``restart_controller()`` (kill -9, start, replay, ready announcement);
  ``restart -> kv_list``: until a ``kv_list`` then returns every key; ``replay``: the
  controller log's "replayed N keys ... in X s";
* ``controller RSS``: VmRSS of the controller process with all keys, minus its VmRSS before
  the first put (bytes per key), and after the restart's replay.

Targets: each operation grows at most linearly in what it touches (10x the partition's keys
does not make a 1k get or dump slower; put, kv_list and replay grow <= 10x per 10x keys);
controller memory <= 0.5 KiB per key; replay of 1M keys <= 5 s. The table gives each time
and its growth ratio per 10x keys. --quick: 2k and 20k keys, under a minute.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, fs_type, proc_status, replay_logged  # noqa: E402

BATCH = 10_000
OPS = ("put", "put per key", "put CPU per key: client", "put CPU per key: controller",
       "put CPU per key: units", "kv_batch_get 1k", "kv_list", "kv_clear 100k", "re-put 100k",
       "dump 1k", "dump 100k", "load 100k", "restart: ready", "restart -> kv_list", "replay",
       "controller RSS per key", "RSS per key after replay")


def _key(i: int) -> str:
    return f"k{i:07d}"


def _cpu_s(pid) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def run_size(n: int, a) -> dict:
    """Every figure for one deployment holding ``n`` keys."""
    import torch
    from tensordict import TensorDict
    import tqtx as tq
    import tqtx.api

    state = tempfile.mkdtemp(prefix=f"mkeys-{n}-", dir=a.dir)
    dumps = tempfile.mkdtemp(prefix=f"mkeys-dump-{n}-", dir=a.dir)
    pid, out = "p", {}
    try:
        tq.init(config={"num_units": a.units, "state_dir": state, "durability": a.durability})
        ctl = tqtx.api._deployment.pids["controller"]
        rss0 = proc_status(ctl)["VmRSS"]

        def put(lo, hi):
            for b in range(lo, hi, BATCH):
                m = min(BATCH, hi - b)
                tq.kv_batch_put([_key(i) for i in range(b, b + m)], pid,
                                TensorDict({"x": torch.arange(b * 8, (b + m) * 8).view(m, 8)},
                                           batch_size=[m]),
                                tags=[{"step": b // BATCH}] * m)

        units = [p for name, p in tqtx.api._deployment.pids.items() if name != "controller"]
        cpu0 = (time.process_time(), _cpu_s(ctl), sum(map(_cpu_s, units)))
        out["put"], _ = _timed(put, 0, n)
        out["put per key"] = out["put"] / n
        cpu1 = (time.process_time(), _cpu_s(ctl), sum(map(_cpu_s, units)))
        for name, a0, a1 in zip(("client", "controller", "units"), cpu0, cpu1):
            out[f"put CPU per key: {name}"] = (a1 - a0) / n
        out["controller RSS per key"] = (proc_status(ctl)["VmRSS"] - rss0) / n
        sample = [_key(i) for i in range(0, n, max(1, n // 1000))][:1000]
        out["kv_batch_get 1k"], got = _timed(tq.kv_batch_get, sample, pid)
        assert got["x"].shape[0] == len(sample), got["x"].shape
        out["kv_list"], listed = _timed(tq.kv_list, pid)
        assert len(listed[pid]) == n, len(listed[pid])
        del listed
        c = min(100_000, n)
        out["kv_clear 100k"], _ = _timed(tq.kv_clear, [_key(i) for i in range(n - c, n)], pid)
        out["re-put 100k"], _ = _timed(put, n - c, n)
        step = max(1, n // 1000)
        out["dump 1k"], _ = _timed(tq.dump_data_by_key, os.path.join(dumps, "d1k"),
                                   [_key(i) for i in range(0, n, step)][:1000], pid)
        out["dump 100k"], _ = _timed(tq.dump_data_by_key, os.path.join(dumps, "d100k"),
                                     [_key(i) for i in range(0, c)], pid)
        out["load 100k"], r = _timed(tq.load_data_by_key, os.path.join(dumps, "d100k"),
                                     partition_id=pid)
        assert r["keys"] == c, r
        t0 = time.perf_counter()
        tqtx.api._deployment.restart_controller()
        out["restart: ready"] = time.perf_counter() - t0
        listed = tq.kv_list(pid)
        out["restart -> kv_list"] = time.perf_counter() - t0
        assert len(listed.get(pid, {})) == n, len(listed.get(pid, {}))
        del listed
        logged = replay_logged(state)
        out["replay"] = logged[1] if logged else float("nan")
        ctl = tqtx.api._deployment.pids["controller"]
        out["RSS per key after replay"] = (proc_status(ctl)["VmRSS"] - rss0) / n
    finally:
        try:
            tq.close()
        finally:
            shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(dumps, ignore_errors=True)
    return out


def _fmt(op: str, v: float) -> str:
    if v != v:
        return "-"
    if "RSS" in op:
        return f"{v:.0f} B"
    if op.startswith("put") and "per key" in op:
        return f"{v * 1e6:.1f} us"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def _growth(res: dict, lo: int, hi: int, op: str) -> str:
    """Growth of ``op`` from ``lo`` to ``hi`` keys, per 10x keys (geometric)."""
    a, b = res[lo].get(op), res[hi].get(op)
    if not a or not b or a != a or b != b or a <= 0 or b <= 0:
        return "-"
    return f"{(b / a) ** (1 / math.log10(hi / lo)):.2f}x"


def _k(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else f"{n // 1000}k"


def print_table(res: dict, sizes) -> None:
    steps = list(zip(sizes, sizes[1:]))
    head = ["operation", *(f"{_k(n)} keys" for n in sizes),
            *(f"{_k(hi)}/{_k(lo)} per 10x" for lo, hi in steps)]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for op in OPS:
        print(" | ".join([op, *(_fmt(op, res[n].get(op, float("nan"))) for n in sizes),
                          *(_growth(res, lo, hi, op) for lo, hi in steps)]))
    big = sizes[-1]
    rss = res[big].get("controller RSS per key", float("nan"))
    rep = res[big].get("replay", float("nan"))
    print(f"targets at {big // 1000}k keys: controller RSS {rss / 1024:.2f} KiB/key "
          f"(<= 0.5: {'met' if rss <= 512 else 'MISSED'}); replay {rep:.2f} s "
          f"(<= 5 s at 1M: {'met' if rep <= 5 * big / 1e6 else 'MISSED'}, scaled to "
          f"{big // 1000}k)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000,1000000",
                   help="keys per deployment, comma-separated (default: %(default)s)")
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--durability", default="controller")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the state dirs and dumps go (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="2k and 20k keys (< 1 minute)")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    sizes = [2_000, 20_000] if a.quick else [int(s) for s in a.sizes.split(",")]
    a.dir = os.path.abspath(a.dir)
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    load0 = os.getloadavg()
    print(f"state dirs under {a.dir} ({fs_type(a.dir)}); {a.units} units; durability "
          f"{a.durability}; load average {load0[0]:.2f} on {os.cpu_count()} cpus", flush=True)
    res, t_start = {}, time.perf_counter()
    for n in sizes:
        t0 = time.perf_counter()
        res[n] = run_size(n, a)
        print(f"{n} keys: {time.perf_counter() - t0:.0f} s; "
              f"client peak RSS {proc_status()['VmHWM'] / MiB:.0f} MiB", flush=True)
    print()
    print_table(res, sizes)
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
          f"{time.perf_counter() - t_start:.0f} s in all")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"args": vars(a), "fs": fs_type(a.dir), "load": [load0, load1],
                       "results": {str(n): r for n, r in res.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
