"""Concurrent clients against a real deployment, their history checked for per-key
linearizability (see checker.py for the model and workload.py for the clients).

Quick tier: ~10 s of 5 clients against 2 units. Slow tier: >= 2 minutes with unit and
controller kills, and 80 s with >= 15 whole-job kills each under durability sync (without
restores and with them). In every tier the odd-numbered clients have the units read every put out of
their memory (same-host puts); the others send frames. Each asserts no
violation, no bare KeyError reaching a caller, and a minimum of successful ops of every kind
(so none can pass without having tested anything; a loaded machine runs the nemesis and the
clients on, up to 1.6 times as long and 10 s more, 220 s for whole-job kills, until they have
their kills and ops).
"""
from __future__ import annotations

import random

import pytest

import workload
import workload_ops
from checker import check

pytestmark = pytest.mark.xdist_group("linearizability")  # CPU-heavy: one at a time

QUICK_MIN_OK = {"put": 50, "get": 50, "clear": 10, "list": 20, "dump": 5, "load": 5,
                "ckpt_save": 3, "ckpt_load": 2}
SLOW_MIN_OK = {"put": 300, "get": 300, "clear": 50, "list": 100, "dump": 20, "load": 20,
               "ckpt_save": 10, "ckpt_load": 5, "unit_loss": 2}


def _run_and_check(tmp_path, *, workers: int, seconds: float, min_ok: dict,
                   durability: str | None = None, max_seconds: float | None = None, **kwargs):
    seed = random.randrange(2**32)
    dep = workload.start_deployment(str(tmp_path / "state"), durability=durability)
    try:
        result = workload.run(dep, tmp_path / "run", workers=workers, seconds=seconds,
                              seed=seed, min_ok=min_ok,
                              max_seconds=max_seconds or seconds * 1.6 + 10, **kwargs)
        put_reads = workload.put_reads(dep) if "nemesis" not in kwargs else None
    finally:
        dep.stop()
    verdict = check(result.history)
    report = "\n".join([
        f"seed {seed}: {len(result.history)} ops by {workers} clients in {result.elapsed:.0f}s",
        result.table(),
        "errors: " + ", ".join(f"{k} {n}" for k, n in result.errors.most_common()),
        *([f"nemesis: {'; '.join(result.nemesis)}"] if result.nemesis else []),
        f"bare KeyErrors: {len(result.bare_keyerrors)}",
        *result.bare_keyerrors[:5],
        "checker: " + verdict.summary(limit=6)])
    print(report)
    problems = list(result.anomalies)
    if result.bare_keyerrors:
        problems.append(f"{len(result.bare_keyerrors)} bare KeyError(s) reached a caller")
    if not verdict.ok:
        problems.append(f"the history is not linearizable: {verdict.counts()}"
                        + (f", search bound hit on {verdict.unknown}" if verdict.unknown else ""))
    few = {k: result.counts.get(k, {}).get("ok", 0) for k, n in min_ok.items()
           if result.counts.get(k, {}).get("ok", 0) < n}
    if few:
        problems.append(f"too few successful ops (got {few}, want {min_ok})")
    if put_reads == 0:  # (units killed by a nemesis start their counts again)
        problems.append("no put was read out of a client's memory (same-host puts)")
    assert not problems, "\n".join(problems) + "\n\n" + report
    return result


def test_concurrent_history_is_linearizable(tmp_path):
    _run_and_check(tmp_path, workers=5, seconds=10.0, min_ok=QUICK_MIN_OK)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_history_with_unit_and_controller_kills_is_linearizable(tmp_path):
    seed = random.randrange(2**32)
    result = _run_and_check(tmp_path, workers=4, seconds=130.0, min_ok=SLOW_MIN_OK,
                            nemesis=workload.kill_nemesis(seed), unblock=True)
    assert any(n.startswith("controller") for n in result.nemesis), result.nemesis


def _whole_job_run(tmp_path, *, restores: bool):
    seed = random.randrange(2**32)
    min_ok = {k: n for k, n in SLOW_MIN_OK.items()
              if k != "unit_loss" and (restores or k != "load")}
    weights = dict(workload_ops.WEIGHTS, **({} if restores else {"load": 0}))
    result = _run_and_check(tmp_path, workers=4, seconds=80.0, max_seconds=220.0, min_ok=min_ok,
                            durability="sync", nemesis=workload.whole_job_nemesis(seed, want=15),
                            unblock=True, weights=weights)
    kills = [n for n in result.nemesis if n.startswith("job killed")]
    assert len(kills) >= 15, result.nemesis


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_history_with_whole_job_kills_under_sync_is_linearizable(tmp_path):
    """Durability sync: every process SIGKILLed at once, again and again, and started on
    the same state dir. No loss is modelled: an acknowledged put or clear that did not
    survive is a violation. Puts, gets, clears, lists, dumps and checkpoints; restores in
    the test below."""
    _whole_job_run(tmp_path, restores=False)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_history_with_whole_job_kills_and_restores_under_sync_is_linearizable(tmp_path):
    """As above, with restores: a restore or checkpoint load decided before a kill is rolled
    forward once, never again over the writes acknowledged after it."""
    _whole_job_run(tmp_path, restores=True)
