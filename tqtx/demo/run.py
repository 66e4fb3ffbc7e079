"""The demo's scenario: fill, mark finished, dump, restart on another topology, restore, verify."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from ..states import COMMITTED
from .checks import read_journals, verify, verify_global
from .console import quiet_console
from .data import PARTITION, make_buffer, payload_bytes, tensordict_of
from .report import print_journals, print_next_steps, print_timings, print_verdict


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tqtx demo",
        description="Put a partial-rollout buffer, dump the unfinished samples, restart on "
                    "another topology, restore and verify every value.")
    p.add_argument("--samples", type=int, default=2000, help="number of samples (default 2000)")
    p.add_argument("--mb", type=float, default=64.0,
                   help="approximate total payload in MiB (default 64)")
    p.add_argument("--units-before", type=int, default=4, help="units while filling (default 4)")
    p.add_argument("--units-after", type=int, default=2, help="units when restoring (default 2)")
    p.add_argument("--finished-fraction", type=float, default=0.4,
                   help="fraction of samples marked finished (default 0.4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="write the dump to DIR and leave it there (plus DIR.demo-state/ with "
                        "both controller state dirs); default: a temp dir, removed at the end")
    a = p.parse_args(argv)
    if a.samples < 2:
        p.error("--samples must be >= 2")
    if a.mb <= 0:
        p.error("--mb must be > 0")
    if a.units_before < 1 or a.units_after < 1:
        p.error("--units-before/--units-after must be >= 1")
    if not 0.0 < a.finished_fraction < 1.0:
        p.error("--finished-fraction must be in (0, 1)")
    return a


def main(argv: list[str] | None = None) -> int:
    """``tqtx demo [options]``; returns the exit code (0 only when the verification passed)."""
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    quiet_console()
    from rich.console import Console

    con = Console(highlight=False)
    try:
        return _run(args, con)
    except KeyboardInterrupt:
        con.print("[red]interrupted[/red]")
        return 130


def _run(args, con) -> int:
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import tqtx as tq

    tmp = None
    if args.keep:
        dump_dir = os.path.abspath(args.keep)
        state_root = dump_dir + ".demo-state"
        if os.path.exists(state_root):
            shutil.rmtree(state_root)
        os.makedirs(state_root)
    else:
        tmp = tempfile.mkdtemp(prefix="tqtx-demo-")
        dump_dir = os.path.join(tmp, "dump")
        state_root = tmp
    state_before = os.path.join(state_root, "state-before")
    state_after = os.path.join(state_root, "state-after")

    def step(msg):
        con.print(f"[bold cyan]>[/bold cyan] {msg}")

    def progress():
        return Progress(TextColumn("  {task.description}"), BarColumn(), TextColumn(
            "{task.completed}/{task.total}"), TimeElapsedColumn(), console=con, transient=True)

    try:
        t_all = time.perf_counter()
        step(f"generating {args.samples} samples (~{args.mb:g} MiB)")
        buf = make_buffer(args.samples, int(args.mb * 2**20), args.seed)
        n = len(buf["keys"])
        g = torch.Generator().manual_seed(args.seed + 1)
        perm = torch.randperm(n, generator=g).tolist()
        n_fin = int(round(n * args.finished_fraction))
        finished = sorted(perm[:n_fin])
        keep = sorted(perm[n_fin:])
        for i in finished:
            buf["tags"][i] = {**buf["tags"][i], "status": "finished"}

        step(f"starting {args.units_before} units")
        tq.init({"num_units": args.units_before, "state_dir": state_before})
        batch = 256
        # the batches a rollout worker would hand over (built outside the timed put)
        batches = [(lo, min(n, lo + batch), tensordict_of(buf, lo, min(n, lo + batch)))
                   for lo in range(0, n, batch)]
        t_put = 0.0
        with progress() as prog:
            task = prog.add_task("kv_batch_put", total=n)
            for lo, hi, td in batches:
                # everything starts "running"; the finished ones are marked below
                tags = [{**t, "status": "running"} for t in buf["tags"][lo:hi]]
                t0 = time.perf_counter()
                tq.kv_batch_put(buf["keys"][lo:hi], PARTITION, td, tags=tags)
                t_put += time.perf_counter() - t0
                prog.advance(task, hi - lo)
        total_payload = payload_bytes(buf)
        step(f"put {n} samples, {total_payload / 2**20:.1f} MiB payload in {t_put:.2f}s")

        # rollouts finish: a tag-only batch put flips their status
        tq.kv_batch_put([buf["keys"][i] for i in finished], PARTITION,
                        tags=[buf["tags"][i] for i in finished])
        listed = tq.kv_list(PARTITION)[PARTITION]
        unfinished = [k for k, t in listed.items() if t.get("status") != "finished"]
        step(f"marked {len(finished)} finished; {len(unfinished)} still running")
        if sorted(unfinished) != sorted(buf["keys"][i] for i in keep):
            raise AssertionError("kv_list does not show the expected unfinished keys")

        step(f"dumping the unfinished samples to {dump_dir}")
        with con.status("  dump_data_by_key ..."):
            save = tq.dump_data_by_key(dump_dir, unfinished, PARTITION)
        tq.close()

        step(f"restarting with {args.units_after} units on a fresh state dir")
        tq.init({"num_units": args.units_after, "state_dir": state_after})
        with con.status("  load_data_by_key ..."):
            restore = tq.load_data_by_key(dump_dir)

        step("verifying every value, dtype, shape and tag")
        keep_keys = [buf["keys"][i] for i in keep]
        problems: list[str] = []
        checks = 0
        with progress() as prog:
            task = prog.add_task("verify", total=len(keep))
            for lo in range(0, len(keep), 512):
                part = keep[lo:lo + 512]
                got = tq.kv_batch_get(keep_keys[lo:lo + 512], PARTITION)
                listed = tq.kv_list(PARTITION).get(PARTITION, {})
                sub_listed = {k: listed[k] for k in keep_keys[lo:lo + 512] if k in listed}
                checks += verify(buf, part, got, sub_listed, [], problems)
                prog.advance(task, len(part))
        listed = tq.kv_list(PARTITION).get(PARTITION, {})
        checks += verify_global(buf, keep, finished, listed, problems)
        if restore["keys"] != len(keep) or save["keys"] != len(keep):
            problems.append(f"dump had {save['keys']} keys, restore {restore['keys']}; "
                            f"expected {len(keep)}")
        payload_kept = payload_bytes(buf, keep)

        journals = read_journals(state_before, state_after, dump_dir)
        tq.close()

        print_timings(con, args, n, total_payload, t_put, save, restore)
        print_journals(con, journals)
        con.print(f"finished samples not restored: {len(finished)}; restored {len(keep)} of "
                  f"{n} ({payload_kept / 2**20:.1f} MiB payload)")
        restores = journals["restores"]
        if restores and restores[0]["state"] != COMMITTED:
            problems.append(f"journal: restore state {restores[0]['state']!r}, not committed")
        code = print_verdict(con, problems, checks, len(keep), time.perf_counter() - t_all)
        if code == 0 and args.keep:
            print_next_steps(con, dump_dir, state_after)
        return code
    except Exception as exc:
        con.print(f"[bold red]demo failed[/bold red]: {type(exc).__name__}: {exc}")
        return 2
    finally:
        try:
            tq.close()
        except Exception:
            pass
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # dump, its sibling journal, state dirs
