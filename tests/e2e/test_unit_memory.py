"""A unit's memory follows its data: rows freed by a clear or an overwrite go back to the OS."""
from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq

MiB = 2**20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _jagged_batch(n: int, row_bytes: int, seed: int = 0):
    """Rows of 0.5x..1.5x ``row_bytes`` int64 tokens (below malloc's mmap threshold, so
    they live in malloc's heaps, where freeing alone does not return pages)."""
    g = torch.Generator().manual_seed(seed)
    mean = row_bytes // 8
    lens = (torch.rand(n, generator=g) * mean + mean // 2).long().clamp(min=1).tolist()
    rows = [torch.randint(0, 1000, (L,), generator=g) for L in lens]
    td = TensorDict({"tokens": torch.nested.nested_tensor(rows, layout=torch.jagged),
                     "reward": torch.randn(n, generator=g)}, batch_size=[n])
    return [f"k{i}" for i in range(n)], td, sum(lens) * 8


def _settles_below(upid: int, limit: int, timeout: float = 15.0) -> int:
    """Unit RSS once it is at most ``limit`` (polling up to ``timeout`` s), else the last."""
    deadline = time.monotonic() + timeout
    rss = _rss(upid)
    while rss > limit and time.monotonic() < deadline:
        time.sleep(0.1)
        rss = _rss(upid)
    return rss


def test_clear_and_overwrite_give_row_memory_back(tq_start, pid):
    tq_start(num_units=1)
    client = tq.get_client()
    upid = client.stats()["units"][0]["pid"]
    keys, td, nbytes = _jagged_batch(2000, 20 * 1024)  # ~40 MiB of ~20 KiB rows
    tq.kv_batch_put(keys[:10], pid, td[:10])  # imports and first-use allocations
    tq.kv_clear(keys[:10], pid)
    time.sleep(1.5)  # the unit trims after 1 s of quiet
    idle = _rss(upid)
    tq.kv_batch_put(keys, pid, td)
    assert client.stats()["units"][0]["bytes"] >= nbytes
    full = _rss(upid)
    assert full > idle + nbytes * 0.9  # the rows are really held

    tq.kv_batch_put(keys, pid, td)  # overwrite every row: the old ones are freed
    rss = _settles_below(upid, idle + nbytes * 1.25)
    assert rss <= idle + nbytes * 1.25, (
        f"after overwriting {nbytes / MiB:.0f} MiB the unit holds {rss / MiB:.0f} MiB "
        f"(idle {idle / MiB:.0f} MiB)")

    tq.kv_clear(keys, pid)
    rss = _settles_below(upid, idle + nbytes * 0.2)
    assert rss <= idle + nbytes * 0.2, (
        f"after clearing {nbytes / MiB:.0f} MiB the unit still holds {rss / MiB:.0f} MiB "
        f"(idle {idle / MiB:.0f} MiB)")
    out = tq.kv_batch_put(keys[:5], pid, td[:5])  # still serving after the trims
    assert out.keys == keys[:5]
    assert torch.equal(tq.kv_batch_get(keys[:5], pid)["tokens"].values(),
                       td[:5]["tokens"].values())


@pytest.mark.slow
def test_restored_rows_give_their_memory_back_when_cleared(tq_start, pid, tmp_path):
    """Restored rows are read by a unit's I/O threads, not the thread that put them.
    (Freed, they could become the top of that thread's malloc arena, which malloc_trim does
    not hand back: 13-31 MiB stayed in one unit of two at 128 MiB each, in most runs;
    units allocate from the main arena only. tests/storage/test_memory_trim.py shows that
    mechanism deterministically; this checks the whole path in a real unit.)"""
    tq_start(num_units=1)
    client = tq.get_client()
    upid = client.stats()["units"][0]["pid"]
    keys, td, nbytes = _jagged_batch(4000, 32 * 1024)  # ~120 MiB of ~32 KiB rows
    tq.kv_batch_put(keys[:10], pid, td[:10])
    tq.dump_data_by_key(str(tmp_path / "warm"), keys[:10], pid)
    tq.load_data_by_key(str(tmp_path / "warm"))
    tq.kv_clear(keys[:10], pid)
    time.sleep(1.5)
    idle = _rss(upid)
    tq.kv_batch_put(keys, pid, td)
    tq.dump_data_by_key(str(tmp_path / "d"), keys, pid)
    tq.kv_clear(keys, pid)
    tq.load_data_by_key(str(tmp_path / "d"))
    assert _rss(upid) > idle + nbytes * 0.9  # the restored rows are really held
    tq.kv_clear(keys, pid)
    rss = _settles_below(upid, idle + 10 * MiB)
    assert rss <= idle + 10 * MiB, (
        f"after clearing {nbytes / MiB:.0f} MiB of restored rows the unit holds "
        f"{(rss - idle) / MiB:.1f} MiB over idle")


@pytest.mark.strict  # compares dense columns
def test_small_row_frames_do_not_pin_receive_buffers(tq_start, pid):
    """Rows of 5 KiB fit ZeroMQ's shared 8 KiB receive buffers; stored as views they kept
    a whole buffer each (1.8x the payload). They travel inside the header now (and a unit
    copies such a frame out, should another sender make one)."""
    tq_start(num_units=1)
    client = tq.get_client()
    upid = client.stats()["units"][0]["pid"]
    n, row = 6000, 5000
    keys = [f"s{i}" for i in range(n)]
    td = TensorDict({"x": torch.randint(0, 255, (n, row), dtype=torch.uint8)}, batch_size=[n])
    tq.kv_batch_put(keys[:10], pid, td[:10])
    tq.kv_clear(keys[:10], pid)
    time.sleep(1.5)
    idle = _rss(upid)
    tq.kv_batch_put(keys, pid, td)
    live = n * row
    rss = _settles_below(upid, idle + live * 1.3, timeout=5.0)
    assert rss <= idle + live * 1.3, (
        f"{live / MiB:.0f} MiB of 5 KB rows hold {(rss - idle) / MiB:.0f} MiB in the unit")
    assert torch.equal(tq.kv_batch_get(keys[-3:], pid)["x"], td[-3:]["x"])
