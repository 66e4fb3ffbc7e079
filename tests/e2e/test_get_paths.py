"""kv_batch_get over both reply layouts (joined column frames, one frame per row): values
are exact, and what the client got owns its memory (a later overwrite changes nothing).
Dense results are compared, so in strict mode; in the default mode a dense column is a
jagged view of the same buffer (tests/e2e/test_tq_kv_suite.py)."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq

pytestmark = pytest.mark.strict

KiB = 1024


def _dense(n, row_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, row_bytes // 4, generator=g)


@pytest.mark.parametrize("row_bytes", [16 * KiB, 64 * KiB, 1024 * KiB + 4])
def test_dense_rows_of_every_size(tq_shared, pid, row_bytes):
    n = 24
    keys = [f"k{i}" for i in range(n)]
    x = _dense(n, row_bytes, 1)
    tq.kv_batch_put(keys, pid, TensorDict({"x": x}, batch_size=[n]))
    got = tq.kv_batch_get(keys, pid)["x"]
    assert torch.equal(got, x)
    sub = [keys[i] for i in (5, 0, 17, 3)]  # any order, any subset
    assert torch.equal(tq.kv_batch_get(sub, pid)["x"], x[[5, 0, 17, 3]])
    # the result is the client's own copy: overwriting the rows changes nothing in it
    tq.kv_batch_put(keys, pid, TensorDict({"x": torch.zeros_like(x)}, batch_size=[n]))
    assert torch.equal(got, x)
    assert torch.count_nonzero(tq.kv_batch_get(keys, pid)["x"]) == 0


def test_jagged_rows_across_the_frame_size_limits(tq_shared, pid):
    """One column with rows from 8 bytes to 200 KiB: some units reply with a joined frame,
    others (holding a row over the limit) with one frame per row."""
    g = torch.Generator().manual_seed(2)
    lens = [1, 600, 9000, 25_000, 1, 3, 8191, 8192, 8193, 16_000, 2, 40]
    n = len(lens)
    keys = [f"j{i}" for i in range(n)]
    rows = [torch.randint(-2**40, 2**40, (L,), generator=g) for L in lens]
    lp = [torch.rand(L, generator=g) for L in lens]
    td = TensorDict({"tok": torch.nested.nested_tensor(rows, layout=torch.jagged),
                     "lp": torch.nested.nested_tensor(lp, layout=torch.jagged),
                     "r": torch.arange(n, dtype=torch.float32),
                     "text": [f"t{i}" for i in range(n)]}, batch_size=[n])
    tq.kv_batch_put(keys, pid, td)
    order = [7, 3, 11, 0, 9, 1, 2, 10, 4, 8, 5, 6]
    got = tq.kv_batch_get([keys[i] for i in order], pid)
    for field, src in (("tok", rows), ("lp", lp)):
        col = got[field]
        assert col.is_nested
        for j, i in enumerate(order):
            assert torch.equal(col[j], src[i]), (field, i)
    assert torch.equal(got["r"], torch.tensor([float(i) for i in order]))
    assert got["text"].tolist() == [f"t{i}" for i in order]
    before = got["tok"].values().clone()
    tq.kv_batch_put(keys, pid, TensorDict(
        {"tok": torch.nested.nested_tensor([torch.zeros_like(r) for r in rows],
                                           layout=torch.jagged)}, batch_size=[n]))
    assert torch.equal(got["tok"].values(), before)
