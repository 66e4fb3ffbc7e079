"""``tqtx demo``: the main job end to end, verified value by value.

1. start an embedded deployment with ``--units-before`` units;
2. fill a partition with a partial-rollout buffer (jagged prompt/response token ids,
   jagged log-probs, scalar rewards, a text field, tags with status/step/policy_version);
3. mark ~40% of the samples ``finished`` (tag-only batch put);
4. dump the unfinished ones with :func:`tqtx.dump_data_by_key`, then :func:`tqtx.close`;
5. start again with ``--units-after`` units on a fresh state dir and
   :func:`tqtx.load_data_by_key` the dump;
6. check every value, dtype, shape and tag against the reference kept in this process,
   and that no finished sample came back.

Exit code 0 only when the verification passed.
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
import warnings

PARTITION = "rollout"
FIELDS = ("prompt_ids", "response_ids", "log_probs", "reward", "text")


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


# ---------------------------------------------------------------- data
def make_buffer(n: int, total_bytes: int, seed: int = 0) -> dict:
    """A reference partial-rollout buffer: per-sample python lists of tensors, plus tags.

    Payload per sample ≈ 8*Lp (prompt int64) + 8*Lr (response int64) + 4*Lr (log-probs)
    + 4 (reward) + the text; 20% of the budget goes to the prompt, 80% to the response,
    lengths drawn uniformly in [0.25, 1.75] x the mean so the rows are really jagged.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    per = max(total_bytes / n, 64.0)
    mean_lp = max(per * 0.2 / 8, 2.0)
    mean_lr = max(per * 0.8 / 12, 2.0)

    def lengths(mean):
        f = torch.rand(n, generator=g) * 1.5 + 0.25
        return [max(1, int(round(mean * x))) for x in f.tolist()]

    lp, lr = lengths(mean_lp), lengths(mean_lr)
    prompt_flat = torch.randint(0, 151_936, (sum(lp),), generator=g, dtype=torch.int64)
    resp_flat = torch.randint(0, 151_936, (sum(lr),), generator=g, dtype=torch.int64)
    lp_flat = -torch.rand(sum(lr), generator=g, dtype=torch.float32) * 8.0
    prompts = list(torch.split(prompt_flat, lp))
    responses = list(torch.split(resp_flat, lr))
    logps = list(torch.split(lp_flat, lr))
    rewards = torch.randn(n, generator=g, dtype=torch.float32)
    texts = [f"sample {i}: réponse « {lr[i]} » tokens ✓" for i in range(n)]
    keys = [f"traj-{i:06d}" for i in range(n)]
    tags = [{"status": "running", "step": int(i % 97), "policy_version": int(3 + i % 5)}
            for i in range(n)]
    return {"keys": keys, "prompt_ids": prompts, "response_ids": responses, "log_probs": logps,
            "reward": rewards, "text": texts, "tags": tags}


def _payload_bytes(buf: dict, idx=None) -> int:
    idx = range(len(buf["keys"])) if idx is None else idx
    total = 0
    for i in idx:
        total += sum(buf[f][i].numel() * buf[f][i].element_size()
                     for f in ("prompt_ids", "response_ids", "log_probs"))
        total += 4 + len(buf["text"][i].encode())
    return total


def _tensordict(buf: dict, lo: int, hi: int):
    import torch
    from tensordict import TensorDict

    nt = torch.nested.nested_tensor
    return TensorDict({
        "prompt_ids": nt(buf["prompt_ids"][lo:hi], layout=torch.jagged),
        "response_ids": nt(buf["response_ids"][lo:hi], layout=torch.jagged),
        "log_probs": nt(buf["log_probs"][lo:hi], layout=torch.jagged),
        "reward": buf["reward"][lo:hi].clone(),
        "text": list(buf["text"][lo:hi]),
    }, batch_size=[hi - lo])


