"""A TransferQueue-style trainer loop, end to end, with real processes and a SIGKILL.

A trainer process creates the deployment (the first bare ``tq.init()``); 4 worker
processes attach with the same bare ``tq.init()`` and put jagged int64 prompt tokens with
status tags. At every step boundary (workers have put their batch and wait, as
docs/checkpoint.md asks) the trainer saves ``<ckpt>/global_step_<N>/transfer_queue``
with ``metadata={"global_steps": N}`` and dumps the pending keys. Then everything is
SIGKILLed. A new trainer loads the last checkpoint and re-issues the pending prompts the
verl way (kv_list -> kv_batch_get -> kv_clear -> tags-only kv_batch_put), workers
generate them again; separately, the pending dump of the last step is loaded into a
deployment with another unit count.
"""
from __future__ import annotations

import json
import os

import pytest

from tq_procs import JobProcess, alive, job_processes, step_samples, wait_gone

PID = "train"
WORKERS = 4
STEPS = 3


def expected_state(last_step: int) -> dict:
    """{key: (tokens, tag)} after the workers put steps 1..last_step (see _put_step)."""
    state = {}
    for w in range(WORKERS):
        for step in range(1, last_step + 1):
            for key, tokens, tag in step_samples(w, step):
                state[key] = (tokens, dict(tag))
            if step > 1:
                for key, _, tag in step_samples(w, step - 1):
                    if tag["status"] == "running":
                        state[key][1]["status"] = "finished"
    return state


def pending_of(state: dict) -> list[str]:
    return sorted(k for k, (_, tag) in state.items() if tag["status"] in ("pending", "running"))


def assert_holds(proc: JobProcess, state: dict) -> None:
    """Every key of ``state`` (and no other) with exactly its tokens and tag."""
    tags = proc.call("list", pid=PID)
    assert sorted(tags) == sorted(state)
    for key, (_, tag) in state.items():
        assert tags[key] == tag, key
    keys = sorted(state)
    got = proc.call("get", keys=keys, pid=PID)
    for key, tokens in zip(keys, got):
        assert tokens == state[key][0], key


@pytest.fixture
def job():
    """``start(n, env)`` starts job processes; all are killed after the test."""
    with job_processes() as start:
        yield start


