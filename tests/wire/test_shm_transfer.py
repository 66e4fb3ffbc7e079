"""The same-host reply files (tqtx.wire.shm, tqtx.storage.replies) and the client's
direct assembly from them, without processes."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from tqtx.layout import fsutil
from tqtx.client import tensors
from tqtx.process.pids import process_started
from tqtx.client import Column
from tqtx.storage.replies import reply_columns
from tqtx.wire import shm
from tqtx.wire.values import RawTensor


@pytest.fixture(autouse=True)
def no_reserve(monkeypatch):
    """The inboxes here live in tmp_path, on whatever disk the host has: its free share is
    not this test's business (one test sets the reserve itself)."""
    monkeypatch.setattr(shm, "RESERVE_BYTES", 0)
    monkeypatch.setattr(shm, "RESERVE_SHARE", 0.0)


def _raw(t: torch.Tensor) -> RawTensor:
    return tensors.to_raw(t)


def test_inbox_is_private_and_named_for_its_process(inbox, tmp_path):
    assert os.path.dirname(inbox.dir) == str(tmp_path)
    assert os.stat(inbox.dir).st_mode & 0o777 == 0o700
    name = os.path.basename(inbox.dir)
    assert name.startswith(f"{shm.PREFIX}{os.getpid()}-")
    with open(os.path.join(inbox.dir, shm.PROBE)) as f:
        assert f.read() == inbox.token
    inbox.close()
    assert not os.path.exists(inbox.dir)


def test_a_unit_uses_only_an_inbox_it_can_prove(inbox, tmp_path):
    files = shm.ReplyFiles(0)
    hint = inbox.hint_for("abc")
    assert files.usable(hint)
    assert not files.usable(dict(hint, token="0" * 32))          # another token
    assert not files.usable(dict(hint, dir=str(tmp_path)))      # not an inbox name
    assert not files.usable(dict(hint, dir=inbox.dir + "x"))    # no such directory
    assert not files.usable(None) and not files.usable("x")
    inbox.close()
    assert not files.usable(hint)  # a known inbox that is gone


def test_write_and_read_back_more_buffers_than_one_syscall_takes(inbox):
    files = shm.ReplyFiles(3)
    bufs = [memoryview(os.urandom(1 + (i * 37) % 300)) for i in range(2 * fsutil.IOV_MAX + 5)]
    total = sum(b.nbytes for b in bufs)
    name = files.write(inbox.hint_for("g1"), bufs, total)
    assert name.startswith("g1-u3-") and files.files == 1
    fd = inbox.open_reply(name)
    try:
        assert not os.path.exists(os.path.join(inbox.dir, name))  # unlinked at once
        out = [memoryview(bytearray(b.nbytes)) for b in bufs]
        fsutil.preadv_all(fd, list(out), 0)
    finally:
        os.close(fd)
    assert [bytes(o) for o in out] == [bytes(b) for b in bufs]


def test_write_refuses_when_the_ram_file_system_would_run_low(inbox, monkeypatch):
    files = shm.ReplyFiles(0)
    monkeypatch.setattr(shm, "RESERVE_BYTES", 1 << 62)
    assert files.write(inbox.hint_for("g2"), [memoryview(b"x" * 10)], 10) is None
    monkeypatch.setattr(shm, "RESERVE_BYTES", 0)
    monkeypatch.setattr(shm, "RESERVE_SHARE", 1.0)  # all of it must stay free
    assert files.write(inbox.hint_for("g2"), [memoryview(b"x" * 10)], 10) is None
    assert os.listdir(inbox.dir) == [shm.PROBE]
    monkeypatch.setattr(shm, "RESERVE_SHARE", 0.0)
    assert files.write(dict(inbox.hint_for("g2"), get="../x"), [memoryview(b"x")], 1) is None


def test_discard_get_removes_only_that_gets_files(inbox):
    files = shm.ReplyFiles(0)
    a = files.write(inbox.hint_for("aaa"), [memoryview(b"1")], 1)
    b = files.write(inbox.hint_for("bbb"), [memoryview(b"2")], 1)
    inbox.discard_get("aaa")
    assert sorted(os.listdir(inbox.dir)) == sorted([shm.PROBE, b]) and a not in os.listdir(inbox.dir)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_only_inboxes_of_dead_processes_it_made(tmp_path):
    root = str(tmp_path)

    def make(name, probe=True):
        path = os.path.join(root, name)
        os.mkdir(path)
        if probe:
            open(os.path.join(path, shm.PROBE), "w").close()
            open(os.path.join(path, "g-u0-1"), "w").close()
        return path

    dead = _dead_pid()
    me = os.getpid()
    gone = make(f"{shm.PREFIX}{dead}-123-aaaa")
    reused = make(f"{shm.PREFIX}{me}-1-bbbb")            # our pid, another start time
    live = make(f"{shm.PREFIX}{me}-{process_started(me)}-cccc")
    foreign = make(f"{shm.PREFIX}{dead}-123-dddd", probe=False)  # not made by tqtx
    other = make(f"other-{dead}-123-eeee")
    odd = make(f"{shm.PREFIX}{dead}-x")
    os.symlink(live, os.path.join(root, f"{shm.PREFIX}{dead}-5-ffff"))
    removed = shm.sweep_stale(root)
    assert sorted(removed) == sorted([gone, reused])
    for kept in (live, foreign, other, odd, os.path.join(root, f"{shm.PREFIX}{dead}-5-ffff")):
        assert os.path.lexists(kept)
    assert os.listdir(live)  # the live inbox's files are untouched


