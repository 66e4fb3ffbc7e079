#!/usr/bin/env python
"""Fixed costs of dump_data_by_key: the first dump of a process, small dumps, block=False.

    python benchmarks/small_dump.py [--units 4] [--reps 5] [--dir /dev/shm] [--quick]
                                    [--json P]

Two tables, medians of --reps:

1. Small dumps. Each repetition is a fresh process (``tq.init`` with --units units, a put of
   --rows x --cols float32 = 8 MiB by default), which times its first
   ``dump_data_by_key``, then alternates further dumps with the client-side path
   (``kv_batch_get`` + ``torch.save`` + fsync) --later times each. Reported: init, first
   dump, later dump, client-side path, and the ratios (first - later, later / client-side).
2. block=False. One process puts a rollout buffer of --mb MiB (jagged rows, about 30 per
   MiB: the ``rollout_buffer`` of get_throughput.py), then alternates a blocking dump with
   a background one (the call, then ``result()``). Reported: blocking, call, total, the
   call / blocking and total / blocking ratios, the slowest call / median call, and where
   a call's time goes on the servers (controller DESCRIBE, units' DUMP_SNAPSHOT p50).
   Table 1 gives the units' DUMP_ROWS p50 likewise (the part of a dump the units spend).

``--quick``: 200 x 1,024 rows, 32 MiB, 2 repetitions (a smoke run, not for numbers).
Dumps go to a temp dir under --dir (default /dev/shm), removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fs_type, median, rm, timed_background_dump  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--rows", type=int, default=2000, help="small dump rows (default 2000)")
    p.add_argument("--cols", type=int, default=1024, help="float32 per small row (1024)")
    p.add_argument("--later", type=int, default=4, help="later dumps per process (4)")
    p.add_argument("--mb", type=int, default=512, help="block=False buffer MiB (512)")
    p.add_argument("--skip", default="", help="comma list: small,background")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--small-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.mb, a.reps, a.later = 200, 32, 2, 2
    a.skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    return a


def _ms(x: float) -> str:
    return f"{x * 1e3:8.1f}"


# ---------------------------------------------------------------- 1. small dumps
def small_worker(a) -> dict:
    """One fresh process: init, put, first dump, then later dumps alternating with V1."""
    t0 = time.perf_counter()
    import torch
    import tqtx as tq
    from tensordict import TensorDict
    root = a.small_worker
    t_imp = time.perf_counter() - t0
    t0 = time.perf_counter()
    tq.init(config={"num_units": a.units, "state_dir": os.path.join(root, "state")})
    t_init = time.perf_counter() - t0
    keys = [f"k{i}" for i in range(a.rows)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.randn(a.rows, a.cols)},
                                          batch_size=[a.rows]))
    out = {"import": t_imp, "init": t_init, "later": [], "client": []}

    def dump(name):
        p = os.path.join(root, name)
        t = time.perf_counter()
        tq.dump_data_by_key(p, keys, "p")
        dt = time.perf_counter() - t
        rm(p)
        return dt

    def client_side(name):
        p = os.path.join(root, name)
        t = time.perf_counter()
        td = tq.kv_batch_get(keys, "p")
        with open(p, "wb") as f:
            torch.save({"keys": keys, "td": td.to_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t
        os.unlink(p)
        return dt

    out["first"] = dump("d-first")
    for i in range(a.later):
        order = (dump, client_side) if i % 2 else (client_side, dump)
        for fn in order:
            out["later" if fn is dump else "client"].append(fn(f"d{i}"))
    client = tq.get_client()
    out["unit DUMP_ROWS p50"] = max(
        client.unit(u).call("STATS", {})["ops"].get("DUMP_ROWS", {}).get("p50_ms") or 0
        for u in range(a.units)) / 1e3
    tq.close()
    return out


def small_section(a, root) -> dict:
    runs = []
    for rep in range(a.reps):
        d = tempfile.mkdtemp(dir=root, prefix="small-")
        try:
            cp = subprocess.run([sys.executable, os.path.abspath(__file__), "--small-worker", d,
                                 "--units", str(a.units), "--rows", str(a.rows), "--cols",
                                 str(a.cols), "--later", str(a.later)],
                                capture_output=True, text=True, timeout=600)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        if cp.returncode != 0:
            raise RuntimeError(f"small-dump worker failed:\n{cp.stderr[-3000:]}")
        r = json.loads(cp.stdout.strip().splitlines()[-1])
        runs.append({"init": r["init"], "first": r["first"], "later": median(r["later"]),
                     "client": median(r["client"]),
                     "unit DUMP_ROWS p50": r["unit DUMP_ROWS p50"]})
        print(f"  rep {rep + 1}/{a.reps}: first {_ms(r['first'])} ms, later "
              f"{_ms(runs[-1]['later'])} ms, client-side {_ms(runs[-1]['client'])} ms",
              file=sys.stderr)
    med = {k: median([r[k] for r in runs])
           for k in ("init", "first", "later", "client", "unit DUMP_ROWS p50")}
    med["first - later"] = median([r["first"] - r["later"] for r in runs])
    med["later / client-side"] = median([r["later"] / r["client"] for r in runs])
    return {"runs": runs, "median": med}


# ---------------------------------------------------------------- 2. block=False
def _server_p50(client, units: int) -> dict:
    ctl = client.controller.call("GET_STATS", {}).get("ops", {})
    snap = [client.unit(u).call("STATS", {}).get("ops", {}).get("DUMP_SNAPSHOT", {})
            for u in range(units)]
    return {"controller DESCRIBE p50": ctl.get("DESCRIBE_ROWS_BY_KEY", {}).get("p50_ms"),
            "unit DUMP_SNAPSHOT p50 (max over units)":
                max((s.get("p50_ms") or 0) for s in snap) if snap else None}


def background_section(a, root) -> dict:
    import tqtx as tq
    from get_throughput import rollout_buffer
    tq.init(config={"num_units": a.units, "state_dir": os.path.join(root, "bg-state")})
    try:
        keys, td, _ = rollout_buffer(a.mb)
        for lo in range(0, len(keys), 2000):
            tq.kv_batch_put(keys[lo:lo + 2000], "p", td[lo:lo + 2000])
        del td
        res = {"blocking": [], "call": [], "total": []}
        tq.dump_data_by_key(os.path.join(root, "warm"), keys, "p")  # warm-up
        rm(os.path.join(root, "warm"))

        def blocking():
            p = os.path.join(root, "bg-b")
            t = time.perf_counter()
            tq.dump_data_by_key(p, keys, "p")
            res["blocking"].append(time.perf_counter() - t)
            rm(p)

        def background():
            call, total = timed_background_dump(tq, os.path.join(root, "bg-nb"), keys, "p")
            res["call"].append(call)
            res["total"].append(total)

        for rep in range(a.reps):
            for fn in ((blocking, background) if rep % 2 == 0 else (background, blocking)):
                fn()
            print(f"  rep {rep + 1}/{a.reps}: blocking {_ms(res['blocking'][-1])} ms, call "
                  f"{_ms(res['call'][-1])} ms, total {_ms(res['total'][-1])} ms",
                  file=sys.stderr)
        med = {k: median(v) for k, v in res.items()}
        med["call / blocking"] = med["call"] / med["blocking"]
        med["total / blocking"] = med["total"] / med["blocking"]
        med["slowest call / median call"] = max(res["call"]) / med["call"]
        return {"rows": len(keys), "mb": a.mb, "all": res, "median": med,
                "servers": _server_p50(tq.get_client(), a.units)}
    finally:
        tq.close()


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    a = _parse(argv if argv is not None else sys.argv[1:])
    if a.small_worker:
        print(json.dumps(small_worker(a)))
        return 0
    os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(dir=a.dir, prefix="tqtx-small-dump-")
    out = {"units": a.units, "reps": a.reps, "dir_fs": fs_type(root),
           "load_before": os.getloadavg()}
    try:
        if "small" not in a.skip:
            print(f"small dumps: {a.rows} x {a.cols} float32 "
                  f"({a.rows * a.cols * 4 / 2**20:.1f} MiB), {a.units} units", file=sys.stderr)
            out["small"] = small_section(a, root)
        if "background" not in a.skip:
            print(f"block=False: {a.mb} MiB of jagged rows, {a.units} units", file=sys.stderr)
            out["background"] = background_section(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    print(f"\n{a.units} units, dumps on {out['dir_fs']}, medians of {a.reps}; load average "
          f"{out['load_before'][0]:.2f} before, {out['load_after'][0]:.2f} after")
    if "small" in out:
        m = out["small"]["median"]
        print(f"\n1. small dump ({a.rows} x {a.cols} float32)        ms")
        for k in ("init", "first", "later", "client", "first - later", "unit DUMP_ROWS p50"):
            label = {"first": "first dump of the process", "later": "later dump",
                     "client": "client-side (kv_batch_get + torch.save + fsync)",
                     "init": "tq.init", "unit DUMP_ROWS p50": "units' DUMP_ROWS p50 (slowest unit)"
                     }.get(k, k)
            print(f"   {label:<48}{_ms(m[k])}")
        print(f"   {'later / client-side':<48}{m['later / client-side']:8.2f}")
    if "background" in out:
        b = out["background"]
        m = b["median"]
        print(f"\n2. block=False ({b['rows']} jagged rows, {b['mb']} MiB)      ms")
        for k, label in (("blocking", "blocking dump"), ("call", "block=False call"),
                         ("total", "block=False total (call + result())")):
            print(f"   {label:<48}{_ms(m[k])}")
        for k in ("call / blocking", "total / blocking", "slowest call / median call"):
            print(f"   {k:<48}{m[k]:8.3f}")
        for k, v in b["servers"].items():
            print(f"   {k:<48}{v if v is None else f'{v:8.1f}'}")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
