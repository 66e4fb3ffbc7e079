"""tqtx.client.batches: the direct TensorDict constructor gives what TensorDict.set gives."""
from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from tqtx.client import batches, tensors
from tqtx.wire.values import RawTensor


def _columns(n: int) -> dict:
    return {"ids": torch.nested.nested_tensor([torch.arange(i + 1) for i in range(n)],
                                              layout=torch.jagged),
            "x": torch.rand(n, 3), "reward": torch.rand(n),
            "text": NonTensorStack(*[f"row {i}" for i in range(n)])}


@pytest.mark.parametrize("n", [1, 4])
def test_direct_and_public_agree(n):
    cols = _columns(n)
    a, b = batches._direct(dict(cols), n), batches.public(cols, n)
    assert batches._same(a, b, cols)
    assert type(a) is TensorDict and a.batch_size == torch.Size([n]) and a.device is None
    assert list(a.keys()) == ["ids", "x", "reward", "text"]
    assert a["text"].tolist() == [f"row {i}" for i in range(n)]
    assert torch.equal(a[n - 1]["x"], cols["x"][n - 1])
    # the result is an ordinary TensorDict: it can be indexed, stacked and changed
    assert torch.stack([a[0:1].exclude("ids"), b[0:1].exclude("ids")]).batch_size == (2, 1)
    a.set("extra", torch.zeros(n))
    assert "extra" in a.keys() and "extra" not in b.keys()


def test_this_tensordict_takes_the_direct_constructor():
    assert batches.batch.usable()
    batches.batch({"x": torch.zeros(2)}, 2)
    assert batches.batch.taken is True


def test_a_column_of_another_length_is_named_as_the_public_call_names_it():
    with pytest.raises(RuntimeError, match="batch dimension"):
        batches.batch({"x": torch.zeros(2), "y": torch.zeros(3)}, 2)


def test_without_the_internal_constructor_the_public_call_is_used(monkeypatch):
    def broken(columns, n):
        raise TypeError("this tensordict's constructor takes other arguments")
    monkeypatch.setattr(batches.batch, "direct", broken)
    monkeypatch.setattr(batches.batch, "taken", None)
    assert not batches.batch.usable()
    td = batches.batch({"x": torch.arange(3.0)}, 3)
    assert batches.batch.taken is False and td["x"].tolist() == [0.0, 1.0, 2.0]


def test_a_direct_constructor_that_gives_another_result_is_not_taken(monkeypatch):
    """The first-use check compares results, not only that the call succeeds."""
    def other(columns, n):
        return batches.public({k: v.clone() for k, v in columns.items()}, n)
    monkeypatch.setattr(batches.batch, "direct", other)
    monkeypatch.setattr(batches.batch, "taken", None)
    cols = {"x": torch.arange(3.0)}
    assert batches.batch(cols, 3)["x"] is cols["x"] and batches.batch.taken is False


def test_a_one_row_get_result_in_transferqueue_layout():
    """What kv_batch_get builds for one tiny row: a jagged field and a 0-d one."""
    obs = RawTensor("float32", (4,), memoryview(torch.arange(4.0).numpy().tobytes()))
    rew = RawTensor("float32", (), torch.tensor(2.5).numpy().tobytes())
    td = tensors.tensordict_from_columns({"obs": [obs], "reward": [rew]},
                                         {"obs": {"kind": "tensor"}, "reward": {"kind": "tensor"}},
                                         1, layout="transferqueue")
    assert td.batch_size == torch.Size([1]) and td["obs"].is_nested
    assert td["obs"].unbind()[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert td["reward"].tolist() == [2.5]
