#!/usr/bin/env python
"""Dump/restore benchmark: V1 (kv_batch_get + torch.save) vs tqtx dump/restore vs the disk.

Everything runs in one process against one embedded deployment, on the same data, with
the variants alternating inside every repetition (the order rotates per repetition) and
the median reported. docs/performance.md, *What is measured*, says what each variant
does; *How to reproduce* gives the command lines of its figures. ``tqtx bench`` runs this
file (from a source checkout).

    python benchmarks/dump_restore.py                 # default: 64 and 256 MiB, 1k/10k keys
    python benchmarks/dump_restore.py --dir /dev/shm/tqtx-bench --json shm.json
    python benchmarks/dump_restore.py --dir /work/bench-tmp --sizes 64,256,1024 \\
        --key-counts 1000,10000,100000 --json disk.json
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
    MiB, PeakRSS, drop_cache, files_of, fs_type, median, reset_peak, rm, timed_background_dump,
)
from baselines import floor_read, floor_read_kept, floor_write, v1_restore, v1_save  # noqa: E402
from journal_micro import controller_journal_micro, dump_journal_micro  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(prog="tqtx bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None,
                   help="where dumps/files go (a temp subdir is created there and removed); "
                        "default: a temp dir under the current directory")
    p.add_argument("--units", type=int, default=4, help="storage units (default 4)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per variant (>= 3)")
    p.add_argument("--sizes", default="64,256",
                   help="buffer sizes in MiB for the A/B comparison (default 64,256)")
    p.add_argument("--key-counts", default="1000,10000",
                   help="small-key counts for the per-key scaling (default 1000,10000)")
    p.add_argument("--row-kb", type=int, default=256,
                   help="row size in KiB of the big-buffer data (default 256)")
    p.add_argument("--skip", default="",
                   help="comma list of sections to skip: save,restore,keys,journal")
    p.add_argument("--json", dest="json_path", default=None, help="also write results here")
    p.add_argument("--keep-files", action="store_true", help="do not delete the bench dir")
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error("--reps must be >= 1")
    a.sizes = [float(x) for x in a.sizes.split(",") if x.strip()]
    a.key_counts = [int(x) for x in a.key_counts.split(",") if x.strip()]
    a.skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    return a



# ---------------------------------------------------------------- data
def _fill_big(tq, pid: str, size_mib: float, row_kb: int) -> list[str]:
    import torch
    from tensordict import TensorDict
    per_row = row_kb * 1024 // 4
    n = max(1, int(size_mib * MiB) // (row_kb * 1024))
    keys = [f"{pid}-{i:07d}" for i in range(n)]
    step = max(1, (64 * MiB) // (row_kb * 1024))
    g = torch.Generator().manual_seed(n)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        td = TensorDict({"x": torch.rand(hi - lo, per_row, generator=g),
                         "reward": torch.rand(hi - lo, generator=g)}, batch_size=[hi - lo])
        tq.kv_batch_put(keys[lo:hi], pid, td,
                        tags=[{"step": i, "status": "running"} for i in range(lo, hi)])
    return keys


def _fill_small(tq, pid: str, count: int) -> list[str]:
    import torch
    from tensordict import TensorDict
    keys = [f"{pid}-{i:07d}" for i in range(count)]
    for lo in range(0, count, 10_000):
        hi = min(count, lo + 10_000)
        td = TensorDict({"obs": torch.rand(hi - lo, 8),
                         "reward": torch.rand(hi - lo)}, batch_size=[hi - lo])
        tq.kv_batch_put(keys[lo:hi], pid, td, tags=[{"step": i} for i in range(lo, hi)])
    return keys


# ---------------------------------------------------------------- runner
class Bench:
    def __init__(self, args, tq, cfg, root, con):
        self.a, self.tq, self.cfg, self.root, self.con = args, tq, cfg, root, con
        self.unit_pids = [p for n, p in cfg["pids"].items() if n.startswith("unit")]
        self.n = 0

    def path(self, stem):
        self.n += 1
        return os.path.join(self.root, f"{stem}-{self.n}")

    def log(self, msg):
        self.con.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")

    # ---------------- save
    def save_section(self, pid, keys, label) -> dict:
        tq, reps = self.tq, self.a.reps
        res = {v: [] for v in ("V1", "V2 units", "V2 client", "V2 block=False call",
                               "V2 block=False total", "floor")}
        mem = {v: [] for v in ("V1", "V2 units", "V2 client")}
        nbytes = {}

        def run_v1():
            p = self.path("v1.pt")
            with PeakRSS(["self"]) as m:
                t0 = time.perf_counter()
                nbytes["V1"] = v1_save(tq, keys, pid, p)
                dt = time.perf_counter() - t0
            res["V1"].append(dt)
            mem["V1"].append(m.total)
            rm(p)

        def run_v2(via):
            def f():
                p = self.path(f"v2{via[0]}")
                with PeakRSS(["self"]) as m:
                    t0 = time.perf_counter()
                    r = tq.dump_data_by_key(p, keys, pid, via=via)
                    dt = time.perf_counter() - t0
                res[f"V2 {via}"].append(dt)
                mem[f"V2 {via}"].append(m.total)
                nbytes[f"V2 {via}"] = r["bytes"]
                rm(p)
            return f

        def run_nb():
            call, total = timed_background_dump(tq, self.path("v2nb"), keys, pid)
            res["V2 block=False call"].append(call)
            res["V2 block=False total"].append(total)

        def run_floor():
            p = self.path("floor.bin")
            res["floor"].append(floor_write(p, nbytes.get("V2 units") or nbytes.get("V1")))
            rm(p)

        run_v2("units")()  # warm-up, also gives the byte count for the floor
        for k in res:
            res[k].clear()
        for k in mem:
            mem[k].clear()
        variants = [run_v1, run_v2("units"), run_v2("client"), run_nb, run_floor]
        for rep in range(reps):
            for i in range(len(variants)):
                variants[(i + rep) % len(variants)]()
            self.log(f"{label} save rep {rep + 1}/{reps}: " + ", ".join(
                f"{k} {v[-1]:.3f}s" for k, v in res.items() if v))
        b = nbytes["V2 units"]
        out = {"bytes": b, "v1_bytes": nbytes["V1"], "seconds": {k: median(v) for k, v in res.items()},
               "all": res, "client_peak_rss_growth": {k: max(v) for k, v in mem.items()}}
        s = out["seconds"]
        out["gbps"] = {k: (nbytes.get(k, b) / v / 1e9) for k, v in s.items()}
        out["ratios"] = {
            "V1/V2": s["V1"] / s["V2 units"],
            "V2/floor": s["V2 units"] / s["floor"],
            "V2client/floor": s["V2 client"] / s["floor"],
            "nonblocking call/blocking": s["V2 block=False call"] / s["V2 units"],
            "nonblocking total/blocking": s["V2 block=False total"] / s["V2 units"],
            "client RSS growth/bytes (V2 units)": out["client_peak_rss_growth"]["V2 units"] / b,
        }
        return out

    # ---------------- restore
    def restore_section(self, pid, keys, label) -> dict:
        tq, reps = self.tq, self.a.reps
        src_v2 = self.path("restore-src")
        src_v1 = self.path("restore-src.pt")
        tq.dump_data_by_key(src_v2, keys, pid)
        v1_bytes = v1_save(tq, keys, pid, src_v1)
        files = files_of(src_v2)
        res = {v: [] for v in ("V1", "V2 units", "V2 client", "floor", "kept floor")}
        cmem = {v: [] for v in ("V1", "V2 units", "V2 client")}
        umem = {v: [] for v in ("V1", "V2 units", "V2 client")}
        nbytes = {"V1": v1_bytes}

        def clear():
            tq.kv_clear(keys, pid)

        def timed(name, fn):
            clear()
            drop_cache(src_v1, src_v2)
            with PeakRSS(["self"]) as cm, PeakRSS(self.unit_pids) as um:
                t0 = time.perf_counter()
                r = fn()
                dt = time.perf_counter() - t0
            res[name].append(dt)
            cmem[name].append(cm.total)
            umem[name].append(um.total)
            return r

        def run_v1():
            timed("V1", lambda: v1_restore(tq, pid, src_v1))

        def run_v2(via):
            def f():
                r = timed(f"V2 {via}", lambda: tq.load_data_by_key(src_v2, via=via))
                nbytes[f"V2 {via}"] = r["bytes"]
            return f

        def run_floor():
            drop_cache(src_v2)
            dt, n = floor_read(files)
            res["floor"].append(dt)
            nbytes["floor"] = n

        def run_kept_floor():
            drop_cache(src_v2)
            dt, _ = floor_read_kept(src_v2)
            res["kept floor"].append(dt)

        variants = [run_v1, run_v2("units"), run_v2("client"), run_floor, run_kept_floor]
        for rep in range(reps):
            for i in range(len(variants)):
                variants[(i + rep) % len(variants)]()
            self.log(f"{label} restore rep {rep + 1}/{reps}: " + ", ".join(
                f"{k} {v[-1]:.3f}s" for k, v in res.items() if v))
        # leave the partition complete
        if len(tq.kv_list(pid).get(pid, {})) != len(keys):
            clear()
            tq.load_data_by_key(src_v2)
        rm(src_v2)
        rm(src_v1)
        b = nbytes["V2 units"]
        s = {k: median(v) for k, v in res.items()}
        out = {"bytes": b, "v1_bytes": v1_bytes, "floor_bytes": nbytes["floor"], "seconds": s,
               "all": res, "client_peak_rss_growth": {k: max(v) for k, v in cmem.items()},
               "units_peak_rss_growth": {k: max(v) for k, v in umem.items()}}
        out["gbps"] = {k: nbytes.get(k, b) / v / 1e9 for k, v in s.items()}
        out["ratios"] = {
            "V2/V1 throughput": out["gbps"]["V2 units"] / out["gbps"]["V1"],
            "V2/floor": s["V2 units"] / s["floor"],
            "V2client/floor": s["V2 client"] / s["floor"],
            "V2/kept floor": s["V2 units"] / s["kept floor"],
            "units RSS growth/bytes (V2 units)": out["units_peak_rss_growth"]["V2 units"] / b,
            "client RSS growth/bytes (V2 units)": out["client_peak_rss_growth"]["V2 units"] / b,
        }
        return out

    # ---------------- small keys
    def keys_section(self, count, journal: bool) -> dict:
        tq, reps = self.tq, self.a.reps
        pid = f"keys{count}"
        t0 = time.perf_counter()
        keys = _fill_small(tq, pid, count)
        self.log(f"{count} small keys put in {time.perf_counter() - t0:.1f}s")
        dump_t, rest_t, nbytes = [], [], 0
        src = self.path(f"keys{count}")
        tq.dump_data_by_key(src, keys, pid)  # the restore source (untimed)
        for rep in range(reps):
            p = self.path(f"keys{count}-dump")
            t0 = time.perf_counter()
            r = tq.dump_data_by_key(p, keys, pid)
            dump_t.append(time.perf_counter() - t0)
            nbytes = r["bytes"]
            rm(p)
            tq.kv_clear(keys, pid)
            drop_cache(src)
            t0 = time.perf_counter()
            tq.load_data_by_key(src)
            rest_t.append(time.perf_counter() - t0)
            self.log(f"{count} keys rep {rep + 1}/{reps}: dump {dump_t[-1]:.3f}s, "
                     f"restore {rest_t[-1]:.3f}s")
        rm(src)
        tq.kv_clear(keys, pid)
        out = {"keys": count, "bytes": nbytes, "dump_seconds": median(dump_t),
               "restore_seconds": median(rest_t), "all_dump": dump_t, "all_restore": rest_t}
        out["dump_us_per_key"] = out["dump_seconds"] / count * 1e6
        out["restore_us_per_key"] = out["restore_seconds"] / count * 1e6
        if journal:
            # the journals' work replayed beside this run's dumps (the same file system)
            dj = dump_journal_micro(self.path("dump-journal-micro"))
            cj = controller_journal_micro(self.path("journal-micro"), self.a.units)
            jd = dj["dump_seconds"] + cj["dump_seconds"]
            jr = dj["restore_seconds"] + cj["restore_seconds"]
            out["journal"] = {
                "client_dump_journal_seconds": dj["dump_seconds"],
                "client_restore_journal_seconds": dj["restore_seconds"],
                "controller_micro": cj,
                "dump_journal_seconds": jd, "restore_journal_seconds": jr,
                "dump_share": jd / out["dump_seconds"],
                "restore_share": jr / out["restore_seconds"],
            }
        return out


# ---------------------------------------------------------------- output
def _tables(results, con):
    from rich.table import Table

    def f3(x):
        return f"{x:.3f}"

    for sz, sec in results["sizes"].items():
        if "save" in sec:
            s = sec["save"]
            t = Table(title=f"save {sz} MiB ({s['bytes']:,} B, {results['fs']})")
            for c in ("variant", "median s", "GB/s", "x V2 units", "client peak RSS MiB"):
                t.add_column(c, justify="right" if c != "variant" else "left")
            for k, v in s["seconds"].items():
                rss = s["client_peak_rss_growth"].get(k)
                t.add_row(k, f3(v), f"{s['gbps'][k]:.2f}", f"{v / s['seconds']['V2 units']:.2f}",
                          f"{rss / MiB:.1f}" if rss is not None else "")
            con.print(t)
            con.print("  ratios: " + ", ".join(f"{k} = {v:.3f}" for k, v in s["ratios"].items()))
        if "restore" in sec:
            s = sec["restore"]
            t = Table(title=f"restore {sz} MiB ({s['bytes']:,} B, {results['fs']})")
            for c in ("variant", "median s", "GB/s", "x V2 units", "client peak RSS MiB",
                      "units peak RSS MiB"):
                t.add_column(c, justify="right" if c != "variant" else "left")
            for k, v in s["seconds"].items():
                rss = s["client_peak_rss_growth"].get(k)
                urss = s["units_peak_rss_growth"].get(k)
                t.add_row(k, f3(v), f"{s['gbps'][k]:.2f}", f"{v / s['seconds']['V2 units']:.2f}",
                          f"{rss / MiB:.1f}" if rss is not None else "",
                          f"{urss / MiB:.1f}" if urss is not None else "")
            con.print(t)
            con.print("  ratios: " + ", ".join(f"{k} = {v:.3f}" for k, v in s["ratios"].items()))
    if results["keys"]:
        t = Table(title=f"small keys (V2 units, {results['fs']})")
        for c in ("keys", "bytes", "dump s", "dump µs/key", "restore s", "restore µs/key"):
            t.add_column(c, justify="right")
        for r in results["keys"].values():
            t.add_row(f"{r['keys']:,}", f"{r['bytes']:,}", f"{r['dump_seconds']:.3f}",
                      f"{r['dump_us_per_key']:.1f}", f"{r['restore_seconds']:.3f}",
                      f"{r['restore_us_per_key']:.1f}")
        con.print(t)
        for r in results["keys"].values():
            j = r.get("journal")
            if j:
                con.print(f"  journal at {r['keys']:,} keys: dump {j['dump_journal_seconds'] * 1e3:.1f} ms "
                          f"({j['dump_share']:.1%} of the dump), restore "
                          f"{j['restore_journal_seconds'] * 1e3:.1f} ms ({j['restore_share']:.1%})")


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    from tqtx.demo.console import quiet_console
    quiet_console()
    from rich.console import Console

    import tqtx as tq

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    base = args.dir or os.getcwd()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="tqtx-bench-", dir=base)
    results = {"config": {k: (sorted(v) if isinstance(v, set) else v)
                          for k, v in vars(args).items()},
               "dir": root, "fs": fs_type(root), "cpus": os.cpu_count(),
               "clear_refs": reset_peak("self"), "sizes": {}, "keys": {}}
    con.print(f"tqtx bench: dir {root} ({results['fs']}), {args.units} units, "
              f"{args.reps} reps, sizes {args.sizes} MiB, key counts {args.key_counts}")
    try:
        cfg = tq.init({"num_units": args.units, "state_dir": os.path.join(root, "state")})
        b = Bench(args, tq, cfg, root, con)
        for size in args.sizes:
            pid = f"big{size:g}"
            t0 = time.perf_counter()
            keys = _fill_big(tq, pid, size, args.row_kb)
            b.log(f"{size:g} MiB: {len(keys)} rows put in {time.perf_counter() - t0:.1f}s")
            sec = results["sizes"][f"{size:g}"] = {"rows": len(keys)}
            if "save" not in args.skip:
                sec["save"] = b.save_section(pid, keys, f"{size:g} MiB")
            if "restore" not in args.skip:
                sec["restore"] = b.restore_section(pid, keys, f"{size:g} MiB")
            tq.kv_clear(keys, pid)
        if "keys" not in args.skip:
            jcount = min(args.key_counts, key=lambda c: abs(c - 10_000)) if args.key_counts else 0
            for count in args.key_counts:
                results["keys"][str(count)] = b.keys_section(
                    count, journal=("journal" not in args.skip and count == jcount))
        if len(results["keys"]) >= 2:
            ks = sorted(results["keys"].values(), key=lambda r: r["keys"])
            hi, lo = ks[-1], ks[-2]
            results["key_scaling"] = {
                "from": lo["keys"], "to": hi["keys"],
                "dump_per_key_ratio": hi["dump_us_per_key"] / lo["dump_us_per_key"],
                "restore_per_key_ratio": hi["restore_us_per_key"] / lo["restore_us_per_key"]}
    finally:
        tq.close()
        if not args.keep_files:
            shutil.rmtree(root, ignore_errors=True)
    _tables(results, con)
    if "key_scaling" in results:
        ks = results["key_scaling"]
        con.print(f"per-key cost {ks['to']:,} vs {ks['from']:,} keys: dump x"
                  f"{ks['dump_per_key_ratio']:.2f}, restore x{ks['restore_per_key_ratio']:.2f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
        con.print(f"results written to {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
