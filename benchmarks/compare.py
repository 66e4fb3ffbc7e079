#!/usr/bin/env python
"""The whole comparison in one command: tqtx against a baseline tree, TransferQueue and the
floors, in one table.

    python benchmarks/compare.py [--baseline REV] [--tq-python PY] [--reps 5] [--mb 256]
                                 [--units 4] [--tiny 200] [--quick] [--json P] [--png P]

Two parts, each alternating its engines inside every repetition:

* ``get_throughput.py`` (put and get of a jagged rollout buffer and of 64 KiB rows,
  ``save_checkpoint`` / ``load_checkpoint`` of the rollout buffer, a tiny put and get), in
  two phases: tqtx, the baseline (``git archive REV``) and the in-process copy floor; then
  tqtx, TransferQueue 0.1.11 under ``--tq-python`` (left out if that interpreter cannot
  import it) and the floor. The baseline never runs beside TransferQueue: its private Ray
  keeps daemons busy on the same cores, and whichever engine runs next to them pays for it,
  by more than the 3% this comparison flags. Throughput also in Gbit/s, TransferQueue's
  unit.
* ``dump_restore.py`` (``dump_data_by_key`` / ``load_data_by_key`` of --mb MiB with the
  units doing the I/O, against one stream writing / reading the same bytes): tqtx and the
  baseline in alternating runs of one repetition each (TransferQueue has no selective dump).

Prints one table of medians: every figure, tqtx's time, the baseline's and TransferQueue's
as tqtx's speed against them, and the floor. Against the baseline the speed is the median of
the repetitions' paired ratios (tqtx and the baseline of one repetition run back to back):
this machine's speed drifts by 10-30% over minutes, which a ratio of two medians takes in
and a pair mostly does not. A figure whose paired median is more than 3% slower than the
baseline is flagged, with the spread of its pairs, and the exit status is 1 (not with
--quick, whose 3 repetitions of 32 MiB move by more than that). With matplotlib installed,
--png draws the speed-ups as a bar chart.
Everything runs in RAM file systems (/dev/shm) on this host.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import get_throughput  # noqa: E402

REGRESSION = 1.03  # a figure slower than the baseline by more than this is flagged


def baseline_tree(rev: str, where: str) -> str:
    """The package (and migrations) of ``rev`` unpacked into ``where``."""
    os.makedirs(where, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "tqtx", "migrations"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    return where


def dump_restore_runs(a, base: str | None, work: str) -> dict:
    """Alternating one-repetition runs of dump_restore.py per tree: per tree, the times of
    V2 save and restore (units) and of the floors, one per repetition."""
    trees = [("tqtx", None)] + ([("base", base)] if base else [])
    out: dict = {name: {"dump": [], "restore": [], "write floor": [], "read floor": []}
                 for name, _ in trees}
    for rep in range(a.reps):
        for name, tree in (trees if rep % 2 == 0 else trees[::-1]):
            path = os.path.join(work, f"dr-{name}-{rep}.json")
            env = dict(os.environ, TQTX_LOG_LEVEL="WARNING")
            if tree:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree,
                                                                  env.get("PYTHONPATH")]))
            subprocess.run([sys.executable, os.path.join(HERE, "dump_restore.py"),
                            "--dir", "/dev/shm" if os.path.isdir("/dev/shm") else work,
                            "--units", str(a.units), "--reps", "1", "--sizes", str(a.mb),
                            "--skip", "keys,journal", "--json", path],
                           check=True, env=env, cwd=tree or REPO, stdout=subprocess.DEVNULL)
            with open(path) as f:
                sec = json.load(f)["sizes"][f"{float(a.mb):g}"]
            out[name]["dump"].append(sec["save"]["seconds"]["V2 units"])
            out[name]["write floor"].append(sec["save"]["seconds"]["floor"])
            out[name]["restore"].append(sec["restore"]["seconds"]["V2 units"])
            out[name]["read floor"].append(sec["restore"]["seconds"]["floor"])
    return out


def paired(times: list, base: list) -> list:
    """tqtx's time over the baseline's, repetition by repetition ([] without a baseline)."""
    return [t / b for t, b in zip(times, base) if b] if base and len(base) == len(times) else []


def table(kv: dict, dr: dict) -> tuple[list[list[str]], list[str], dict]:
    """Rows of the combined table, the flagged regressions and the speed-ups (for a chart).
    ``kv``: get_throughput's results by phase (``base``, ``tq``; ``floor`` when neither ran):
    tqtx's time, the baseline's and the floor's come from the first, TransferQueue's speed
    against the tqtx of its own phase."""
    main = kv.get("base") or kv.get("tq") or kv["floor"]
    med, runs = main["median_s"], main.get("all_s", {})
    with_tq = kv.get("tq", {}).get("median_s", {})
    rows, flagged, speedups = [], [], {}
    latency = set(get_throughput.LATENCY_OPS)

    def fmt(t, op):
        return f"{t * 1e3:.3f} ms" if op in latency else f"{t:.3f} s"

    def tq_time(op):  # TransferQueue's time scaled to this table's tqtx time
        tq, mine = with_tq.get("tq", {}).get(op), with_tq.get("tqtx", {}).get(op)
        return tq * med["tqtx"][op] / mine if tq and mine else None

    figures = [(op, med["tqtx"].get(op), med.get("base", {}).get(op), tq_time(op),
                med["floor"].get(op), paired(runs.get("tqtx", {}).get(op, []),
                                             runs.get("base", {}).get(op, [])))
               for op in get_throughput.OPS]
    for op, name, floor_key in (("dump", "dump_data_by_key", "write floor"),
                                ("restore", "load_data_by_key", "read floor")):
        mine, base = dr["tqtx"][op], dr.get("base", {}).get(op)
        figures.append((name, statistics.median(mine), base and statistics.median(base), None,
                        statistics.median(dr["tqtx"][floor_key]), paired(mine, base)))
    for op, t, base, tq, floor, pairs in figures:
        # against the baseline: the median of the paired ratios (the module docstring)
        ratio = statistics.median(pairs) if pairs else (t / base if base else None)
        row = [op, fmt(t, op)]
        row.append(f"{1 / ratio:.2f}x" if ratio else "")
        row.append(f"{tq / t:.2f}x" if tq else "")
        row.append(f"{t / floor:.2f}" if floor else "")
        rows.append(row)
        speedups[op] = {"vs base": 1 / ratio if ratio else None, "vs TQ": tq / t if tq else None}
        if ratio and ratio > REGRESSION:
            spread = (f"; pairs {min(pairs):.2f}-{max(pairs):.2f}, "
                      f"{sum(r > REGRESSION for r in pairs)} of {len(pairs)} over "
                      f"{REGRESSION:.2f}" if pairs else "")
            flagged.append(f"{op}: {ratio:.3f}x the baseline's time (medians {fmt(t, op)} "
                           f"against {fmt(base, op)}{spread})")
    return rows, flagged, speedups


def chart(speedups: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ops = list(speedups)
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.4
    for i, (label, key) in enumerate((("TransferQueue", "vs TQ"), ("baseline", "vs base"))):
        vals = [speedups[op][key] or 0 for op in ops]
        ax.bar([x + i * width for x in range(len(ops))], vals, width, label=f"tqtx vs {label}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width / 2 for x in range(len(ops))], ops, rotation=30, ha="right")
    ax.set_ylabel("tqtx speed / other (x)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", metavar="REV", help="a git revision of this repository")
    p.add_argument("--tq-python", default=os.environ.get("TQ_PYTHON",
                                                         get_throughput.DEFAULT_TQ_PYTHON))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--tiny", type=int, default=200)
    p.add_argument("--quick", action="store_true",
                   help="32 MiB, 3 reps, 50 tiny ops: checks the script runs; too small and "
                        "too few for the 3%% flag, which it prints but does not judge by")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--png")
    a = p.parse_args(argv)
    if a.quick:
        a.mb, a.reps, a.tiny = 32, 3, 50
    work = tempfile.mkdtemp(prefix="tqtx-compare-")
    try:
        base = baseline_tree(a.baseline, os.path.join(work, "base")) if a.baseline else None
        tq_note = get_throughput.tq_missing(a.tq_python)
        common = ["--units", str(a.units), "--mb", str(a.mb), "--reps", str(a.reps),
                  "--tiny", str(a.tiny), "--warmup", "1" if a.quick else "2"]
        phases = {}  # get_throughput's arguments per phase (see the module docstring)
        if base:
            phases["base"] = common + ["--no-tq", "--baseline", base]
        if tq_note is None:
            phases["tq"] = common + ["--tq-python", a.tq_python]
        if not phases:
            phases["floor"] = common + ["--no-tq"]
        kv = {}
        for name, args in phases.items():
            path = os.path.join(work, f"kv-{name}.json")
            get_throughput.main(args + ["--json", path])
            with open(path) as f:
                kv[name] = json.load(f)
        dr = dump_restore_runs(a, base, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, flagged, speedups = table(kv, dr)
    head = ["figure", "tqtx", "tqtx speed / baseline", "tqtx speed / TQ", "x floor"]
    print()
    print(f"tqtx against {'baseline ' + a.baseline if a.baseline else 'no baseline'}"
          f"{'' if tq_note is None else '; ' + tq_note}; {a.units} units, "
          f"{a.mb} MiB, median of {a.reps}; against the baseline: the median of the "
          f"repetitions' paired ratios")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for row in rows:
        print(" | ".join(row))
    for line in flagged:
        print(f"SLOWER than the baseline by more than {REGRESSION - 1:.0%}"
              f"{' (--quick: no verdict)' if a.quick else ''}: {line}")
    if a.png:
        print(f"chart: {a.png}" if chart(speedups, a.png) else "no chart: matplotlib missing")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"kv": kv, "dump_restore": dr, "flagged": flagged,
                       "speedups": speedups}, f, indent=2)
    return 1 if flagged and not a.quick else 0


if __name__ == "__main__":
    sys.exit(main())
