"""Same-host gets copied straight into the client (GET_INTO): the layout plan, the unit's
copy (process_vm_writev into this very process) and its checks, the changed-rows and
refused-copy answers, and the client's second step with a stand-in for the units."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tqtx.layout import fsutil
from tqtx.client import result_layout, tensors
from tqtx.client import Column
from tqtx.storage.replies import into_reply, reply_columns
from tqtx.wire import shm, vmcopy
from tqtx.wire.columns import pack_int64

pytestmark = pytest.mark.skipif(not vmcopy.available(), reason="needs process_vm_writev")


def _raw(t):
    return tensors.to_raw(t)


def _rows(kind: str, n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    if kind == "dense":
        return [torch.rand(3, 4, generator=g) for _ in range(n)]
    if kind == "jagged":
        return [torch.randint(0, 100, (int(k), 2), generator=g)
                for k in torch.randint(0, 40, (n,), generator=g)]
    return [torch.tensor(float(i)) for i in range(n)]  # scalars


def _split(rows, units: int):
    positions = {u: list(range(u, len(rows), units)) for u in range(units)}
    return positions, {u: [_raw(rows[p]) for p in pos] for u, pos in positions.items()}


class _Units:
    """Stand-in for a client's fan-out: units answer from their rows like real ones."""

    def __init__(self, by_unit, inbox, refuse=(), change=()):
        self.by_unit, self.inbox = by_unit, inbox
        self.refuse, self.change = set(refuse), set(change)
        self.files = {u: shm.ReplyFiles(u) for u in by_unit}
        self.into_off, self.into_checked = None, False
        self.unsettled_results = []
        self.sent = []
        self.fail = None

    def get_rows(self, per_unit):
        return {u: reply_columns([self.by_unit[u]], per_unit[u]["shm"], self.files[u])
                for u in per_unit}

    def fan_out(self, op, bodies):
        assert op == "GET_INTO"
        self.sent.append(bodies)
        if self.fail is not None:
            raise self.fail
        out = {}
        for u, body in bodies.items():
            if u in self.refuse:
                def refuse(*a, **k):
                    raise PermissionError(1, "Operation not permitted")
                self.files[u].write_into = refuse
            if u in self.change:
                body = dict(body, digest=body["digest"] + 1)
            out[u] = into_reply([self.by_unit[u]], body, self.files[u])
        return out


def _get(units, positions, n):
    hint = units.inbox.hint_for("g", into=True)
    per_unit = {u: {"indexes": pos, "fields": ["x"], "shm": hint}
                for u, pos in positions.items()}
    replies = units.get_rows(per_unit)
    return result_layout.get_into(units, per_unit, positions, replies, n,
                                  tensors.result_buffer)


def _column(replies, plans, positions, n):
    """The client's placement loop, as Client.get_rows runs it."""
    col = Column([None] * n)
    col.plan = plans[0]
    from tqtx.client import unpack_column
    for u, reply in replies.items():
        c = reply["columns"][0]
        if "i" in c:
            continue
        values = unpack_column(c)
        if plans[0] is not None:
            plans[0].fill(positions[u], values)
        else:
            for p, v in zip(positions[u], values):
                col[p] = v
    return tensors.assemble_column(col, {"kind": "tensor"})


@pytest.mark.parametrize("kind", ["dense", "jagged", "scalar"])
def test_units_copy_rows_into_the_clients_result(inbox, monkeypatch, kind):
    monkeypatch.setattr(shm, "MIN_BYTES", 0)
    rows = _rows(kind, 13)
    positions, by_unit = _split(rows, 3)
    units = _Units(by_unit, inbox)
    replies, plans = _get(units, positions, len(rows))
    assert all(r["columns"][0] == {"i": 1} for r in replies.values())
    out = _column(replies, plans, positions, len(rows))
    assert [u.copies for u in units.files.values()] == [1, 1, 1]
    if kind == "jagged":
        assert out.is_nested and out.layout == torch.jagged
        assert all(torch.equal(a, b) for a, b in zip(out.unbind(), rows))
    else:
        assert not out.is_nested and torch.equal(out, torch.stack(rows))
        out.resize_(0)  # ordinary tensor memory: resizable, as torch.empty gives


def test_a_small_unit_share_travels_in_its_message_and_is_copied_in(inbox, monkeypatch):
    rows = _rows("jagged", 10)
    positions, by_unit = _split(rows, 2)
    need = sum(v.nbytes for v in by_unit[0])
    monkeypatch.setattr(shm, "MIN_BYTES", need)  # unit 0 qualifies, unit 1 (fewer bytes) not
    units = _Units(by_unit, inbox)
    replies, plans = _get(units, positions, len(rows))
    assert replies[0]["columns"][0] == {"i": 1} and "i" not in replies[1]["columns"][0]
    assert list(units.sent[0]) == [0]
    out = _column(replies, plans, positions, len(rows))
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), rows))


def test_rows_changed_between_the_steps_make_the_client_ask_again(inbox, monkeypatch):
    monkeypatch.setattr(shm, "MIN_BYTES", 0)
    rows = _rows("dense", 6)
    positions, by_unit = _split(rows, 2)
    units = _Units(by_unit, inbox, change={1})
    assert _get(units, positions, len(rows)) is None
    assert units.files[0].copies == 1 and units.files[1].copies == 0


