"""verl 0.9.1's ``PPOTrainer.step()`` on tqtx, with tqtx's default config, in a Ray job.

verl's own trainer (``verl.trainer.ppo.v1``: replay buffer, colocated reward, batch
balancing and padding, old log probs, GRPO advantages, actor update, metrics) runs against
tqtx through ``import transfer_queue``; the model workers are verl ``Worker`` actors on Ray,
fed by verl's dispatch and ``tqbridge`` (``BatchMeta`` chunks, ``get_client().async_get_data``
/ ``async_put`` / ``async_kv_retrieve_keys`` in the workers). Only the model workers, the
LLM's output, the reward model and the tokenizer are stand-ins (``verl_rig``).
"""
from __future__ import annotations

import importlib.util
import shutil
import tempfile

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 and the verl-test "
                "extra (see .ci/run)", allow_module_level=True)
# verl, Ray and the shim's transfer_queue are imported by the tests, not at collection

# one Ray cluster at a time on a machine: with the other Ray tests (test_ray_placement.py)
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("ray")]
PROMPTS, N = 3, 2


@pytest.fixture(scope="module")
def ray_job():
    """A local Ray job whose workers import ``transfer_queue`` as tqtx (the shim)."""
    import ray

    import tqtx
    from verl_rig import process_pythonpath
    tqtx.close()
    temp = tempfile.mkdtemp(prefix="tqtx-verl-ray-", dir="/tmp")  # short: Ray's socket paths
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, _temp_dir=temp,
             runtime_env={"env_vars": {"PYTHONPATH": process_pythonpath(),
                                       "TQTX_LOG_LEVEL": "WARNING"}})
    try:
        yield
    finally:
        tqtx.close()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _actor_group():
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl_rig import StandInActor
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(StandInActor)),
                          device_name="cpu")


def _rows(col) -> list:
    return [t.tolist() for t in col.unbind()]


def test_ppo_trainer_step_and_worker_dispatch_run_on_tqtx(ray_job, tmp_path):
    import transfer_queue as tq  # tqtx, through the shim
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.debug import marked_timer
    from verl_rig import (GPUs, LLM, Prompts, Replicas, RewardModel, Tokenizer, prompt_ids,
                          response_ids, reward_of, verl_config)

    cfg = verl_config(tmp_path, mode="sync", prompts=PROMPTS, n=N)
    info = tq.init(cfg.transfer_queue)  # as verl's main_ppo does; in a Ray job: on the cluster
    assert info["placement"] == "ray" and info["mode"] == "ray"
    trainer = PPOTrainerSync(config=cfg)
    llm, rm = LLM(N), RewardModel()
    trainer.tokenizer, trainer.train_dataloader, trainer.train_dataloader_it = \
        Tokenizer(), Prompts(PROMPTS), None
    trainer.agent_loop_manager, trainer.reward_loop_manager = llm, rm
    trainer.checkpoint_manager, trainer.resource_pool_manager = Replicas(), GPUs()
    trainer.actor_rollout_wg = _actor_group()
    # what fit() sets before its first step
    trainer.global_steps = 1
    trainer.prev_step_profile = trainer.curr_step_profile = trainer.next_step_profile = False

    metrics, timing = {}, {}
    with marked_timer("step", timing):
        batch = trainer.step(metrics, timing)
    trainer._compute_metrics(batch, metrics, timing, global_steps=1, epoch=0)

    # 3 prompts x 2 sessions, padded to the actor's mini-batch multiple (2 x 2 = 4) with 2
    # synthetic rows by verl's upsample_batch_to_divisible_size
    real = [k for k, t in zip(batch.keys, batch.tags) if not t.get("is_padding")]
    assert len(real) == PROMPTS * N and len(batch) == 8
    uids = llm.calls[0]
    assert sorted(real) == sorted(f"{u}_{s}_0" for u in uids for s in range(N))
    # the tags the steps' kv_batch_put returned are the stored ones (metrics read them)
    assert all(t["min_global_steps"] == 1 and t["status"] == "success" for t in batch.tags)
    assert metrics["training/off_policy/trajectory_spans/mean"] == 1
    assert metrics["response_length/mean"] == pytest.approx(
        sum(len(response_ids(i, s)) for i in range(PROMPTS) for s in range(N)) / (PROMPTS * N))

    # the colocated reward model read the equal-length prompts (jagged, as TransferQueue's)
    assert rm.inputs[0].batch["prompts"].shape == (PROMPTS * N, len(prompt_ids(0)))
    # what the workers computed (old log probs), and GRPO's advantages, are in tqtx
    got = tq.kv_batch_get(keys=real, partition_id="train",
                          select_fields=["old_log_probs", "advantages", "responses", "index",
                                         "rm_scores"])
    by_key = dict(zip(real, range(len(real))))
    rewards = {}
    for k in real:
        uid, session, _ = k.rsplit("_", 2)
        i = int(got["index"][by_key[k]])
        assert _rows(got["responses"])[by_key[k]] == response_ids(i, int(session))
        rewards.setdefault(uid, {})[int(session)] = reward_of(response_ids(i, int(session)))
    for k in real:
        row = by_key[k]
        resp = got["responses"].unbind()[row]
        want = -(resp.float() % 5) / 10 - 0.05  # the stand-in's log prob of a token
        # old_log_probs are the log probs of the response tokens (shifted by one)
        ids = torch.cat([torch.tensor(prompt_ids(int(got["index"][row]))), resp])
        shifted = (-(ids.float() % 5) / 10 - 0.05)[len(ids) - len(resp) - 1:-1]
        assert torch.allclose(got["old_log_probs"].unbind()[row], shifted), k
        assert want.shape == shifted.shape
        uid, session, _ = k.rsplit("_", 2)
        group = rewards[uid]
        adv = got["advantages"].unbind()[row]
        assert adv.shape == resp.shape and torch.all(adv == adv[0])
        mine, other = group[int(session)], group[1 - int(session)]
        assert (adv[0] > 0) == (mine > other) and (adv[0] < 0) == (mine < other)
        assert (float(adv[0]) == 0.0) == (mine == other)
    # the actor update went through the dispatch: each rank got its half of the batch
    assert metrics["actor/rows"] == len(batch) / 2 == metrics["actor/old_log_probs_rows"]

    # verl then clears the step's batch (fit's step 7); the prompts were cleared by sampling
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    assert tq.kv_list("train") == {}


