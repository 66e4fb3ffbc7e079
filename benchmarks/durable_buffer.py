#!/usr/bin/env python
"""What the row log (durability "buffer" and "sync") costs and what it buys back.

    python benchmarks/durable_buffer.py [--units 2] [--writers 8] [--seconds 5] [--batch 8]
                                        [--ckpt-mb 256] [--reps 5] [--churn-live-mb 128]
                                        [--churn-seconds 30] [--keys 50000]
                                        [--key-bytes 21000] [--fsync-delay-ms MS] [--dir DIR]
                                        [--quick] [--json P]
                                        [--only writers,checkpoint,churn,recovery]

On disk (--dir, default the temp dir), each figure in one run against its baseline:

* ``sync writers``: small trajectories (8 float32 fields, 16 KiB a row, one row per put)
  put for --seconds by 1 writer process, then by --writers processes at once, against one
  ``sync`` deployment: rows/s of each, their ratio (target: 8 writers >= 4x one: the
  puts share fsyncs) and the per-process rate (target: >= 3,000/s); then 1 writer putting
  --batch trajectories a put (a rollout worker's batch); and the median latency of a tiny
  ``kv_put`` (one key, 8 int64) from this process. The same with ``controller`` (no fsync)
  is the baseline. --fsync-delay-ms MS stands in for a slower disk: every fsync of a row
  log and of the controller's journal waits MS more first (the fault points
  ``unit.rowlog.before_fsync`` and ``controller.meta.durable_cut.before_fsync``, action
  ``delay``; a sleep, like an fsync, blocks the loop that called it and releases the GIL).
  This machine's disk fsyncs a small append in about 0.15 ms; network block devices take
  1-5 ms, where sharing fsyncs matters most.
* ``fsync``: the median of 200 fsyncs of a 4 KiB append on the same disk (the floor a
  ``sync`` put pays; a tiny put targets one fsync + 0.3 ms, see benchmarks/durability.py).
* ``checkpoint``: a --ckpt-mb MiB buffer (64 KiB rows) put once; ``save_checkpoint`` and
  ``load_checkpoint`` with ``controller`` (the units write their rows) against ``buffer``
  (the units link their row log's files; target: save <= 20% of ``controller``'s), the log
  given time to catch up before each save (a training step between checkpoints).
* ``churn``: 4 writer threads put 64 KiB rows and clear them again (each keeps its last
  --churn-live-mb / 4 MiB) for --churn-seconds with ``buffer``; the row logs' bytes on disk
  against the live bytes, sampled every 0.2 s after the first quarter (median and max;
  target: at most 1.5x), then everything cleared: seconds until the logs hold <= 64 MiB.
* ``recovery``: --keys keys of --key-bytes each (default 50,000 x 21 KB = 1 GiB) put with
  ``buffer``, every process SIGKILLed, then a new ``tq.init`` on the state dir: seconds
  until it serves (``init`` returned and every unit registered with its rows back in
  memory; target <= 2 s); the slowest unit's replay of its log (the units replay in
  parallel), which is when everything is readable, against the disk read floor (one
  stream reading the row log files with a cold page cache; target <= 1.5x); until every
  key was also read back through ``kv_batch_get`` from ``init`` on (the processes' start
  and the 1 GiB get included); and the controller's reconciliation of a unit's report
  (its log; target <= 0.2 s).

--quick: small sizes, finishes in about a minute.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import drop_cache, median  # noqa: E402

FIELDS = 8
FIELD_FLOATS = 512  # 8 x 512 x 4 bytes = 16 KiB a row


def _writer(address: str, seconds: float, start, out, wid: str, batch: int = 1) -> None:
    import torch
    from tensordict import TensorDict

    import tqtx as tq
    tq.init(address=address, config={"timeout": 60})
    rows = TensorDict({f"f{j}": torch.rand(batch, FIELD_FLOATS) for j in range(FIELDS)},
                      batch_size=[batch])
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tq.kv_batch_put([f"{wid}-{n}-{i}" for i in range(batch)], "traj", rows)
        n += 1
    out.put(n * batch / (time.perf_counter() - t0))
    tq.close()


_RUNS = itertools.count()


def _writers(address: str, count: int, seconds: float, batch: int = 1) -> float:
    """Rows/s of ``count`` writer processes together; every run puts new keys (a put of a
    key that exists takes another round trip)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    run = next(_RUNS)
    procs = [ctx.Process(target=_writer, args=(address, seconds, start, out, f"r{run}w{w}",
                                               batch)) for w in range(count)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # every writer attached and imported torch
    start.set()
    rates = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    return sum(rates)


FSYNC_POINTS = ("unit.rowlog.before_fsync", "controller.meta.durable_cut.before_fsync")


def _tiny_put_ms(count: int = 300) -> float:
    """Median latency of ``count`` tiny ``kv_put`` calls of new keys from this process."""
    import torch
    from tensordict import TensorDict

    import tqtx as tq
    row = TensorDict({"x": torch.arange(8).reshape(1, 8)}, batch_size=[1])
    times = []
    for i in range(count + 20):
        t0 = time.perf_counter()
        tq.kv_put(f"tiny-{i}", "tiny", row)
        times.append(time.perf_counter() - t0)
    return median(times[20:]) * 1e3


def sync_writers(args, root: str) -> dict:
    import tqtx as tq
    res = {}
    env = {}  # the servers' environment: the fault points that delay each fsync
    if args.fsync_delay_ms:
        delay = args.fsync_delay_ms / 1e3
        env["TQTX_FAULTS"] = ",".join(f"{p}:delay:{delay}" for p in FSYNC_POINTS)
    for setting in ("controller", "sync"):
        state = os.path.join(root, f"writers-{setting}")
        tq.init({"num_units": args.units, "state_dir": state, "durability": setting,
                 "env": env})
        address = tq.get_client().address
        one = _writers(address, 1, args.seconds)
        many = _writers(address, args.writers, args.seconds)
        batched = _writers(address, 1, args.seconds, args.batch)
        tiny = _tiny_put_ms()
        tq.close()
        shutil.rmtree(state, ignore_errors=True)
        res[setting] = {"1 writer rows/s": one, f"{args.writers} writers rows/s": many,
                        "ratio": many / one, "per process rows/s": many / args.writers,
                        f"1 writer, {args.batch} a put, rows/s": batched,
                        "tiny put ms": tiny}
    return res


def fsync_floor(root: str) -> float:
    path = os.path.join(root, "fsync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(200):
            os.write(fd, b"x" * 4096)
            t0 = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return median(times)


def checkpoints(args, root: str) -> dict:
    import torch
    from tensordict import TensorDict

    import tqtx as tq
    rows = max(1, args.ckpt_mb * 16)  # 64 KiB rows
    keys = [f"k{i}" for i in range(rows)]
    data = TensorDict({"x": torch.rand(rows, 16384)}, batch_size=[rows])
    out = {}
    for setting in ("controller", "buffer"):
        state = os.path.join(root, f"ckpt-state-{setting}")
        tq.init({"num_units": args.units, "state_dir": state, "durability": setting})
        tq.kv_batch_put(keys, "p", data)
        saves, loads = [], []
        for rep in range(args.reps):
            time.sleep(2.0)  # the row log catches up, as during a training step
            ckpt = os.path.join(root, f"ckpt-{setting}-{rep}")
            t0 = time.perf_counter()
            tq.save_checkpoint(ckpt)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tq.load_checkpoint(ckpt)
            loads.append(time.perf_counter() - t0)
            shutil.rmtree(ckpt, ignore_errors=True)
        tq.close()
        shutil.rmtree(state, ignore_errors=True)
        out[setting] = {"save s": median(saves), "load s": median(loads)}
    out["save buffer / controller"] = out["buffer"]["save s"] / out["controller"]["save s"]
    out["load buffer / controller"] = out["buffer"]["load s"] / out["controller"]["load s"]
    return out


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def churn(args, root: str) -> dict:
    import threading

    import torch
    from tensordict import TensorDict

    import tqtx as tq
    state = os.path.join(root, "churn")
    tq.init({"num_units": args.units, "state_dir": state, "durability": "buffer"})
    units = os.path.join(state, "units")
    keep = max(1, args.churn_live_mb * 16 // 4)  # rows kept per writer (64 KiB each)
    stop = threading.Event()

    def writer(w: int) -> None:
        n = 0
        row = TensorDict({"x": torch.rand(1, 16384)}, batch_size=[1])
        while not stop.is_set():
            tq.kv_batch_put([f"w{w}-{n}"], "churn", row)
            if n >= keep:
                tq.kv_clear([f"w{w}-{n - keep}"], "churn")
            n += 1

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    client = tq.get_client()
    ratios, t0 = [], time.monotonic()
    while time.monotonic() - t0 < args.churn_seconds:
        time.sleep(0.2)
        live = sum(u["bytes"] for u in client.stats()["units"])
        if time.monotonic() - t0 > args.churn_seconds / 4 and live:
            ratios.append(_dir_bytes(units) / live)
    stop.set()
    for t in threads:
        t.join(60)
    tq.kv_clear(list(tq.kv_list("churn").get("churn", {})), "churn")
    t1 = time.monotonic()
    while _dir_bytes(units) > 64 << 20 and time.monotonic() - t1 < 120:
        time.sleep(0.2)
    settled = time.monotonic() - t1
    left = _dir_bytes(units)
    tq.close()
    shutil.rmtree(state, ignore_errors=True)
    ratios.sort()
    return {"disk / live median": ratios[len(ratios) // 2] if ratios else None,
            "disk / live max": ratios[-1] if ratios else None, "samples": len(ratios),
            "after clearing all: s to <= 64 MiB": settled, "bytes left": left}


def recovery(args, root: str) -> dict:
    import torch
    from tensordict import TensorDict

    import tqtx as tq
    from tqtx import api
    state = os.path.join(root, "recovery")
    cfg = {"num_units": args.units, "state_dir": state, "durability": "buffer"}
    tq.init(cfg)
    cols = max(1, args.key_bytes // 4)
    keys = [f"k{i}" for i in range(args.keys)]
    batch = 1000
    for lo in range(0, args.keys, batch):
        part = keys[lo:lo + batch]
        tq.kv_batch_put(part, "p", TensorDict({"x": torch.rand(len(part), cols)},
                                              batch_size=[len(part)]))
    time.sleep(1.5)  # one flush interval: everything fsynced
    api._deployment.stop(graceful=False)   # SIGKILL every process
    api._client.close()
    api._client = api._deployment = api._config = None
    units = os.path.join(state, "units")
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(units)
                 for f in fs)
    drop_cache(units)
    t0 = time.perf_counter()
    for d, _, fs in os.walk(units):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(8 << 20):
                    pass
    floor = time.perf_counter() - t0
    drop_cache(units)
    t0 = time.perf_counter()
    tq.init(cfg)
    client = tq.get_client()
    while not client.controller.call("TOPOLOGY")["ready"]:
        time.sleep(0.005)
    serving = time.perf_counter() - t0
    for lo in range(0, args.keys, batch):
        tq.kv_batch_get(keys[lo:lo + batch], "p")
    readable = time.perf_counter() - t0
    listed = sum(len(v) for v in tq.kv_list().values())
    tq.close()
    from tqtx.layout.paths import process_log
    with open(process_log(state, "controller")) as f:   # a line per unit
        text = f.read()
    reconciled = [float(m) for m in re.findall(r"reconciled in ([0-9.]+)s", text)]
    replayed = [float(m) for m in re.findall(r"log entries \([0-9]+ bytes, ([0-9.]+)s\)", text)]
    replay = max(replayed, default=None)
    shutil.rmtree(state, ignore_errors=True)
    return {"keys": args.keys, "log bytes": nbytes, "listed after": listed,
            "disk read floor s": floor, "serving s": serving,
            "replay s (slowest unit)": replay,
            "replay / floor": replay / floor if floor and replay else None,
            "all read back s": readable,
            "read back / floor": readable / floor if floor else None,
            "reconciliation s (slowest unit)": max(reconciled, default=None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", type=int, default=2)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--key-bytes", type=int, default=21_000)
    ap.add_argument("--ckpt-mb", type=int, default=256)
    ap.add_argument("--churn-live-mb", type=int, default=128)
    ap.add_argument("--churn-seconds", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fsync-delay-ms", type=float, default=0.0,
                    help="writers: every fsync of the servers waits this much more")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="writers,checkpoint,churn,recovery",
                    help="the figures to run, comma-separated")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.quick:
        args.seconds, args.keys, args.key_bytes = 2.0, 5_000, 4_000
        args.ckpt_mb, args.reps = 32, 2
        args.churn_live_mb, args.churn_seconds = 16, 6.0
    root = tempfile.mkdtemp(prefix="tqtx-durable-", dir=args.dir)
    try:
        out = {"fsync s": fsync_floor(root)}
        for name, run in (("writers", sync_writers), ("checkpoint", checkpoints),
                          ("churn", churn), ("recovery", recovery)):
            if name in only:
                out[name] = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"fsync of a 4 KiB append (median): {out['fsync s'] * 1e3:.3f} ms"
          + (f"; the servers' fsyncs wait {args.fsync_delay_ms:g} ms more"
             if args.fsync_delay_ms and "writers" in only else ""))
    for setting, r in out.get("writers", {}).items():
        print(f"{setting:10s} 1 writer {r['1 writer rows/s']:8.0f} rows/s   {args.writers} "
              f"writers {r[f'{args.writers} writers rows/s']:8.0f} rows/s   ratio "
              f"{r['ratio']:.2f}   per process {r['per process rows/s']:.0f} rows/s   1 "
              f"writer, {args.batch} a put, {r[f'1 writer, {args.batch} a put, rows/s']:.0f} "
              f"rows/s   tiny put {r['tiny put ms']:.2f} ms")
    c = out.get("checkpoint")
    c and print(f"checkpoint of {args.ckpt_mb} MiB: save {c['controller']['save s']:.3f} s "
          f"(controller) / {c['buffer']['save s']:.3f} s (buffer) = "
          f"{c['save buffer / controller']:.3f}; load {c['controller']['load s']:.3f} / "
          f"{c['buffer']['load s']:.3f} s = {c['load buffer / controller']:.2f}")
    c = out.get("churn")
    c and print(f"churn ({args.churn_live_mb} MiB live): row log bytes / live bytes median "
          f"{c['disk / live median']:.2f}, max {c['disk / live max']:.2f} "
          f"({c['samples']} samples); cleared: <= 64 MiB after "
          f"{c['after clearing all: s to <= 64 MiB']:.1f} s ({c['bytes left']} bytes left)")
    r = out.get("recovery")
    r and print(f"recovery of {r['keys']} keys ({r['log bytes'] / 2**20:.0f} MiB of row log): "
          f"serving in {r['serving s']:.2f} s; the slowest unit's replay "
          f"{r['replay s (slowest unit)']:.2f} s ({r['replay / floor']:.2f}x the cold read "
          f"of the log files, {r['disk read floor s']:.2f} s); every key read back "
          f"{r['all read back s']:.2f} s after init began ({r['read back / floor']:.2f}x); "
          f"{r['listed after']} keys listed; the controller's reconciliation of the slowest "
          f"unit {r['reconciliation s (slowest unit)']}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
