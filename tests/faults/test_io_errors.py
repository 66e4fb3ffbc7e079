"""I/O errors at every position of a dump and of a restore (issue "Prove it", part 3).

Everything runs in this process (:class:`tqtx.testing.InProcessDeployment`), so patched
``os`` functions are seen by the client, the units' worker threads and the publication.
For each operation a clean run first counts the calls (under the test's tmp dir only);
then the k-th call fails with ENOSPC or EIO, once or from then on ("persistent"), for every
k. After each attempt the fault is removed and the next access must find the old dump
intact (or, for a restore, nothing visible), the journals final and nothing left behind.
"""
from __future__ import annotations

import os

import filelock
import pytest
import torch

import tqtx as tq
from buffers import assert_same_rows, rollout_batch
from iofaults import ERRNOS, IOFaults
from tqtx import format as fmt
from tqtx.dump import load, save
from tqtx.journal.dump import DumpJournal
from tqtx.testing import InProcessDeployment

DUMP_OPS = ["write", "writev", "fsync-file", "fsync-dir", "rename", "replace", "mkdir"]
MODES = ["once", "persistent"]
N = 12
KEYS = [f"s{i}" for i in range(N)]
OLD, NEW = KEYS[:5], KEYS[5:]


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = InProcessDeployment(2, tmp_path_factory.mktemp("io-state") / "state", timeout=20)
    d.activate()
    keys, td, tags = rollout_batch(N)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    d.reference = tq.kv_batch_get(keys, "p")
    yield d
    d.stop()
    assert not d.alive()


@pytest.fixture
def io(monkeypatch, tmp_path, dep):
    dep.activate()
    f = IOFaults(monkeypatch, tmp_path)
    yield f
    f.disarm()


def _siblings(d):
    parent, name = os.path.split(str(d))
    return sorted(x for x in os.listdir(parent) if x.startswith(name + ".tmp-")
                  or x == name + ".old")


def _lock_free(d):
    lock = filelock.FileLock(str(d) + ".lock")
    lock.acquire(timeout=0)
    lock.release()


def _errno_text(exc: BaseException) -> str:
    parts, e = [], exc
    while e is not None:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def _typed(exc: BaseException, err: int) -> bool:
    from tqtx.errors import DumpFormatError
    return isinstance(exc, (OSError, DumpFormatError, RuntimeError)) and \
        os.strerror(err) in _errno_text(exc)


# --------------------------------------------------------------------------- dump
def _count_dump(dep, io, root) -> dict:
    d = root / "probe"
    save.dump_data_by_key(dep.client, d, OLD, "p")
    io.count_only()
    save.dump_data_by_key(dep.client, d, NEW, "p")
    counts = dict(io.counts)
    io.disarm()
    return counts


def _dump_attempt(dep, io, d, op, k, err, persistent) -> list[str]:
    """One failing dump over an existing one; returns the invariant violations."""
    problems = []
    old = save.dump_data_by_key(dep.client, d, OLD, "p")
    io.arm(op, k, err, persistent)
    exc = None
    try:
        save.dump_data_by_key(dep.client, d, NEW, "p")
    except BaseException as e:  # noqa: BLE001 - classified below
        exc = e
    finally:
        io.disarm()
    injected = list(io.injected)
    where = f"{op}#{k} {os.strerror(err)} {'persistent' if persistent else 'once'}"
    if not injected:
        return [f"{where}: the fault never fired"]
    benign = all(i["op"] == "mkdir" and i["existed"] for i in injected)
    # next access: takes the lock and replays the dump journal
    idx = tq.read_row_index(d)
    if exc is None:
        if not benign:
            problems.append(f"{where}: dump reported success although {injected[0]} failed")
        elif idx["dump_id"] == old["dump_id"]:
            problems.append(f"{where}: dump succeeded but the old dump is still in place")
    else:
        if not _typed(exc, err):
            problems.append(f"{where}: untyped error {_errno_text(exc)}")
        if idx["dump_id"] != old["dump_id"] or list(idx["rows"]) != OLD:
            problems.append(f"{where}: old dump replaced after a failed dump")
    v = fmt.verify_dump(d)
    if not v["ok"]:
        problems.append(f"{where}: dump does not verify: {v['errors'][:2]}")
    if _siblings(d):
        problems.append(f"{where}: leftovers {_siblings(d)}")
    with DumpJournal(d) as dj:
        pubs = dj.publications()
    if [p for p in pubs if p["phase"] not in ("cleaned", "failed", "rolled-back")]:
        problems.append(f"{where}: unfinished publication {pubs}")
    if exc is not None:
        attempts = [p for p in pubs if p["dump_id"] != old["dump_id"]]
        if any(p["phase"] == "cleaned" for p in attempts):
            problems.append(f"{where}: failed dump journaled as cleaned")
        staging_mkdir = any(i["op"] == "mkdir" and os.path.basename(i["detail"]).startswith(
            os.path.basename(str(d)) + ".tmp-") for i in injected)
        if not attempts and not staging_mkdir:  # no attempt row before its staging dir
            problems.append(f"{where}: failure not journaled")
    _lock_free(d)
    return problems


