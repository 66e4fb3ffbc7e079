"""kv_batch_get on one host with real unit processes, both ways: units copying rows straight
into the client's result (GET_INTO) and reply files: exact values for every column kind,
the result is the client's own memory, no file is left behind, rows overwritten while
gets run come back whole, and the paths can be turned off. Dense columns are compared, so
in strict mode, except the test of TransferQueue's (the default) layout."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq
from buffers import same_host_batch as _batch
from tqtx.client import semantics

pytestmark = pytest.mark.strict


def _unit_files() -> list[int]:
    return [u["reply_files"] for u in tq.get_client().stats()["units"]]


def _unit_copies() -> list[int]:
    return [u["result_copies"] for u in tq.get_client().stats()["units"]]


def _used(path: str) -> list[int]:
    """Per unit, how often it took the same-host ``path`` ("into" or "files")."""
    return _unit_copies() if path == "into" else _unit_files()


def _check(got, td, jag, idx):
    assert torch.equal(got["dense"], td["dense"][idx])
    assert torch.equal(got["reward"], td["reward"][idx])
    assert all(torch.equal(a, jag[i]) for a, i in zip(got["tokens"].unbind(), idx))
    assert list(got["text"]) == [f"sample {i}" for i in idx]


@pytest.fixture(params=["into", "files"])
def files_on(request, monkeypatch, tq_start):
    monkeypatch.setenv("TQTX_SHM_MIN_BYTES", "0")  # units read it at start
    monkeypatch.setenv("TQTX_SHM_RESERVE_BYTES", "0")
    monkeypatch.setenv("TQTX_GET_INTO", "on" if request.param == "into" else "off")
    tq_start(3)
    return request.param


def test_same_host_get_is_exact_and_leaves_nothing(files_on, pid):
    n = 60
    td, jag = _batch(n, 1)
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, pid, td)
    got = tq.kv_batch_get(keys, pid)
    _check(got, td, jag, list(range(n)))
    assert all(f >= 1 for f in _used(files_on))
    assert not any(_used("files" if files_on == "into" else "into"))
    sub = [41, 0, 7, 59, 3]
    _check(tq.kv_batch_get([keys[i] for i in sub], pid), td, jag, sub)
    part = tq.kv_batch_get(keys[:9], pid, select_fields=["tokens", "text"])
    assert set(part.keys()) == {"tokens", "text"}
    inbox = tq.get_client().reply_inbox()
    assert os.listdir(inbox.dir) == [".tqtx-get-probe"]  # every reply file was unlinked
    # the result is the client's own memory: an overwrite on the units changes nothing in
    # it, and writing into it changes nothing on the units
    td2, _ = _batch(n, 2)
    tq.kv_batch_put(keys, pid, td2)
    _check(got, td, jag, list(range(n)))
    got["dense"][0] = -1.0
    got["tokens"].values()[:5] = -7
    assert torch.equal(tq.kv_batch_get(keys, pid)["tokens"].unbind()[0],
                       td2["tokens"].unbind()[0])
    assert torch.equal(tq.kv_batch_get(keys, pid)["dense"], td2["dense"])
    tq.close()
    assert not os.path.exists(inbox.dir)


def test_transferqueue_layout_takes_the_same_host_path_too(files_on, pid):
    n = 12
    td, jag = _batch(n, 3)
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, pid, td)
    semantics.configure(strict=False)
    try:
        got = tq.kv_batch_get(keys + ["missing"], pid)
    finally:
        semantics.configure()
    assert got.batch_size[0] == n
    assert all(torch.equal(a, b) for a, b in zip(got["dense"].unbind(), td["dense"].unbind()))
    assert all(torch.equal(a, b) for a, b in zip(got["tokens"].unbind(), jag))
    assert all(f >= 1 for f in _used(files_on))


def test_rows_overwritten_while_gets_run_come_back_whole(files_on, pid):
    """A put between a get's two steps changes row shapes: the get asks again, and every
    row comes back as one version, every field of it (a row's fields carry its version)."""
    n, rounds = 24, 40
    keys = [f"k{i}" for i in range(n)]

    def version(v: int):
        lens = [50 + (i * 37 + v * 101) % 300 for i in range(n)]
        return TensorDict({
            "tokens": torch.nested.nested_tensor(
                [torch.full((k,), v, dtype=torch.int64) for k in lens], layout=torch.jagged),
            "ver": torch.full((n, 4), float(v)),
            "text": NonTensorStack(*[f"v{v}" for _ in range(n)]),
        }, batch_size=[n])

    tq.kv_batch_put(keys, pid, version(0))
    stop, errors = threading.Event(), []

    def writer():
        v = 1
        try:
            while not stop.is_set() and v <= 400:
                tq.kv_batch_put(keys, pid, version(v))
                v += 1
        except Exception as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(rounds):
            got = tq.kv_batch_get(keys, pid)
            for i, tok in enumerate(got["tokens"].unbind()):
                v = int(got["ver"][i, 0])
                assert bool((got["ver"][i] == v).all()) and got["text"][i] == f"v{v}"
                assert len(tok) == 50 + (i * 37 + v * 101) % 300 and bool((tok == v).all())
    finally:
        stop.set()
        t.join(60)
    assert not errors


def test_turned_off_means_frames(monkeypatch, tq_start, pid):
    monkeypatch.setenv("TQTX_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("TQTX_SHM_DIR", "off")
    tq_start(2)
    n = 20
    td, jag = _batch(n, 4)
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, pid, td)
    _check(tq.kv_batch_get(keys, pid), td, jag, list(range(n)))
    assert _unit_files() == [0, 0] and _unit_copies() == [0, 0]
    assert tq.get_client().reply_inbox() is None


def test_small_gets_stay_on_frames(tq_start, pid):
    tq_start(2)  # default floor: 1 MiB of tensor bytes per unit reply
    td, jag = _batch(10, 5)
    keys = [f"k{i}" for i in range(10)]
    tq.kv_batch_put(keys, pid, td)
    _check(tq.kv_batch_get(keys, pid), td, jag, list(range(10)))
    assert _unit_files() == [0, 0] and _unit_copies() == [0, 0]
    big = torch.rand(8, 1 << 17)  # 4 MiB: 2 MiB per unit
    tq.kv_batch_put([f"b{i}" for i in range(8)], pid, TensorDict({"x": big}, batch_size=[8]))
    assert torch.equal(tq.kv_batch_get([f"b{i}" for i in range(8)], pid)["x"], big)
    assert _unit_copies() == [1, 1] and _unit_files() == [0, 0]
