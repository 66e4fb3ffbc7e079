"""The TransferQueue calls NeMo-RL's adapter (``nemo_rl/data_plane/adapters/transfer_queue.py``)
and ROLL's transfer backend (``roll/distributed/scheduler/transfer_backend.py``) make, in
their order and shapes, through ``import transfer_queue`` (the shim) on tqtx's defaults.
The frameworks themselves are not installed here; verl's own code runs in tests/verl."""
from __future__ import annotations

import sys
import time
from importlib import resources

import pytest
import torch
from tensordict import TensorDict

from tqtx.compat import shim


@pytest.fixture
def transfer_queue(tmp_path):
    """``import transfer_queue`` as the frameworks do, resolved by the shim."""
    import tqtx
    tqtx.close()
    shim.install(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        import transfer_queue
        yield transfer_queue
    finally:
        tqtx.close()
        sys.path.remove(str(tmp_path))
        sys.modules.pop("transfer_queue", None)


def test_nemo_rl_adapter_calls(transfer_queue, tmp_path, monkeypatch):
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf
    tq = transfer_queue
    monkeypatch.setenv("TQTX_STATE_DIR", str(tmp_path / "state"))
    # _init_tq: TransferQueue's packaged config plus the adapter's overlay
    base = OmegaConf.load(str(resources.files("transfer_queue") / "config.yaml"))
    conf = OmegaConf.merge(base, {"controller": {"polling_mode": True}, "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": 1000, "num_data_storage_units": 2}}})
    assert tq.init(conf=conf)["num_units"] == 2
    # _patch_tq_actor_runtime_env: TransferQueue's Ray actor classes are not there
    with pytest.raises(ImportError):
        from transfer_queue.storage.simple_storage import SimpleStorageUnit  # noqa: F401
    # register_partition: a placeholder put of every field, then cleared
    fields = ["input_ids", "input_lengths", "advantages"]
    key = f"__schema__:train:{time.time_ns()}"
    tq.kv_batch_put(keys=[key], partition_id="train", tags=[{}],
                    fields=TensorDict({f: torch.zeros(1) for f in fields}, batch_size=[1]))
    tq.kv_clear(keys=[key], partition_id="train")
    # put_samples
    ids = [f"s{i}" for i in range(4)]
    td = TensorDict({"input_ids": torch.arange(12).reshape(4, 3),
                     "input_lengths": torch.tensor([3, 2, 3, 1])}, batch_size=[4])
    tq.kv_batch_put(keys=ids, partition_id="train", fields=td.detach(),
                    tags=[{"input_lengths": int(n)} for n in td["input_lengths"]])
    # claim_meta: fetch per dp rank until a batch is there, then its keys and tags
    client = tq.get_client()
    claimed = []
    for dp_rank in (0, 1):
        meta = client.get_meta(data_fields=["input_ids", "input_lengths"], batch_size=2,
                               partition_id="train", task_name="policy", mode="fetch",
                               sampling_config={"dp_rank": dp_rank})
        assert getattr(meta, "size", 0) > 0
        keys = client.kv_retrieve_keys(global_indexes=list(meta.global_indexes),
                                       partition_id="train")
        tags = list(meta.custom_meta)
        claimed.append(keys)
        assert [t["input_lengths"] for t in tags] == \
            [int(td["input_lengths"][ids.index(k)]) for k in keys]
    assert claimed == [["s0", "s1"], ["s2", "s3"]]
    empty = client.get_meta(data_fields=["input_ids"], batch_size=2, partition_id="train",
                            task_name="policy", mode="fetch", sampling_config={})
    assert empty.size == 0  # polling mode: nothing left, at once
    # get_samples
    got = tq.kv_batch_get(keys=claimed[1], partition_id="train", select_fields=["input_ids"])
    assert [t.tolist() for t in got["input_ids"].unbind()] == [[6, 7, 8], [9, 10, 11]]
    # check_consumption_status
    assert client.check_consumption_status(task_name="policy", partition_id="train")
    assert not client.check_consumption_status(task_name="critic", partition_id="train")
    # clear_samples(None): the keys from kv_list
    listing = tq.kv_list(partition_id="train")
    tq.kv_clear(keys=list(listing.get("train", {}).keys()), partition_id="train")
    assert tq.kv_list(partition_id="train") == {}
    tq.close()


def test_roll_transfer_backend_calls(transfer_queue, tmp_path, monkeypatch):
    tq = transfer_queue
    monkeypatch.setenv("TQTX_STATE_DIR", str(tmp_path / "state"))
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}})
    rows = ["r0", "r1", "r2"]
    data = TensorDict({"responses": torch.ones(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)},
                      batch_size=[3])
    tq.kv_batch_put(keys=rows, fields=data, partition_id="rollout")
    got = tq.kv_batch_get(keys=rows, select_fields=["responses"], partition_id="rollout")
    assert list(got.keys()) == ["responses"] and got.batch_size == torch.Size([3])
    tq.kv_clear(keys=rows, partition_id="rollout")
    assert tq.kv_list("rollout") == {}
