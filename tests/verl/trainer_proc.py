"""One trainer process of the checkpoint-resume test (``test_verl_resume.py``):

``python trainer_proc.py save WORKDIR``: verl's colocate-async trainer at global step 3
registers 4 prompts (``_add_prompts_to_generate``); the LLM stand-in finishes two of them,
leaves one running with one session stored and one pending; ``_save_checkpoint`` saves
(TransferQueue state included); the process records every key, tag and value, then dies
without closing (as a crashed job).

``python trainer_proc.py resume WORKDIR``: a new trainer process starts on the same state
dir, loads the latest checkpoint (``_load_checkpoint``), compares every key, tag and value
with the record, re-issues the in-flight prompts (``_reissue_inflight_prompts``) and
samples a training batch (``ReplayBuffer.sample``); writes what it saw to JSON.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import transfer_queue as tq
from verl_rig import GPUs, LLM, ActorCheckpoints, Prompts, Replicas, Tokenizer, verl_config

PROMPTS, N, STEP = 4, 2, 3


def trainer_for(workdir: Path, llm: LLM):
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    cfg = verl_config(workdir, mode="colocate_async", prompts=PROMPTS, n=N)
    info = tq.init(cfg.transfer_queue)  # as verl's main_ppo does
    trainer = PPOTrainerColocateAsync(config=cfg)
    trainer.tokenizer, trainer.train_dataloader, trainer.train_dataloader_it = \
        Tokenizer(), Prompts(PROMPTS), None
    trainer.agent_loop_manager, trainer.checkpoint_manager = llm, Replicas()
    trainer.actor_rollout_wg, trainer.resource_pool_manager = ActorCheckpoints(), GPUs()
    return trainer, info


def snapshot() -> dict:
    """``{key: (tag, {field: value})}`` of the train partition, every field of every key."""
    out = {}
    for key, tag in sorted(tq.kv_list("train").get("train", {}).items()):
        td = tq.kv_batch_get(keys=[key], partition_id="train")
        out[key] = (tag, {f: _value(td[f]) for f in td.keys()})
    return out


def _value(col):
    if isinstance(col, torch.Tensor):
        return col.unbind()[0].clone() if col.is_nested else col[0].clone()
    return list(col)[0]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def save(workdir: Path) -> None:
    llm = LLM(N, with_scores=True, hold={2: "running", 3: "pending"})
    trainer, _ = trainer_for(workdir, llm)
    trainer.global_steps = STEP
    trainer._add_prompts_to_generate(PROMPTS)
    trainer._save_checkpoint()
    torch.save({"snapshot": snapshot(), "uids": llm.calls[0]}, workdir / "saved.pt")
    os._exit(0)  # a crash after the checkpoint: no tq.close(), the deployment dies with us


def resume(workdir: Path) -> None:
    saved = torch.load(workdir / "saved.pt", weights_only=False)
    llm = LLM(N, with_scores=True)
    trainer, info = trainer_for(workdir, llm)
    report = {"mode": info["mode"], "listed_at_start": tq.kv_list()}
    trainer._load_checkpoint()
    report.update(global_steps=trainer.global_steps, restored=trainer._restored_tq_prompt_count,
                  actor_loaded=trainer.actor_rollout_wg.loaded)
    now = snapshot()
    report["keys"] = sorted(now)
    report["mismatched"] = sorted(
        k for k in set(now) | set(saved["snapshot"])
        if k not in now or k not in saved["snapshot"] or now[k][0] != saved["snapshot"][k][0]
        or now[k][1].keys() != saved["snapshot"][k][1].keys()
        or not all(_same(v, saved["snapshot"][k][1][f]) for f, v in now[k][1].items()))
    trainer.global_steps += 1  # fit() moves to the next step before re-issuing
    report["reissued"] = trainer._reissue_inflight_prompts()
    report["regenerated"] = llm.calls
    batch, _ = trainer.replay_buffer.sample(global_steps=trainer.global_steps,
                                            partition_id="train", batch_size=PROMPTS)
    report["sampled"] = {k: t for k, t in zip(batch.keys, batch.tags)}
    report["uids"] = saved["uids"]
    report["listed_after"] = tq.kv_list("train").get("train", {})
    (workdir / "resumed.json").write_text(json.dumps(report, default=str))
    tq.close()


if __name__ == "__main__":
    {"save": save, "resume": resume}[sys.argv[1]](Path(sys.argv[2]))
