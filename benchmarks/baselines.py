"""What tqtx dump/restore is compared with: the client-side path (V1) and the disk floor.

V1 is what a trainer did before tqtx: ``kv_batch_get`` + ``torch.save`` to one file (and
``torch.load`` + ``kv_batch_put`` back). The floor is one process writing or reading the
same number of bytes with plain ``os.write`` / ``readinto``. For restores there is a second
reference, the *kept-read floor* (:func:`floor_read_kept`): one process reading every record
into its own fresh buffer, kept until the end, and checking its CRC-32C, which is the least
any restore into rows that own their bytes has to do.
"""
from __future__ import annotations

import os
import time

from tqtx.layout.fsutil import fsync_dir as _fsync_dir

CHUNK = 8 * 2**20


_NOISE = None


def floor_write(path: str, nbytes: int) -> float:
    """One process: os.write of nbytes in 8 MiB chunks, then fsync."""
    global _NOISE
    if _NOISE is None:
        _NOISE = os.urandom(CHUNK)
    view = memoryview(_NOISE)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = os.write(fd, view[:min(CHUNK, left)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(os.path.dirname(path))
    return time.perf_counter() - t0


_RBUF = None


def floor_read(files) -> tuple[float, int]:
    """One process: read the files in 8 MiB chunks into one preallocated buffer."""
    global _RBUF
    if _RBUF is None:
        _RBUF = bytearray(CHUNK)
    total = 0
    t0 = time.perf_counter()
    for fn in files:
        with open(fn, "rb", buffering=0) as f:
            while True:
                n = f.readinto(_RBUF)
                if not n:
                    break
                total += n
    return time.perf_counter() - t0, total


def floor_read_kept(dump_dir) -> tuple[float, int]:
    """One process: every record of the dump's shards read with one ``pread`` into a
    fresh buffer of its own (first touch included, no zero-fill), its CRC-32C checked, all
    buffers kept until the end. The shard indexes are read before the clock starts."""
    from tqtx import format as fmt
    index = fmt.read_dump_index(dump_dir)
    plan = [(s["path"], s["records"]) for s in index.shards]
    kept, total = [], 0
    t0 = time.perf_counter()
    for path, records in plan:
        fd = os.open(path, os.O_RDONLY)
        try:
            for _gidx, offset, length, crc in records:
                buf = os.pread(fd, length, offset)  # a new bytes object: no zero-fill
                if len(buf) != length:
                    raise OSError(f"{path}: short read at {offset}")
                if fmt.checksum(buf) != crc:
                    raise ValueError(f"{path}: checksum mismatch at {offset}")
                kept.append(buf)
                total += length
        finally:
            os.close(fd)
    dt = time.perf_counter() - t0
    del kept
    return dt, total


def v1_save(tq, keys, pid, path) -> int:
    """kv_batch_get + torch.save of the tensors and tags to one file + fsync."""
    import torch
    td = tq.kv_batch_get(keys, pid)
    tags_all = tq.kv_list(pid)[pid]
    obj = {"keys": list(keys), "fields": {k: td.get(k) for k in td.keys()},
           "tags": [tags_all[k] for k in keys]}
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(os.path.dirname(path))
    return os.path.getsize(path)


def v1_restore(tq, pid, path) -> int:
    """torch.load + kv_batch_put into the (cleared) partition."""
    import torch
    from tensordict import TensorDict
    obj = torch.load(path, weights_only=True)
    keys = obj["keys"]
    tq.kv_batch_put(keys, pid, TensorDict(obj["fields"], batch_size=[len(keys)]),
                    tags=obj["tags"])
    return os.path.getsize(path)
