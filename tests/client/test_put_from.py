"""Same-host puts (tqtx.client.put_from): the client names a put's tensor rows by address,
a unit reads them out of that process (process_vm_readv into this very process here) into
buffers of its own, and refuses inboxes it cannot prove or rows it cannot read."""
from __future__ import annotations

import errno
import types

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tqtx.client import put_from, tensors
from tqtx.layout import fsutil
from tqtx.wire import shm, vmcopy
from tqtx.wire.values import TensorColumn

pytestmark = pytest.mark.skipif(not vmcopy.available(), reason="needs process_vm_readv")


def _client():
    return types.SimpleNamespace(put_from_refused={})


def _batch(kind: str, n: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "dense":
        return torch.rand(n, 3, 7, generator=g)
    if kind == "scalar":
        return torch.rand(n, generator=g)
    lengths = torch.randint(0, 30, (n,), generator=g)
    if kind == "narrowed":  # a non-contiguous jagged tensor: lengths() set, rows apart
        base = torch.randint(0, 1000, (n, 40, 2), generator=g)
        starts = torch.randint(0, 10, (n,), generator=g)
        return torch.nested.narrow(base, 1, starts, lengths, layout=torch.jagged)
    rows = [torch.randint(0, 1000, (int(k), 2), generator=g) for k in lengths]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _column(kind: str, n: int):
    """The put's columns of one field ``x``, as kv_batch_put splits them."""
    td = TensorDict({"x": _batch(kind, n)}, batch_size=[n])
    return td, tensors.columns_from_tensordict(td, n)


def _request(columns: dict, positions: list) -> dict:
    rows = [columns["x"][p] for p in positions]
    return {"idx": list(positions), "gens": [1] * len(positions),
            "cols": {"x": TensorColumn(rows[0].dtype, rows)}}


@pytest.mark.parametrize("kind", ["dense", "jagged", "narrowed", "scalar"])
def test_row_addresses_from_the_split_match_the_rows_buffers(kind):
    _, columns = _column(kind, 50)
    rows = columns["x"]
    assert isinstance(rows, tensors.TensorRows)
    addresses, sizes = rows.where()
    assert list(sizes) == [r.data.nbytes for r in rows]
    # the vectorized addresses are those the rows' own buffers report (empty rows aside)
    own = vmcopy.addresses([r.data for r in rows])
    assert [a for a, r in zip(addresses, rows) if r.data.nbytes] == \
        [a for a, r in zip(own, rows) if r.data.nbytes]
    assert rows.where()[0] is addresses  # computed once


@pytest.mark.parametrize("kind", ["dense", "jagged", "narrowed", "scalar"])
def test_a_unit_reads_the_rows_of_a_same_host_put_into_its_own_buffers(inbox, monkeypatch,
                                                                       kind):
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    n = 2 * fsutil.IOV_MAX + 9  # more rows than one system call takes
    td, columns = _column(kind, n)
    positions = list(range(1, n, 2))
    req = _request(columns, positions)
    sent = put_from.by_address(_client(), 0, req, inbox.hint_for("p"), columns, positions)
    assert sent["cols"] == {"x": None} and set(sent["from"]["cols"]) == {"x"}
    assert sent["idx"] == positions and req["cols"]["x"] is not None  # req left as it was
    files = shm.ReplyFiles(0)
    got = files.read_from(sent["from"]["hint"], sent["from"]["cols"])["x"]
    assert files.reads == 1
    want = [columns["x"][p] for p in positions]
    assert [(r.dtype, r.shape) for r in got] == [(w.dtype, w.shape) for w in want]
    assert [bytes(r.data) for r in got] == [bytes(w.data) for w in want]
    before = [bytes(r.data) for r in got]
    src = td.get("x")
    (src.values() if src.is_nested else src).add_(1)  # the unit's rows are its own copy
    assert [bytes(r.data) for r in got] == before


def test_a_column_without_addresses_is_named_row_by_row(inbox, monkeypatch):
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    _, columns = _column("jagged", 40)
    plain = {"x": list(columns["x"])[::3]}  # a sub-put's columns: plain lists
    positions = list(range(len(plain["x"])))
    sent = put_from.by_address(_client(), 1, _request(plain, positions), inbox.hint_for("p"),
                               plain, positions)
    got = shm.ReplyFiles(1).read_from(sent["from"]["hint"], sent["from"]["cols"])["x"]
    assert [bytes(r.data) for r in got] == [bytes(r.data) for r in plain["x"]]


def test_small_requests_and_refusing_units_get_frames(inbox, monkeypatch):
    _, columns = _column("dense", 30)
    positions = list(range(30))
    req = _request(columns, positions)
    hint = inbox.hint_for("p")
    client = _client()
    assert put_from.by_address(client, 0, req, hint, columns, positions) is req  # < 1 MiB
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    assert "from" in put_from.by_address(client, 0, req, hint, columns, positions)
    replies = {0: {"from_failed": "unit 0: no proven client"}, 1: {"rows": 30}}
    again = put_from.refused(client, {0: req, 1: req}, replies)
    assert again == {0: req} and client.put_from_refused == {0: "unit 0: no proven client"}
    assert put_from.by_address(client, 0, req, hint, columns, positions) is req
    assert "from" in put_from.by_address(client, 1, req, hint, columns, positions)


def test_read_from_refuses_what_it_cannot_prove_or_read(inbox, tmp_path):
    files = shm.ReplyFiles(0)
    hint = inbox.hint_for("p")
    buf = np.arange(16, dtype=np.int64)
    good = ["int64", [[16]], vmcopy.addresses([memoryview(buf)]).tobytes()]
    assert bytes(files.read_from(hint, {"x": good})["x"][0].data) == buf.tobytes()
    with pytest.raises(OSError):  # another token: not the inbox's process
        files.read_from(dict(hint, token="0" * 32), {"x": good})
    with pytest.raises(OSError) as exc:  # an address not mapped in that process
        files.read_from(hint, {"x": ["int64", [[16]], np.array([8], np.uint64).tobytes()]})
    assert exc.value.errno == errno.EFAULT
    for spec in (["int64", [[16], [2]], good[2]],          # two shapes, one address
                 ["nope", [[16]], good[2]],                # unknown dtype
                 ["int64", [[-1]], good[2]],               # negative dimension
                 ["int64", [[16]], b"123"],                # not whole addresses
                 ["int64", [[16]]]):                       # no addresses
        with pytest.raises(ValueError):
            files.read_from(hint, {"x": spec})
    with pytest.raises(ValueError):
        files.read_from(hint, "x")
    assert files.reads == 1