def test_tqbridge_dispatch_chunks_tqtx_batchmeta(ray_job, tmp_path):
    """verl's BatchData chunking of a KVBatchMeta makes tqtx BatchMetas (early KV -> index
    translation, one controller call), each worker reads its chunk, writes its output and
    translates back; the driver concatenates them into one KVBatchMeta."""
    from tensordict import TensorDict
    from verl.protocol import BatchData
    from verl.utils.transferqueue_utils import BatchMeta as VerlBatchMeta
    from verl.utils.transferqueue_utils import KVBatchMeta as VerlKVBatchMeta

    import tqtx
    import transfer_queue as tq
    tq.init()  # attaches to (or starts) the job's deployment on Ray
    assert VerlBatchMeta is tqtx.BatchMeta and VerlKVBatchMeta is tqtx.KVBatchMeta
    keys = [f"k{i}" for i in range(5)]
    ids = torch.nested.as_nested_tensor([torch.arange(3 + i) for i in range(5)],
                                        layout=torch.jagged)
    meta = tq.kv_batch_put(keys, "dispatch", TensorDict({"input_ids": ids}, [5]),
                           tags=[{"i": i} for i in range(5)])
    chunks = BatchData(meta).chunk(chunks=2)
    assert [type(c) for c in chunks] == [tqtx.BatchMeta] * 2
    assert [c.size for c in chunks] == [3, 2] and chunks[0].field_names == ["input_ids"]
    assert chunks[0].custom_meta == [{"i": 0}, {"i": 1}, {"i": 2}]

    group = _actor_group()
    out = group.compute_log_prob(meta)
    assert isinstance(out, tqtx.KVBatchMeta) and out.keys == keys
    assert set(out.fields) == {"entropy", "input_ids", "log_probs"}
    lp = tq.kv_batch_get(keys, "dispatch", select_fields="log_probs")["log_probs"]
    for row, src in zip(lp.unbind(), ids.unbind()):
        assert torch.allclose(row, -(src.float() % 5) / 10 - 0.05)
    assert group.execute_all_sync("_query_dispatch_info", "actor") == [0, 1]
