"""Load: concurrent client processes while dumps and restores run; a stateful model test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

import tqtx as tq  # noqa: E402
from buffers import assert_same_rows, rollout_batch  # noqa: E402

WRITER = textwrap.dedent("""
    import json, random, sys, time
    import torch
    from tensordict import TensorDict
    import tqtx as tq

    address, wid, seconds, pid = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    tq.init(address=address)
    rng = random.Random(wid)

    def value(key):
        n = int(key.rsplit("-", 1)[1])
        return torch.full((4,), float(wid * 1_000_000 + n)), torch.arange(n % 7 + 1) + wid

    written, errors, puts, gets = [], [], 0, 0
    print("READY", flush=True)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        try:
            batch = [f"w{wid}-{n + i}" for i in range(rng.randint(1, 8))]
            n += len(batch)
            vals = [value(k) for k in batch]
            td = TensorDict({
                "x": torch.stack([v[0] for v in vals]),
                "tok": torch.nested.nested_tensor([v[1] for v in vals], layout=torch.jagged),
            }, batch_size=[len(batch)])
            tq.kv_batch_put(batch, pid, td, tags=[{"w": wid, "k": k} for k in batch])
            written += batch
            puts += 1
            probe = rng.sample(written, min(len(written), 5))
            got = tq.kv_batch_get(probe, pid)
            for i, k in enumerate(probe):
                x, tok = value(k)
                if not torch.equal(got["x"][i], x) or not torch.equal(got["tok"][i], tok):
                    errors.append(f"wrong data for {k}")
            gets += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # every key this writer ever wrote is there, with its data and tag
    try:
        listed = tq.kv_list(pid)[pid]
        missing = [k for k in written if k not in listed]
        if missing:
            errors.append(f"lost keys {missing[:5]} ({len(missing)})")
        bad_tags = [k for k in written if k in listed and listed[k] != {"w": wid, "k": k}]
        if bad_tags:
            errors.append(f"wrong tags {bad_tags[:5]}")
        for i in range(0, len(written), 256):
            chunk = written[i:i + 256]
            got = tq.kv_batch_get(chunk, pid)
            for j, k in enumerate(chunk):
                x, tok = value(k)
                if not torch.equal(got["x"][j], x) or not torch.equal(got["tok"][j], tok):
                    errors.append(f"wrong final data for {k}")
    except Exception as exc:
        errors.append(f"final check: {type(exc).__name__}: {exc}")
    print("RESULT " + json.dumps({"wid": wid, "keys": len(written), "puts": puts, "gets": gets,
                                   "errors": errors[:20]}), flush=True)
    tq.close()