# ---------------------------------------------------------------- verification
def _rows(value, n: int) -> list:
    """A field of a fetched TensorDict as a list of per-row values."""
    import torch
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return list(value.unbind())
        return list(value.unbind(0)) if value.dim() > 0 else [value]
    if hasattr(value, "tolist"):
        out = value.tolist()
    else:
        out = list(value)
    if len(out) != n:
        raise AssertionError(f"expected {n} rows, got {len(out)}")
    return out


def verify(buf: dict, keep: list[int], got, listed: dict, finished: list[int],
           problems: list[str], limit: int = 20) -> int:
    """Compare every restored value, dtype, shape and tag; returns the number of checks."""
    import torch

    def bad(msg):
        if len(problems) < limit:
            problems.append(msg)
        elif len(problems) == limit:
            problems.append("... (more problems omitted)")

    checks = 0
    n = len(keep)
    if list(got.batch_size) != [n]:
        bad(f"batch size {list(got.batch_size)} != [{n}]")
        return checks
    missing = [f for f in FIELDS if f not in got.keys()]
    if missing:
        bad(f"fields missing after restore: {missing}")
    extra = [f for f in got.keys() if f not in FIELDS]
    if extra:
        bad(f"unexpected fields after restore: {extra}")
    for f in FIELDS:
        if f in missing:
            continue
        rows = _rows(got.get(f), n)
        for j, i in enumerate(keep):
            key = buf["keys"][i]
            if f == "text":
                if rows[j] != buf["text"][i]:
                    bad(f"{key}.text: {rows[j]!r} != {buf['text'][i]!r}")
                checks += 1
                continue
            ref = buf[f][i] if f != "reward" else buf["reward"][i]
            v = rows[j]
            if not isinstance(v, torch.Tensor):
                bad(f"{key}.{f}: got {type(v).__name__}, expected a tensor")
            elif v.dtype != ref.dtype:
                bad(f"{key}.{f}: dtype {v.dtype} != {ref.dtype}")
            elif tuple(v.shape) != tuple(ref.shape):
                bad(f"{key}.{f}: shape {tuple(v.shape)} != {tuple(ref.shape)}")
            elif not torch.equal(v, ref):
                bad(f"{key}.{f}: values differ")
            checks += 1
    for i in keep:
        key = buf["keys"][i]
        if key not in listed:
            bad(f"{key}: not listed after restore")
        elif listed[key] != buf["tags"][i]:
            bad(f"{key}: tag {listed[key]!r} != {buf['tags'][i]!r}")
        checks += 1
    leaked = [buf["keys"][i] for i in finished if buf["keys"][i] in listed]
    if leaked:
        bad(f"{len(leaked)} finished samples were restored, e.g. {leaked[:3]}")
    checks += len(finished)
    if len(listed) != n:
        bad(f"partition holds {len(listed)} keys after restore, expected {n}")
    checks += 1
    return checks