def test_trainer_loop_checkpoint_sigkill_resume(tmp_path, job):
    state_dir, ckpt = str(tmp_path / "state"), tmp_path / "ckpt"
    env = {"TQTX_STATE_DIR": state_dir}

    # ---- the job: a trainer creates, 4 workers attach, all with a bare tq.init()
    (trainer,) = job(1, env)
    made = trainer.call("init")
    assert made["mode"] == "embedded" and made["num_units"] == 2
    workers = job(WORKERS, env)
    for w in workers:
        cfg = w.call("init")
        assert cfg["mode"] == "attached" and cfg["address"] == made["address"]

    for step in range(1, STEPS + 2):
        for i, w in enumerate(workers):  # the step's go signal
            w.send("put_step", worker=i, step=step, pid=PID)
        for w in workers:                # the step boundary: every worker put and waits
            w.reply()
        if step > STEPS:
            break                        # a step after the last checkpoint: lost on resume
        state = expected_state(step)
        save_dir = ckpt / f"global_step_{step}" / "transfer_queue"
        trainer.call("save_checkpoint", path=str(save_dir), step=step)
        trainer.call("dump", path=str(ckpt / f"global_step_{step}" / "pending"),
                     keys=pending_of(state), pid=PID)
    assert_holds(trainer, expected_state(STEPS + 1))
    meta = json.loads((ckpt / f"global_step_{STEPS}" / "transfer_queue" / "metadata.json")
                      .read_text())
    assert meta == {"storage_saved": True, "user_metadata": {"global_steps": STEPS}}

    # ---- SIGKILL everything; the deployment's processes die with the trainer
    for p in [trainer, *workers]:
        p.kill()
    assert wait_gone(made["pids"].values()) == []
    assert os.path.exists(os.path.join(state_dir, "deployment.json"))  # stale now

    # ---- resume: a new trainer creates (the stale record does not block it)
    (trainer,) = job(1, env)
    made = trainer.call("init")
    assert made["mode"] == "embedded" and made["owner_pid"] == trainer.pid
    trainer.call("load_checkpoint", path=str(ckpt / f"global_step_{STEPS}" / "transfer_queue"))
    state = expected_state(STEPS)
    assert_holds(trainer, state)          # exactly step 3: step 4's puts are gone
    pending = pending_of(state)
    assert pending and len(pending) < len(state)

    # verl: kv_list -> pending/running keys -> kv_batch_get -> kv_clear -> tags-only put
    prompts = trainer.call("reissue", pid=PID)
    assert sorted(prompts) == pending
    for key in pending:
        assert prompts[key] == state[key][0]
    tags = trainer.call("list", pid=PID)
    for key in pending:
        assert tags[key] == {**state[key][1], "status": "pending", "reissued": True}
    err = trainer.call_error("get", keys=pending[:1], pid=PID)  # cleared: no fields left
    assert "prompt" in err["message"]

    # workers attach again and generate the re-issued prompts
    workers = job(WORKERS, env)
    redone = []
    for i, w in enumerate(workers):
        assert w.call("init")["mode"] == "attached"
        redone += w.call("regenerate", worker=i, pid=PID)
    assert sorted(redone) == pending
    final = {k: (tokens, {**tag, "status": "finished", "reissued": True} if k in pending
                 else tag) for k, (tokens, tag) in state.items()}
    assert_holds(workers[0], final)
    trainer.call("close")
    for w in workers:
        w.exit()

    # ---- the other resume path: the last step's pending dump into 3 units
    (restorer,) = job(1, {"TQTX_STATE_DIR": str(tmp_path / "state3")})
    cfg = restorer.call("init", config={"num_units": 3})
    assert cfg["mode"] == "embedded" and cfg["num_units"] == 3
    restorer.call("load_dump", path=str(ckpt / f"global_step_{STEPS}" / "pending"), pid=PID)
    assert_holds(restorer, {k: state[k] for k in pending})
    restorer.call("close")


@pytest.mark.slow
def test_pending_dump_loads_onto_another_unit_count(tmp_path, job):
    """The pending dump of a 3-unit job (TransferQueue's config shape), restored into a
    2-unit deployment after SIGKILL."""
    state_dir = str(tmp_path / "state")
    dump_dir = str(tmp_path / "ckpt" / "global_step_2" / "pending")
    (trainer,) = job(1, {"TQTX_STATE_DIR": state_dir})
    made = trainer.call("init", config={
        "controller": {"sampler": "SequentialSampler", "polling_mode": False},
        "backend": {"storage_backend": "SimpleStorage",
                    "SimpleStorage": {"num_data_storage_units": 3, "total_storage_size": None}}})
    assert made["mode"] == "embedded" and made["num_units"] == 3
    workers = job(2, {"TQTX_STATE_DIR": state_dir})
    for step in (1, 2):
        for i, w in enumerate(workers):
            if step == 1:
                assert w.call("init")["mode"] == "attached"
            w.call("put_step", worker=i, step=step, pid=PID)
    state = {k: v for k, v in expected_state(2).items() if v[1]["worker"] < len(workers)}
    pending = pending_of(state)
    trainer.call("dump", path=dump_dir, keys=pending, pid=PID)
    for p in [trainer, *workers]:
        p.kill()
    assert wait_gone(made["pids"].values()) == []

    (restorer,) = job(1, {"TQTX_STATE_DIR": str(tmp_path / "state2")})
    cfg = restorer.call("init", config={"num_units": 2})
    assert cfg["mode"] == "embedded" and cfg["num_units"] == 2
    restorer.call("load_dump", path=dump_dir, pid=PID)
    assert_holds(restorer, {k: state[k] for k in pending})
    assert all(alive(p) for p in cfg["pids"].values())
    restorer.call("close")