def _dump_matrix(dep, io, tmp_path, ops, errnos, modes, sample=None):
    counts = _count_dump(dep, io, tmp_path)
    problems, positions = [], 0
    for op in ops:
        total = counts.get(op, 0)
        assert total > 0, f"a clean dump makes no {op} call under {tmp_path}: {counts}"
        ks = range(1, total + 1)
        if sample:
            ks = sorted({1, total, *range(1, total + 1, max(1, total // sample))})
        for ename in errnos:
            for mode in modes:
                for k in ks:
                    d = tmp_path / f"d-{op}-{ename}-{mode}-{k}"
                    problems += _dump_attempt(dep, io, d, op, k, ERRNOS[ename],
                                              mode == "persistent")
                    positions += 1
    return problems, positions, counts


@pytest.mark.parametrize("op", [o for o in DUMP_OPS if o != "fsync-dir"])
def test_dump_io_error_at_every_position(dep, io, tmp_path, op):
    problems, positions, counts = _dump_matrix(dep, io, tmp_path, [op], list(ERRNOS), MODES)
    print(f"{op}: {positions} failing positions (clean dump counts {counts})")
    assert not problems, "\n".join(problems)


def test_dump_directory_fsync_error_fails_the_dump(dep, io, tmp_path):
    problems, positions, counts = _dump_matrix(dep, io, tmp_path, ["fsync-dir"], ["EIO"],
                                               ["once"])
    assert not problems, "\n".join(problems)


def test_fsync_error_is_never_retried_into_success(dep, io, tmp_path):
    """The first data-file fsync of a dump fails once: the dump fails, it does not retry."""
    counts = _count_dump(dep, io, tmp_path)
    for k in range(1, counts["fsync-file"] + 1):
        d = tmp_path / f"f{k}"
        old = save.dump_data_by_key(dep.client, d, OLD, "p")
        io.arm("fsync-file", k, ERRNOS["EIO"], False)
        try:
            with pytest.raises((OSError, RuntimeError)) as ei:
                save.dump_data_by_key(dep.client, d, NEW, "p")
        finally:
            io.disarm()
        assert os.strerror(ERRNOS["EIO"]) in _errno_text(ei.value)
        # the failing call was made exactly once (no retry of that fsync into success)
        assert [i["n"] for i in io.injected] == [k]
        assert tq.read_row_index(d)["dump_id"] == old["dump_id"]


# --------------------------------------------------------------------------- restore
def _restore_attempt(dep, io, dump, pid, k, err, persistent) -> list[str]:
    problems = []
    where = f"pread#{k} {os.strerror(err)} {'persistent' if persistent else 'once'}"
    # s1 already lives in the target partition with other values: it must stay so
    tq.kv_put("s1", pid, {"obs": torch.full((4,), 3.0)}, tag={"status": "mine"})
    io.arm("pread", k, err, persistent)
    exc = None
    try:
        load.load_data_by_key(dep.client, dump, partition_id=pid)
    except BaseException as e:  # noqa: BLE001
        exc = e
    finally:
        io.disarm()
    if not io.injected:
        return [f"{where}: the fault never fired"]
    if exc is None:
        return [f"{where}: restore reported success although a read failed"]
    if not _typed(exc, err):
        problems.append(f"{where}: untyped error {_errno_text(exc)}")
    listed = set(tq.kv_list(pid).get(pid, {}))
    if listed != {"s1"}:
        problems.append(f"{where}: keys visible after a failed restore: {sorted(listed)}")
    got = tq.kv_batch_get(["s1"], pid)
    if not torch.equal(got["obs"][0], torch.full((4,), 3.0)) or tq.kv_list(pid)[pid]["s1"] != \
            {"status": "mine"}:
        problems.append(f"{where}: existing key changed by a failed restore")
    recs = [r for r in dep.controller.journal.list_restores() if r["partition_id"] == pid]
    if [r["state"] for r in recs] != ["aborted"]:
        problems.append(f"{where}: controller journal {[r['state'] for r in recs]}")
    with DumpJournal(dump) as dj:
        if dj.active_restores():
            problems.append(f"{where}: dump journal still reading")
    if [s["staged_restores"] for s in dep.unit_stats()] != [[]] * dep.num_units:
        problems.append(f"{where}: staged rows left in units")
    if dep.controller.restores:
        problems.append(f"{where}: controller keeps an open restore")
    # the partition is not blocked: the same load now succeeds
    load.load_data_by_key(dep.client, dump, partition_id=pid)
    assert_same_rows(dep.reference[5:], tq.kv_batch_get(NEW, pid), NEW)
    return problems


def _restore_matrix(dep, io, tmp_path, errnos, modes):
    dump = tmp_path / "dump"
    save.dump_data_by_key(dep.client, dump, NEW, "p")
    io.count_only()
    load.load_data_by_key(dep.client, dump, partition_id="count")
    total = io.counts["pread"]
    io.disarm()
    assert total >= len(NEW)
    problems, positions = [], 0
    for ename in errnos:
        for mode in modes:
            for k in range(1, total + 1):
                pid = f"r-{ename}-{mode}-{k}"
                problems += _restore_attempt(dep, io, dump, pid, k, ERRNOS[ename],
                                             mode == "persistent")
                positions += 1
    assert fmt.verify_dump(dump)["ok"]
    _lock_free(dump)
    return problems, positions


def test_restore_io_error_at_every_read(dep, io, tmp_path):
    problems, positions = _restore_matrix(dep, io, tmp_path, list(ERRNOS), MODES)
    print(f"restore: {positions} failing read positions")
    assert not problems, "\n".join(problems)
