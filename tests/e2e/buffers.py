"""Test data: a small partial-rollout buffer with every kind of field, and comparisons."""
from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict


def rollout_batch(n: int, *, seed: int = 0, start: int = 0):
    """(keys, TensorDict, tags) with dense, jagged, scalar, bool, bf16 and text fields."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"s{start + i}" for i in range(n)]
    lens = [(i * 7 + seed) % 11 + 1 for i in range(n)]
    td = TensorDict({
        "obs": torch.randn(n, 4, generator=g),
        "tokens": torch.nested.nested_tensor(
            [torch.randint(0, 1000, (L,), generator=g) for L in lens], layout=torch.jagged),
        "reward": torch.randn(n, generator=g),
        "done": torch.rand(n, generator=g) > 0.5,
        "half": torch.randn(n, 2, generator=g).to(torch.bfloat16),
        "text": [f"sample {start + i} seed {seed}" for i in range(n)],
    }, batch_size=[n])
    tags = [{"status": "running" if i % 3 else "finished", "step": i,
             "score": torch.tensor([float(i), 1.0])} for i in range(n)]
    return keys, td, tags


def same_host_batch(n: int, seed: int):
    """(TensorDict, jagged rows) of ``n`` rows: dense, jagged, scalar and text fields."""
    g = torch.Generator().manual_seed(seed)
    jag = [torch.randint(0, 1000, (int(k),), generator=g) for k in
           torch.randint(1, 400, (n,), generator=g)]
    td = TensorDict({
        "dense": torch.rand(n, 33, generator=g),
        "tokens": torch.nested.nested_tensor(jag, layout=torch.jagged),
        "reward": torch.rand(n, generator=g),
        "text": NonTensorStack(*[f"sample {i}" for i in range(n)]),
    }, batch_size=[n])
    return td, jag


def rows_of(td: TensorDict) -> list[dict]:
    """Per-row python/tensor values of a TensorDict for exact comparison."""
    out = []
    n = td.batch_size[0]
    cols = {}
    for f in td.keys():
        col = td.get(f)
        if isinstance(col, torch.Tensor):
            cols[f] = list(col.unbind(0)) if not col.is_nested else list(col.unbind())
        else:
            cols[f] = list(col.tolist())
    for i in range(n):
        out.append({f: c[i] for f, c in cols.items()})
    return out


def assert_same_value(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same_value(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_rows(expected: TensorDict, got: TensorDict, keys=None):
    assert set(expected.keys()) == set(got.keys())
    for i, (ra, rb) in enumerate(zip(rows_of(expected), rows_of(got))):
        for f in ra:
            assert_same_value(ra[f], rb[f], f"row {keys[i] if keys else i} field {f}")
