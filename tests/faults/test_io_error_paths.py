"""I/O errors while writing a dump name the file they happened on (issue 12, item 7).

``os.write``/``writev``/``fsync`` fail on a descriptor and their OSError names no path; the
dump writer re-raises them with the same errno and the shard / index / manifest / directory
path, so an operator seeing ENOSPC knows which filesystem filled up.
"""
from __future__ import annotations

import errno
import os
import re

import pytest

import tqtx as tq
from buffers import rollout_batch
from iofaults import IOFaults
from tqtx import format as fmt
from tqtx.dump import save
from tqtx.testing import InProcessDeployment

KEYS = [f"e{i}" for i in range(8)]
ENOSPC = os.strerror(errno.ENOSPC)


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = InProcessDeployment(2, tmp_path_factory.mktemp("io-paths") / "state", timeout=20)
    d.activate()
    keys, td, tags = rollout_batch(len(KEYS))
    tq.kv_batch_put(KEYS, "p", td, tags=tags)
    yield d
    d.stop()


def _named_paths(message: str) -> list[str]:
    return re.findall(r"'(/[^']+)'", message)


@pytest.mark.parametrize("via", ["units", "client"])
@pytest.mark.parametrize("op,k", [("writev", 1), ("write", 1), ("write", 3), ("fsync-file", 1),
                                  ("fsync-file", 3), ("fsync-dir", 2)])
def test_dump_enospc_names_the_file(dep, monkeypatch, tmp_path, via, op, k):
    dep.activate()
    io = IOFaults(monkeypatch, tmp_path)
    io.arm(op, k, errno.ENOSPC, False)
    try:
        with pytest.raises(OSError) as ei:
            save.dump_data_by_key(dep.client, tmp_path / "d", KEYS, "p", via=via)
    finally:
        io.disarm()
    assert io.injected, f"no {op} #{k} under {tmp_path}"
    message = str(ei.value)
    assert ENOSPC in message and f"[Errno {errno.ENOSPC}]" in message, message
    paths = _named_paths(message)
    assert paths and all(p.startswith(str(tmp_path)) for p in paths), message
    if via == "client":  # raised in this process: the errno itself is kept
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == paths[0]


def test_shard_writer_error_keeps_errno_and_names_the_shard(monkeypatch, tmp_path):
    def full(fd, bufs):
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(os, "writev", full)
    path = tmp_path / "unit-0.bin"
    with pytest.raises(OSError) as ei:
        with fmt.ShardWriter(path) as w:
            w.write_rows([(0, {"x": b"payload"}, 1, "p", "k")])
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value.__cause__, OSError)
    assert ei.value.filename == str(path) and "writing shard" in str(ei.value)
    assert not path.exists()  # aborted


def test_index_write_error_names_the_index(monkeypatch, tmp_path):
    real_fsync = os.fsync

    def eio(fd):
        if os.path.realpath(f"/proc/self/fd/{fd}").endswith(".index"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError) as ei:
        fmt.write_shard_index(tmp_path, 3, [])
    assert ei.value.errno == errno.EIO
    assert ei.value.filename == str(tmp_path / fmt.shard_index_name(3))