def test_a_failed_second_step_keeps_its_buffers_for_late_copies(inbox, monkeypatch):
    """A unit that timed out may still copy later: the buffers it was given stay allocated."""
    monkeypatch.setattr(shm, "MIN_BYTES", 0)
    rows = _rows("dense", 6)
    positions, by_unit = _split(rows, 2)
    units = _Units(by_unit, inbox)
    units.fail = TimeoutError("unit 1 did not answer")
    with pytest.raises(TimeoutError):
        _get(units, positions, len(rows))
    (kept,) = units.unsettled_results
    assert isinstance(kept, torch.Tensor) and kept.numel() == 6 * 12 * 4


def test_a_refused_copy_sends_the_rows_and_turns_the_path_off(inbox, monkeypatch):
    monkeypatch.setattr(shm, "MIN_BYTES", 0)
    rows = _rows("jagged", 9)
    positions, by_unit = _split(rows, 3)
    units = _Units(by_unit, inbox, refuse={2})
    replies, plans = _get(units, positions, len(rows))
    assert "Operation not permitted" in replies[2]["into_failed"]
    assert "i" not in replies[2]["columns"][0] and replies[0]["columns"][0] == {"i": 1}
    assert units.into_off is not None and not result_layout.into_usable(units)
    out = _column(replies, plans, positions, len(rows))
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), rows))


def test_columns_that_make_no_tensor_travel_in_messages(inbox, monkeypatch):
    monkeypatch.setattr(shm, "MIN_BYTES", 0)
    ragged = [torch.rand(3, 2) if i % 2 else torch.rand(2, 5) for i in range(6)]
    positions, by_unit = _split(ragged, 2)
    units = _Units(by_unit, inbox)
    replies, plans = _get(units, positions, len(ragged))
    assert plans == [None] and all("i" not in r["columns"][0] for r in replies.values())
    mixed = {0: [_raw(torch.rand(4))], 1: [_raw(torch.arange(4))]}  # float32 and int64
    units = _Units(mixed, inbox)
    replies, plans = _get(units, {0: [0], 1: [1]}, 2)
    assert plans == [None]
    text = {0: ["a", "b"]}
    hint = inbox.hint_for("g", into=True)
    assert reply_columns([text[0]], hint, shm.ReplyFiles(0)) == {"columns": [{"v": ["a", "b"]}]}


def test_plan_lays_rows_out_in_request_order():
    shapes = {0: [(3,), (1,)], 1: [(2,)]}
    replies = {0: {"layout": [["int32", shapes[0]]]}, 1: {"layout": [["int32", shapes[1]]]}}
    (p,) = result_layout.plan(1, 3, {0: [0, 2], 1: [1]}, replies, {})
    assert p.rest == () and p.lengths.tolist() == [3, 2, 1]
    assert p.starts.tolist() == [0, 12, 20] and p.total == 24
    # a row nobody reported: no plan
    assert result_layout.plan(1, 4, {0: [0, 2], 1: [1]}, replies, {}) == [None]


def _target(buf, offsets):
    return [buf.data_ptr(), buf.numel(), pack_int64(offsets)]


def test_write_into_checks_its_target_and_the_inbox(inbox, tmp_path):
    files = shm.ReplyFiles(0)
    hint = inbox.hint_for("g", into=True)
    buf = torch.zeros(16, dtype=torch.uint8)
    files.write_into(hint, _target(buf, [0, 8]), [memoryview(b"abcdefgh"), memoryview(b"12")])
    assert bytes(buf.numpy()[:10]) == b"abcdefgh12"
    with pytest.raises(ValueError, match="outside"):
        files.write_into(hint, _target(buf, [12]), [memoryview(b"toolong")])
    with pytest.raises(ValueError, match="offsets for"):
        files.write_into(hint, _target(buf, [0, 1]), [memoryview(b"x")])
    with pytest.raises(ValueError, match="malformed"):
        files.write_into(hint, [0, 16, pack_int64([0])], [memoryview(b"x")])
    with pytest.raises(ValueError, match="malformed"):
        files.write_into(hint, "junk", [memoryview(b"x")])
    with pytest.raises(OSError, match="no proven client"):
        files.write_into(dict(hint, token="0" * 32), _target(buf, [0]), [memoryview(b"x")])
    # an inbox whose name says another (here: a finished) process: never written into
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    fake = os.path.join(str(tmp_path), f"{shm.PREFIX}{p.pid}-1-abcd")
    os.mkdir(fake)
    with open(os.path.join(fake, shm.PROBE), "w") as f:
        f.write(inbox.token)
    with pytest.raises(OSError, match="no proven client"):
        shm.ReplyFiles(1).write_into(dict(hint, dir=fake), _target(buf, [0]), [memoryview(b"y")])
    assert bytes(buf.numpy()[:10]) == b"abcdefgh12"


def test_vmcopy_moves_more_rows_than_one_call_takes():
    rows = [os.urandom(1 + (i * 37) % 300) for i in range(2 * fsutil.IOV_MAX + 5)]
    starts = np.cumsum([0] + [len(r) for r in rows[:-1]]).tolist()
    out = torch.zeros(sum(map(len, rows)), dtype=torch.uint8)
    vmcopy.write(os.getpid(), out.data_ptr(), list(zip(starts, rows)))
    assert bytes(out.numpy()) == b"".join(rows)
    with pytest.raises(OSError):
        vmcopy.write(os.getpid(), 8, [(0, b"x" * 64)])  # not this process's memory