""")


def _run_concurrent(tq_start, tmp_path, *, writers: int, seconds: float, rounds_min: int):
    cfg = tq_start(3)
    address = cfg["address"]
    # bystanders and a source partition for dumps
    bk, btd, btags = rollout_batch(20, seed=11)
    tq.kv_batch_put(bk, "bystander", btd, tags=btags)
    sk, std, stags = rollout_batch(64, seed=12, start=100)
    tq.kv_batch_put(sk, "src", std, tags=stags)

    env = {**os.environ, "TQTX_LOG_LEVEL": "WARNING"}
    # Unbuffered pipes: readline() below must not read past READY, because communicate()
    # reads the raw pipe and would lose a RESULT line sitting in readline's buffer (a writer
    # that finished before the parent read its READY).
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, address, str(w), str(seconds), "load"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
             for w in range(writers)]
    try:
        for p in procs:  # wait until every writer is attached and about to loop
            line = p.stdout.readline().decode()
            assert line.startswith("READY"), (line, p.stderr.read()[-2000:] if p.poll() else "")
        t_ready = time.monotonic()
        rounds = 0
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end or rounds < rounds_min:
            dump = tmp_path / f"dump-{rounds}"
            sel = sk[rounds % 8::3]
            tq.dump_data_by_key(dump, sel, "src")
            rpid = f"restored-{rounds}"
            rep = tq.load_data_by_key(dump, partition_id=rpid)
            assert rep["keys"] == len(sel)
            idx = [sk.index(k) for k in sel]
            assert_same_rows(std[idx], tq.kv_batch_get(sel, rpid), sel)
            rounds += 1
        t_rounds = time.monotonic()
        results = []
        for p in procs:
            out, err = (b.decode() for b in p.communicate(timeout=120))
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert p.returncode == 0 and line, err[-3000:]
            results.append(json.loads(line[0][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"ready->rounds done {t_rounds - t_ready:.1f}s, writers done "
          f"{time.monotonic() - t_rounds:.1f}s, rounds {rounds}")
    for r in results:
        assert r["errors"] == [], r
        assert r["puts"] > 0 and r["gets"] > 0, r
    total = sum(r["keys"] for r in results)
    listed = tq.kv_list("load")["load"]
    assert len(listed) == total
    # bystanders and the dump source are intact
    assert_same_rows(btd, tq.kv_batch_get(bk, "bystander"), bk)
    assert_same_rows(std, tq.kv_batch_get(sk, "src"), sk)
    assert tq.list_restores() == []
    return {"rounds": rounds, "keys": total, "results": results}


@pytest.mark.slow
def test_concurrent_clients_with_dump_and_restore(tq_start, tmp_path):
    out = _run_concurrent(tq_start, tmp_path, writers=3, seconds=5.0, rounds_min=3)
    assert out["rounds"] >= 3


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~95 s alone: 30 s of load, then at least 20 dump/restore rounds
def test_concurrent_clients_long(tq_start, tmp_path):
    _run_concurrent(tq_start, tmp_path, writers=6, seconds=30.0, rounds_min=20)


# ---------------------------------------------------------------- stateful model
KEYS = [f"k{i}" for i in range(10)]
PID = "m"


def _value(seed: int) -> torch.Tensor:
    return torch.arange(3, dtype=torch.float32) + seed


class BufferMachine(RuleBasedStateMachine):
    """Random put/clear/dump/load/restart against a dict model ``key -> (seed, tag)``.

    Restart = close and init again (another unit count, a fresh state dir): the buffer is
    empty; dumps on disk survive and loading one restores its keys.
    """

    root: Path = None       # set by the test
    counter = 0
    examples = 0

    def __init__(self):
        super().__init__()
        self.model: dict[str, tuple[int, dict]] = {}
        self.dumps: dict[str, dict] = {}
        self.restarts = 0
        BufferMachine.examples += 1
        self.example = BufferMachine.examples
        if _initialized():
            existing = list(tq.kv_list(PID).get(PID, {}))
            if existing:
                tq.kv_clear(existing, PID)
        else:
            self._init(2)

    def _init(self, units: int):
        tq.close()
        BufferMachine.counter += 1
        tq.init({"num_units": units, "state_dir": str(self.root / f"s{BufferMachine.counter}")})

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True),
          seed=st.integers(0, 1000))
    def put(self, keys, seed):
        x = torch.stack([_value(seed + i) for i in range(len(keys))])
        tags = [{"s": seed + i} for i in range(len(keys))]
        tq.kv_batch_put(keys, PID, TensorDict({"x": x}, batch_size=[len(keys)]), tags=tags)
        for i, k in enumerate(keys):
            old_tag = self.model.get(k, (None, {}))[1]
            self.model[k] = (seed + i, {**old_tag, **tags[i]})

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def clear(self, keys):
        tq.kv_clear(keys, PID)
        for k in keys:
            self.model.pop(k, None)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def dump(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        # names sort in creation order, so a replayed example draws the same dump in `load`
        path = str(self.root / f"ex{self.example:04d}" / f"d{len(self.dumps):04d}")
        tq.dump_data_by_key(path, keys, PID)
        self.dumps[path] = {k: self.model[k] for k in keys}

    @precondition(lambda self: self.dumps)
    @rule(data=st.data())
    def load(self, data):
        path = data.draw(st.sampled_from(sorted(self.dumps)))
        tq.load_data_by_key(path)
        for k, (seed, tag) in self.dumps[path].items():
            old_tag = self.model.get(k, (None, {}))[1]
            self.model[k] = (seed, {**old_tag, **tag})

    @precondition(lambda self: self.restarts < 1)
    @rule(units=st.integers(1, 3))
    def restart(self, units):
        self.restarts += 1
        self._init(units)
        self.model = {}

    @invariant()
    def matches_model(self):
        listed = tq.kv_list(PID).get(PID, {})
        assert set(listed) == set(self.model), (sorted(listed), sorted(self.model))
        for k, (_seed, tag) in self.model.items():
            assert listed[k] == tag, (k, listed[k], tag)
        if self.model:
            keys = sorted(self.model)
            got = tq.kv_batch_get(keys, PID)["x"]
            for i, k in enumerate(keys):
                assert torch.equal(got[i], _value(self.model[k][0])), k


def _initialized() -> bool:
    from tqtx import api
    return api._client is not None


def _run_machine(tmp_path, examples: int, steps: int):
    BufferMachine.root = tmp_path
    tq.close()
    try:
        run_state_machine_as_test(BufferMachine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        tq.close()


@pytest.mark.slow
def test_stateful_model(tmp_path):
    _run_machine(tmp_path, examples=6, steps=15)


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~100 s alone; more beside the other xdist workers
def test_stateful_model_long(tmp_path):
    _run_machine(tmp_path, examples=60, steps=40)
