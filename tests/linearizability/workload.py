"""Drive a real deployment with concurrent random clients and collect their history.

:func:`start_deployment` starts a controller and units (child processes of the test, on
127.0.0.1, state in a tmp dir). :func:`run` starts the workers' parent process
(``workload_ops.py``: it imports torch once and forks the workers, each of which attaches
with ``tq.init(address=...)``), optionally runs a nemesis in this process meanwhile (unit and
controller kills), then merges the workers' JSONL logs into a history for :mod:`checker`.

:func:`whole_job_nemesis` SIGKILLs every process at once and starts them again on the same
state dir: with durability ``sync`` nothing acknowledged may be lost, so no loss is modelled.

A unit kill is part of the history: an optional write of LOST to the row of every key
during [kill, unit back] (only the keys on that unit lose their row, and they do so when it
re-registers). A controller kill loses nothing (metadata is journaled), so it is only counted.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from captures import LOST, KeySpace
from checker import RESTART, Op

HERE = Path(__file__).resolve().parent
PARTITIONS = ["pa", "pb"]
KEYS_PER_PARTITION = 7


@dataclass
class RunResult:
    history: list[Op]
    counts: dict[str, Counter]            # kind -> outcome -> ops
    errors: Counter                       # "kind: error type" -> ops
    bare_keyerrors: list[str]             # ops that raised a bare KeyError
    anomalies: list[str]                  # capture errors, worker failures
    nemesis: list[str] = field(default_factory=list)
    maintenance: int = 0
    elapsed: float = 0.0                  # how long the clients ran

    def table(self) -> str:
        kinds = sorted(self.counts)
        lines = [f"{'op':10} {'ok':>6} {'fail':>6} {'info':>6}"]
        for k in kinds:
            c = self.counts[k]
            lines.append(f"{k:10} {c['ok']:6} {c['fail']:6} {c['info']:6}")
        return "\n".join(lines)


def start_deployment(state_dir: str, num_units: int = 2, durability: str | None = None):
    from tqtx.deploy import LocalDeployment
    env = {"TQTX_DURABILITY": durability} if durability else None
    return LocalDeployment(num_units=num_units, state_dir=state_dir, owner_record=False,
                           env=env)


def put_reads(dep) -> int:
    """How many puts the deployment's units read out of a client's memory (unit stats)."""
    from tqtx.client import Client
    client = Client(dep.address, timeout=30)
    try:
        return sum(u["put_reads"] for u in client.stats()["units"])
    finally:
        client.close()


def run(dep, workdir: Path, *, workers: int, seconds: float, seed: int, nemesis=None,
        unblock: bool = False, timeout: float = 30.0, weights: dict | None = None,
        min_ok: dict | None = None, max_seconds: float | None = None) -> RunResult:
    """Run ``workers`` clients for ``seconds`` against ``dep``; ``nemesis(dep, end, limit)``,
    if given, runs in this thread meanwhile (until about ``end``, never past ``limit``, the
    end of ``max_seconds``) and returns (unit-loss ops, descriptions).
    ``weights``: how often each op kind is drawn (default ``workload_ops.WEIGHTS``).
    ``min_ok``: the clients go on after ``seconds`` (without a nemesis, up to ``max_seconds``
    in all) until they have that many successful ops of each kind: a loaded machine whose
    restarts are slow still tests as much as a quiet one."""
    for sub in ("logs", "dumps", "ckpts"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    stop_file = workdir / "stop"
    cfg = {"address": dep.address, "dir": str(workdir), "workers": workers,
           "seconds": max(seconds, max_seconds or 0.0), "stop_file": str(stop_file),
           "seed": seed, "partitions": PARTITIONS, "keys_per_partition": KEYS_PER_PARTITION,
           "timeout": timeout, "grace": timeout + 30.0, "unblock": unblock,
           "weights": weights}
    cfg_path = workdir / "workload.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k != "TQTX_ADDRESS"}
    with open(workdir / "workers.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, str(HERE / "workload_ops.py"), str(cfg_path)],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
        extra_ops, described = [], []
        start = time.monotonic()
        try:
            if nemesis is not None:
                extra_ops, described = nemesis(dep, start + seconds, start + cfg["seconds"])
            _wait_for_ops(workdir / "logs", extra_ops, min_ok, end=start + seconds,
                          limit=start + cfg["seconds"], proc=proc)
            stop_file.write_text("")
            proc.wait(timeout=cfg["grace"] + 60)
            elapsed = time.monotonic() - start
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    result = merge(workdir / "logs", KeySpace(PARTITIONS, KEYS_PER_PARTITION))
    result.history.extend(extra_ops)
    result.nemesis = described
    result.elapsed = elapsed
    for op in extra_ops:
        result.counts.setdefault(op.kind, Counter())[op.outcome] += 1
    with open(workdir / "history.jsonl", "w") as f:  # for a re-check (load_history)
        for op in result.history:
            f.write(json.dumps(op.to_json()) + "\n")
    if proc.returncode:
        tail = (workdir / "workers.out").read_text(errors="replace")[-2000:]
        result.anomalies.append(f"{proc.returncode} worker(s) failed:\n{tail}")
    for fatal in sorted((workdir / "logs").glob("*.fatal")):
        result.anomalies.append(f"{fatal.stem}: {fatal.read_text()}")
    return result


def _wait_for_ops(log_dir: Path, extra_ops: list, min_ok: dict | None, *, end: float,
                  limit: float, proc) -> None:
    """Wait until ``end``, then while the workers' logs (and ``extra_ops``) hold fewer
    successful ops than ``min_ok`` asks for, until ``limit`` (or the workers' exit)."""
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    while min_ok and time.monotonic() < limit and proc.poll() is None:
        counts = merge(log_dir, KeySpace(PARTITIONS, KEYS_PER_PARTITION)).counts
        for op in extra_ops:
            counts.setdefault(op.kind, Counter())[op.outcome] += 1
        if all(counts.get(k, Counter())["ok"] >= n for k, n in min_ok.items()):
            return
        time.sleep(2.0)


def load_history(path: Path) -> list[Op]:
    """A history written by :func:`run` (``<workdir>/history.jsonl``)."""
    return [Op.from_json(rec) for rec in _read_jsonl(path)]


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a killed worker
            continue
    return out


def _per_key(pairs) -> dict:
    return {(p, k): v for p, k, v in pairs}


def merge(log_dir: Path, space: KeySpace) -> RunResult:
    """The history of every worker log in ``log_dir`` (an invoke without a complete line
    is indeterminate)."""
    history: list[Op] = []
    counts: dict[str, Counter] = {}
    errors: Counter = Counter()
    bare: list[str] = []
    anomalies: list[str] = []
    maintenance = 0
    for path in sorted(log_dir.glob("w*.jsonl")):
        proc = path.stem
        invokes, completes, captures = {}, {}, {}
        for rec in _read_jsonl(path):
            e = rec["e"]
            if e == "invoke":
                invokes[rec["n"]] = rec
            elif e == "complete":
                completes[rec["n"]] = rec
            elif e == "capture":
                captures[rec["n"]] = rec
            elif e == "capture_error":
                anomalies.append(f"{proc} op {rec['n']}: capture unreadable: {rec['error']}")
            elif e == "maintenance":
                maintenance += 1
        for n, inv in sorted(invokes.items()):
            comp = completes.get(n, {})
            cap = captures.get(n, {})
            values = {**_per_key(inv["values"]), **_per_key(comp.get("values", [])),
                      **_per_key(cap.get("values", []))}
            tags = {**_per_key(inv["tags"]), **_per_key(comp.get("tags", [])),
                    **_per_key(cap.get("tags", []))}
            outcome = comp.get("outcome", "info")
            op = Op(process=proc, kind=inv["kind"], invoke=inv["t"], complete=comp.get("t"),
                    outcome=outcome, values=values, tags=tags, error=comp.get("error", ""))
            history.append(op)
            counts.setdefault(op.kind, Counter())[outcome] += 1
            if op.error:
                errors[f"{op.kind}: {op.error.split(':', 1)[0]}"] += 1
            if comp.get("bare"):
                bare.append(f"{proc} {op.kind} at {op.invoke:.3f}: {op.error}")
    return RunResult(history=history, counts=counts, errors=errors, bare_keyerrors=bare,
                     anomalies=anomalies, maintenance=maintenance)


def kill_nemesis(seed: int, *, every: tuple[float, float] = (6.0, 12.0)):
    """A nemesis that, until shortly before ``end``, kills (SIGKILL) a random unit or the
    controller, in turn, at random intervals, starting it again at once. Returns the unit
    losses as history ops and a description of each kill."""
    rng = random.Random(seed)
    space = KeySpace(PARTITIONS, KEYS_PER_PARTITION)

    def nemesis(dep, end: float, limit: float):
        ops: list[Op] = []
        described: list[str] = []
        while time.monotonic() + every[1] + 8 < end:
            time.sleep(rng.uniform(*every))   # the schedule is random by design
            t0 = time.monotonic()
            if len(described) % 2 == 0:   # unit and controller kills alternate
                uid = rng.randrange(dep.num_units)
                proc = dep.procs[f"unit {uid}"]
                proc.kill()
                proc.wait(10)
                dep.restart_unit(uid)
                t1 = time.monotonic()
                ops.append(Op(process="nemesis", kind="unit_loss", invoke=t0, complete=t1,
                              outcome="ok", optional=True,
                              values={k: LOST for k in space.keys}))
                described.append(f"unit {uid} killed and back in {t1 - t0:.2f}s")
            else:
                dep.restart_controller()   # kill -9, same state dir and port
                described.append(f"controller killed and back in {time.monotonic() - t0:.2f}s")
        return ops, described

    return nemesis


def whole_job_nemesis(seed: int, *, every: tuple[float, float] = (3.0, 5.0), want: int = 15):
    """A nemesis that kills (SIGKILL) every unit and the controller at random intervals
    drawn from ``every`` until shortly before ``end`` and starts them all again on the same
    state dir (the controller on its port). With fewer than ``want`` kills by then (slow
    restarts on a loaded machine), it goes on with short pauses until it has them or
    ``limit`` is near. Returns each kill as a ``restart`` op (no loss: with durability
    ``sync`` every acknowledged write survives) and a description of each kill."""
    rng = random.Random(seed)

    def nemesis(dep, end: float, limit: float):
        ops: list[Op] = []
        described: list[str] = []
        restarts: list[float] = []  # how long each kill took to come back
        while True:
            now = time.monotonic()
            if now + every[1] + 8 < end:
                pause = rng.uniform(*every)   # the schedule is random by design
            elif len(ops) < want and now + 0.5 + 2 * statistics.median(restarts or [0.0]) + 8 < limit:
                pause = 0.5
            else:
                break
            time.sleep(pause)
            t0 = time.monotonic()
            units = [dep.procs[f"unit {uid}"] for uid in range(dep.num_units)]
            for proc in units:
                proc.kill()
            dep.restart_controller()   # kill -9, same state dir and port
            for proc in units:
                proc.wait(10)
            dep.restart_units(range(dep.num_units))
            t1 = time.monotonic()
            restarts.append(t1 - t0)
            ops.append(Op(process="nemesis", kind=RESTART, invoke=t0, complete=t1,
                          outcome="ok"))
            described.append(f"job killed ({dep.num_units + 1} processes) and back in "
                             f"{t1 - t0:.2f}s")
        return ops, described

    return nemesis
