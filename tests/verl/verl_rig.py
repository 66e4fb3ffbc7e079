"""Stand-ins for what verl's trainer needs besides TransferQueue: model workers, the LLM's
output, the reward model, the tokenizer, and the prompt source. Everything else that runs
is verl 0.9.1's own code (trainer, replay buffer, padding, dispatch, ``tqbridge``,
``transferqueue_utils``) against tqtx through ``import transfer_queue`` (the shim).

The stand-ins write and read exactly what the real components would: the LLM stand-in
builds verl's own ``AgentLoopOutput`` per trajectory and stores it as
``AgentLoopWorkerTQ._agent_loop_postprocess`` does; the actor stand-in is a verl ``Worker``
whose ``compute_log_prob`` / ``update_actor`` carry verl's dispatch registration (so
``tqbridge`` fetches and stores its data) and answer what verl's engine answers, computed
from their inputs so the tests can check what each step read.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register

PROMPT_LEN = 5  # every prompt has this many tokens (dense when put, jagged when read)
PAD, EOS = 0, 2


def process_pythonpath() -> str:
    """PYTHONPATH for the processes a test starts (Ray workers too): the shim's directory
    (``import transfer_queue`` is tqtx) and this one (``verl_rig``)."""
    import importlib.util
    shim = importlib.util.find_spec("transfer_queue").origin
    return os.pathsep.join([os.path.dirname(os.path.dirname(shim)), os.path.dirname(__file__)])


def verl_config(workdir: Path, *, mode: str, prompts: int, n: int, units: int = 2):
    """verl's generated PPO config with a small GRPO run (no critic, no reference policy),
    TransferQueue on (tqtx's default semantics) and checkpoints under ``workdir``."""
    import verl
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    for key, value in {
        "data.train_batch_size": prompts, "actor_rollout_ref.rollout.n": n,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "algorithm.adv_estimator": "grpo",
        "critic.enable": False, "trainer.v1.trainer_mode": mode,
        "trainer.default_local_dir": str(workdir / "ckpt"), "trainer.resume_mode": "auto",
        "transfer_queue.enable": True,
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": units,
    }.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


class Tokenizer:
    pad_token_id = PAD
    eos_token_id = EOS


class Prompts:
    """The train dataloader: batches of ``batch`` prompts as verl's ``collate_fn`` makes
    them (object arrays of chat messages, indexes, data sources); resumable."""

    def __init__(self, batch: int):
        self.batch, self.next = batch, 0

    def __iter__(self):
        while True:
            start, self.next = self.next, self.next + self.batch
            rows = range(start, start + self.batch)
            raw = np.empty(self.batch, dtype=object)
            raw[:] = [[{"role": "user", "content": f"question {i}"}] for i in rows]
            yield {"raw_prompt": raw, "index": np.array(list(rows), dtype=object),
                   "data_source": np.array(["synthetic"] * self.batch, dtype=object)}

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


def prompt_ids(index: int) -> list[int]:
    return [10 + (index + j) % 7 for j in range(PROMPT_LEN)]


def response_ids(index: int, session: int) -> list[int]:
    return [20 + (index * 3 + session + j) % 11 for j in range(3 + (index + session) % 4)]


def reward_of(responses: list[int]) -> float:
    """The reward model stand-in's score of one response."""
    return float(sum(responses) % 2)


def _rows(batch: TensorDict) -> list[dict]:
    """One dict per prompt of a batch, as AgentLoopWorkerTQ.generate_sequences reads it."""
    out = []
    for i in range(len(batch)):
        row = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                row[k] = v[i]
            elif isinstance(v, NonTensorStack):
                row[k] = v[i].data
            elif isinstance(v, NonTensorData):
                row[k] = v.data
        out.append(row)
    return out


class LLM:
    """The agent loop manager with the LLM's output made up: each prompt's ``n`` sessions
    are generated and stored as verl's AgentLoopWorkerTQ stores them. ``hold`` maps a
    prompt index to the status it stays in (``"pending"``: not started; ``"running"``: one
    session stored, the prompt unfinished), as a checkpoint may catch them."""

    def __init__(self, n: int, *, with_scores: bool = False, hold: dict | None = None):
        self.n, self.with_scores, self.hold = n, with_scores, dict(hold or {})
        self.calls: list[list[str]] = []

    def generate_sequences(self, batch: TensorDict) -> None:
        import transfer_queue as tq
        rows = _rows(batch)
        self.calls.append([r["uid"] for r in rows])
        for prompt in rows:
            index, uid = int(prompt["index"]), prompt["uid"]
            status = self.hold.pop(index, "finished")
            if status == "pending":
                continue
            tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
            sessions = 1 if status == "running" else self.n
            for session in range(sessions):
                self._store(prompt, index, uid, session)
            if status == "finished":
                tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})

    def _store(self, prompt: dict, index: int, uid: str, session: int) -> None:
        import transfer_queue as tq
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
        from verl.utils.model import compute_position_id_with_mask
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        step = int(prompt["global_steps"])
        resp = response_ids(index, session)
        out = AgentLoopOutput(
            prompt_ids=prompt_ids(index), response_ids=resp, response_mask=[1] * len(resp),
            response_logprobs=[-0.5] * len(resp), num_turns=2, metrics=AgentLoopMetrics(),
            reward_score=reward_of(resp) if self.with_scores else None,
            extra_fields={"min_global_steps": step, "max_global_steps": step})
        field = out.as_dict()
        field.update({k: v for k, v in prompt.items() if k != "agent_name"}, session_id=session)
        field["loss_mask"] = field["response_mask"]
        field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
        mask = torch.ones_like(field["input_ids"])
        field["position_ids"] = compute_position_id_with_mask(mask.unsqueeze(0)).squeeze(0)
        field["multi_modal_inputs"] = {}
        plen, rlen = len(field["prompts"]), len(field["responses"])
        tag = {"status": "success", "prompt_len": plen, "response_len": rlen,
               "seq_len": plen + rlen, "global_steps": step, "min_global_steps": step,
               "max_global_steps": step}
        tq.kv_batch_put(keys=[f"{uid}_{session}_0"], partition_id="train",
                        fields=list_of_dict_to_tensordict([field]), tags=[tag])