def quiet_console() -> None:
    """Keep warnings and torch's log lines off a command's console output."""
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    warnings.filterwarnings("ignore")
    import logging

    import torch  # noqa: F401  (configures torch's loggers; quiet them afterwards)

    for name in ("torch", "torch.fx", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    quiet_console()
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    con = Console(highlight=False)
    try:
        return _run(args, con, Progress, BarColumn, TextColumn, TimeElapsedColumn, Table)
    except KeyboardInterrupt:
        con.print("[red]interrupted[/red]")
        return 130


def _run(args, con, Progress, BarColumn, TextColumn, TimeElapsedColumn, Table) -> int:
    import torch

    import tqtx as tq
    from tqtx.journal.store import ControllerJournal, DumpJournal

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
        batches = [(lo, min(n, lo + batch), _tensordict(buf, lo, min(n, lo + batch)))
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
        total_payload = _payload_bytes(buf)
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
        payload_kept = _payload_bytes(buf, keep)

        # journals: the controller journal of the restoring deployment + the dump's own
        with ControllerJournal(state_after, migrate=False) as cj:
            restores = cj.list_restores()
        with ControllerJournal(state_before, migrate=False) as cj:
            dumps = cj.list_dumps()
        with DumpJournal(dump_dir, migrate=False) as dj:
            pubs = dj.publications()
            dreads = dj.list_restores()
        jshow = None
        try:
            out = subprocess.run([sys.executable, "-m", "tqtx", "journal", "show", "--state-dir",
                                  state_after, "--json"], capture_output=True, text=True,
                                 timeout=60)
            if out.returncode == 0:
                jshow = json.loads(out.stdout)
        except Exception:  # informational only
            jshow = None
        tq.close()

        # ---------------------------------------------------------------- summary
        def gbps(nbytes, sec):
            return nbytes / sec / 1e9 if sec > 0 else float("inf")

        t = Table(title="tqtx demo", show_header=True)
        t.add_column("step")
        t.add_column("keys", justify="right")
        t.add_column("bytes", justify="right")
        t.add_column("seconds", justify="right")
        t.add_column("GB/s", justify="right")
        t.add_row(f"put ({args.units_before} units)", str(n), f"{total_payload:,}",
                  f"{t_put:.3f}", f"{gbps(total_payload, t_put):.2f}")
        t.add_row(f"save (dump_data_by_key, {save['shards']} shards)", str(save["keys"]),
                  f"{save['bytes']:,}", f"{save['seconds']:.3f}",
                  f"{gbps(save['bytes'], save['seconds']):.2f}")
        t.add_row(f"restore (load_data_by_key, {args.units_after} units)", str(restore["keys"]),
                  f"{restore['bytes']:,}", f"{restore['seconds']:.3f}",
                  f"{gbps(restore['bytes'], restore['seconds']):.2f}")
        con.print(t)
        states = {}
        for r in restores:
            states[r["state"]] = states.get(r["state"], 0) + 1
        con.print(f"journal: controller (after) restores={len(restores)} {states}; "
                  f"controller (before) dumps={len(dumps)}; dump journal publications="
                  f"{len(pubs)} reads={len(dreads)}"
                  + (f"; `tqtx journal show --json`: {len(jshow['restores'])} restores, "
                     f"{len(jshow['publications'])} publications" if jshow else ""))
        con.print(f"finished samples not restored: {len(finished)}; restored {len(keep)} of "
                  f"{n} ({payload_kept / 2**20:.1f} MiB payload)")
        if restores and restores[0]["state"] != "committed":
            problems.append(f"journal: restore state {restores[0]['state']!r}, not committed")
        if problems:
            con.print(f"[bold red]VERIFICATION FAILED[/bold red] ({len(problems)} problems):")
            for p in problems:
                con.print(f"  - {p}")
            return 1
        con.print(f"[bold green]VERIFICATION PASSED[/bold green]: {checks} checks on "
                  f"{len(keep)} restored samples ({time.perf_counter() - t_all:.1f}s total)")
        if args.keep:
            con.print(f"dump kept in {dump_dir}; try:")
            con.print(f"  tqtx inspect {dump_dir}")
            con.print(f"  tqtx verify {dump_dir}")
            con.print(f"  tqtx journal show {dump_dir}")
            con.print(f"  tqtx journal show --state-dir {state_after}")
        return 0
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


def verify_global(buf, keep, finished, listed, problems) -> int:
    """Whole-partition checks: no finished sample restored, nothing extra."""
    checks = 0
    leaked = [buf["keys"][i] for i in finished if buf["keys"][i] in listed]
    if leaked:
        problems.append(f"{len(leaked)} finished samples were restored, e.g. {leaked[:3]}")
    checks += len(finished)
    expected = {buf["keys"][i] for i in keep}
    extra = set(listed) - expected
    if extra:
        problems.append(f"{len(extra)} unexpected keys after restore, e.g. {sorted(extra)[:3]}")
    missing = expected - set(listed)
    if missing:
        problems.append(f"{len(missing)} keys missing after restore, e.g. {sorted(missing)[:3]}")
    return checks + 1


if __name__ == "__main__":
    sys.exit(main())