def test_reply_columns_writes_big_tensor_columns_and_keeps_the_rest_in_the_message(inbox, monkeypatch):
    monkeypatch.setattr(shm, "MIN_BYTES", 1000)
    files = shm.ReplyFiles(1)
    dense = [_raw(torch.full((100,), float(i))) for i in range(5)]
    text = ["a", "b", "c", "d", "e"]
    small = [_raw(torch.tensor([i])) for i in range(5)]
    hint = inbox.hint_for("g3")
    rep = reply_columns([dense, text, small], hint, files)
    assert "file" in rep and rep["file_bytes"] == 5 * 400 + 5 * 8
    assert rep["columns"][0]["s"][0] == "float32" and rep["columns"][0]["s"][2] == 0
    assert rep["columns"][1] == {"v": text}
    assert rep["columns"][2]["s"][2] == 2000
    inbox.discard_get("g3")
    # under the size floor, or for a client the unit cannot see: frames
    assert "file" not in reply_columns([small], hint, files)
    rep = reply_columns([dense], dict(hint, token="0" * 32), files)
    assert "file" not in rep and "p" in rep["columns"][0]
    assert "file" not in reply_columns([dense], None, None)


def _file_column(inbox, rows_by_unit: dict, n: int, monkeypatch) -> tuple[Column, list]:
    """A Column as the client builds it: unit u's rows (positions -> tensor) in a reply
    file, except unit "mem" whose rows are in-message RawTensors."""
    monkeypatch.setattr(shm, "MIN_BYTES", 0)
    col, opened = Column([None] * n), []
    for u, rows in rows_by_unit.items():
        pos = sorted(rows)
        if u == "mem":
            for p in pos:
                col[p] = _raw(rows[p])
            continue
        hint = inbox.hint_for(f"g{u}")
        rep = reply_columns([[_raw(rows[p]) for p in pos]], hint, shm.ReplyFiles(u))
        f = shm.ReplyFile(inbox.open_reply(rep["file"]))
        opened.append(f)
        dtype, shapes, offset = rep["columns"][0]["s"]
        col.chunks.append((pos, shm.FileRows(dtype, shapes, f, offset)))
    return col, opened


@pytest.mark.parametrize("kind", ["dense", "jagged", "ragged trailing dims"])
def test_direct_assembly_from_files_and_message_rows(inbox, monkeypatch, kind):
    g = torch.Generator().manual_seed(4)
    n = 11
    if kind == "dense":
        rows = [torch.rand(3, 4, generator=g) for _ in range(n)]
    elif kind == "jagged":
        rows = [torch.randint(0, 100, (int(k), 2), generator=g) for k in
                torch.randint(0, 50, (n,), generator=g)]
    else:
        rows = [torch.rand(3, 2, generator=g) if i % 2 else torch.rand(2, 5, generator=g)
                for i in range(n)]  # no jagged layout: read into rows of their own
    by_unit = {0: {}, 1: {}, "mem": {}}
    for i, r in enumerate(rows):
        by_unit[[0, 1, "mem"][i % 3]][i] = r
    col, opened = _file_column(inbox, by_unit, n, monkeypatch)
    try:
        out = tensors.assemble_column(col, {"kind": "tensor"})
    finally:
        for f in opened:
            f.close()
    got = list(out.unbind(0))
    assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, rows))
    if kind == "dense":
        assert not out.is_nested and torch.equal(out, torch.stack(rows))
    if kind == "jagged":
        assert out.is_nested and out.layout == torch.jagged


def test_a_forked_child_never_removes_its_parents_inbox(inbox):
    inbox.pid = -1  # as seen from a child that inherited the object
    inbox.close()
    assert os.path.isdir(inbox.dir)
    inbox.pid = os.getpid()


class _Fanout:
    """A client for get_path.read_rows whose units answer with plain values; ``stray`` has
    a unit leave a reply file of the get behind and re-register at a new address (it died
    after writing it and was asked again)."""

    def __init__(self, inbox, stray: bool):
        self.inbox, self.stray = inbox, stray
        self.num_units, self.unit_generation, self.counted = 2, 0, []

    def reply_inbox(self):
        return self.inbox

    def unit(self, u):
        return types.SimpleNamespace(bytes_received=0, header_bytes_received=0)

    def count(self, *args):
        self.counted.append(args)

    def fan_out(self, op, per_unit):
        hint = next(iter(per_unit.values()))["shm"]
        if self.stray:
            with open(os.path.join(self.inbox.dir, f"{hint['get']}-u0-dead"), "wb") as f:
                f.write(b"rows of the unit that died")
            self.unit_generation += 1
        return {u: {"columns": [{"v": list(body["indexes"])}]} for u, body in per_unit.items()}


@pytest.mark.parametrize("stray", [False, True])
def test_a_get_removes_a_file_left_by_a_unit_asked_again(inbox, stray):
    from tqtx.client import get_path
    client = _Fanout(inbox, stray)
    meta = {"fields": ["x"], "indexes": [0, 1, 2, 3], "gens": [1, 1, 1, 1], "schemas": {}}
    keys, columns, _ = get_path.read_rows(client, meta, ["a", "b", "c", "d"], True, None)
    assert list(columns["x"]) == [0, 1, 2, 3]
    assert os.listdir(inbox.dir) == [shm.PROBE]