class RewardModel:
    """The colocated reward model (``RewardLoopManager`` without reward workers)."""

    reward_loop_worker_handles = None

    def __init__(self):
        self.inputs = []

    def compute_rm_score(self, data):
        from verl.protocol import DataProto
        self.inputs.append(data)
        responses, mask = data.batch["responses"], data.batch["attention_mask"]
        resp_mask = mask[:, -responses.shape[1]:]
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        for i in range(len(responses)):
            valid = int(resp_mask[i].sum())
            scores[i, valid - 1] = reward_of(responses[i, :valid].tolist())
        return DataProto.from_dict(tensors={"rm_scores": scores},
                                   meta_info={"reward_extra_keys": []})


class Replicas:
    """The rollout replicas' weight sync (the checkpoint engine manager): nothing to sync."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


class GPUs:
    """The resource pool manager, as the throughput metrics ask it."""

    @staticmethod
    def get_n_gpus() -> int:
        return 1


class ActorCheckpoints:
    """The actor worker group's checkpoint calls (a file per save, read back on load)."""

    def __init__(self):
        self.loaded = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        Path(local_path, "weights.txt").write_text(str(global_step))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self.loaded.append(Path(local_path, "weights.txt").read_text())


class StandInActor(Worker):
    """A data-parallel actor rank: verl's dispatch and ``tqbridge`` feed it, as they feed
    verl's ActorRolloutRefWorker; it answers what the engine answers, from its inputs."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("actor", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        ids = data["input_ids"]
        values = -(ids.values().float() % 5) / 10 - 0.05
        out = torch.nested.nested_tensor_from_jagged(values, ids.offsets())
        return TensorDict({"log_probs": out, "entropy": out.clone().abs()},
                          batch_size=data.batch_size)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        from verl.utils import tensordict_utils as tu
        adv = data["advantages"]
        # what verl's engine reports, plus what this rank read (the test checks it)
        metrics = {"pg_loss": [float(adv.values().sum())], "mfu": [0.0],
                   "rows": [float(len(data))],
                   "old_log_probs_rows": [float(len(data["old_log_probs"].unbind()))]}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})
