"""On-disk dump format (format_version 1): shards of per-row records, indexes, manifest.

Layout of a dump directory::

    dump_info.json            manifest, written last (its presence marks a finished dump)
    rows.msgpack              row index: key, global index, fields and tag of every row
    shards/unit-<k>.bin       concatenated self-contained records, one per row with data
    shards/unit-<k>.index     [global_index, offset, length, crc32] per record of the shard

A record is ``b"TQR1" + uint32_le(header_len) + header + payload`` where the header is
``{"i": global_index, "f": {field: ["t", dtype, shape, rel_offset, nbytes] |
["o", packed_object]}}`` (codec.packb) and tensor payloads follow the header. The crc32 (a CRC-32C, Castagnoli)
of a record covers all of its bytes.

This module is torch-free: it runs inside storage-unit processes.
"""
from __future__ import annotations

import errno
import gc
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from math import prod
from pathlib import Path
from typing import Iterable, Iterator

import msgpack

from tqtx import faults
from crc32c import crc32c as checksum  # CRC-32C (Castagnoli), hardware-accelerated

from tqtx.errors import DumpFormatError, DumpNotFoundError
from tqtx.wire import codec
from tqtx.wire.values import DTYPE_SIZES, RawTensor

FORMAT_VERSION = 1
MANIFEST = "dump_info.json"
ROW_INDEX = "rows.msgpack"
SHARDS_DIR = "shards"

RECORD_MAGIC = b"TQR1"
_PREFIX = struct.Struct("<4sI")
PREFIX_SIZE = _PREFIX.size  # 8: magic + header length

# Tensor payloads up to this size are copied next to the header (one iovec per record
# instead of one per field); larger ones are handed to writev as they are.
_SMALL_PAYLOAD = 4096
# Records are handed to writev in batches of about this many bytes (so a long stream of
# rows does not keep every source buffer alive); batches of at least _ASYNC_MIN_BYTES are
# written by a helper thread while the next one is checksummed.
_BATCH_BYTES = 8 << 20
_ASYNC_MIN_BYTES = 1 << 20

try:
    _IOV_MAX = max(16, int(os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def shard_file_name(unit) -> str:
    """Relative path of the shard holding unit ``unit``'s records."""
    return f"{SHARDS_DIR}/unit-{unit}.bin"


def shard_index_name(unit) -> str:
    """Relative path of the index of unit ``unit``'s shard."""
    return f"{SHARDS_DIR}/unit-{unit}.index"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _new_tensor(dtype: str, shape: tuple, data) -> RawTensor:
    # Bypasses RawTensor.__init__ (which re-converts the shape) for already-validated headers.
    t = _RAW_NEW(RawTensor)
    t.dtype, t.shape, t.data = dtype, shape, data
    return t


_RAW_NEW = RawTensor.__new__


# The file format owns its msgpack encoding; it is byte-identical to codec.packb (tensors
# as inline extension EXT_TENSOR_INLINE [dtype, shape, bytes]) but has no frame references.
def _pack_default(value):
    if isinstance(value, RawTensor):
        return msgpack.ExtType(codec.EXT_TENSOR_INLINE, msgpack.packb(
            [value.dtype, list(value.shape), memoryview(value.data).tobytes()],
            use_bin_type=True))
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot encode value of type {type(value).__name__}")


def _pack(obj) -> bytes:
    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def _ext_hook(code, payload):
    if code != codec.EXT_TENSOR_INLINE:
        raise codec.CodecError(f"unexpected extension type {code}")
    try:
        dtype, shape, data = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise codec.CodecError(f"malformed tensor: {exc}") from None
    if not isinstance(dtype, str) or not isinstance(shape, list) \
            or not isinstance(data, bytes) or not all(_is_int(s) for s in shape):
        raise codec.CodecError("malformed tensor")
    tensor = RawTensor(dtype, shape, data)
    try:
        tensor.validate("tensor")
    except ValueError as exc:
        raise codec.CodecError(str(exc)) from None
    return tensor


def _unpack(data):
    """Decode msgpack written by :func:`_pack` / codec.packb; raises codec.CodecError."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except codec.CodecError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage input
        raise codec.CodecError(f"{type(exc).__name__}: {exc}") from None


def _error(file, msg: str, *, global_index=None, key=None, missing=False) -> DumpFormatError:
    """A DumpFormatError whose message starts with ``file``; details kept as attributes.
    ``missing``: a DumpNotFoundError (also a FileNotFoundError) naming ``file``."""
    exc = DumpNotFoundError(f"{file}: {msg}", file) if missing else DumpFormatError(f"{file}: {msg}")
    exc.file = str(file)
    exc.global_index = global_index
    exc.key = key
    return exc


# --------------------------------------------------------------------------- records

def _payload(tensor: RawTensor, gidx, name):
    """``(buffer, nbytes)`` of exactly the tensor's bytes; bytes or a 1-D byte memoryview."""
    size = DTYPE_SIZES.get(tensor.dtype)
    if size is None:
        raise ValueError(f"global index {gidx}, field {name!r}: unknown dtype {tensor.dtype!r}")
    expected = size
    for s in tensor.shape:
        if s < 0:
            raise ValueError(f"global index {gidx}, field {name!r}: negative dimension in "
                             f"shape {list(tensor.shape)}")
        expected *= s
    data = tensor.data
    if type(data) is bytes:
        n = len(data)
    else:
        data = memoryview(data)
        if not data.c_contiguous:
            data = memoryview(data.tobytes())
        if data.ndim != 1 or data.format != "B":
            data = data.cast("B")
        n = data.nbytes
    if n != expected:
        raise ValueError(
            f"global index {gidx}, field {name!r}: {n} bytes for dtype {tensor.dtype} "
            f"shape {list(tensor.shape)} (expected {expected})")
    return data, n


def _encode(gidx: int, row: dict, with_crc: bool):
    if type(gidx) is not int:
        if not _is_int(gidx):
            raise TypeError(f"global index must be an int, not {type(gidx).__name__}")
        gidx = int(gidx)
    fields: dict = {}
    tensors = []
    small_total = 0
    for name, value in row.items():
        if type(name) is not str:
            raise TypeError(f"global index {gidx}: field names must be str, not {name!r}")
        if isinstance(value, RawTensor):
            buf, n = _payload(value, gidx, name)
            tensors.append((name, value, buf, n))
            if n <= _SMALL_PAYLOAD:
                small_total += n
            fields[name] = None  # keeps the row's field order
        else:
            fields[name] = ["o", _pack(value)]
    # Small payloads go first, joined with the header; large ones follow as their own iovecs.
    small_parts = []
    large = []
    small_off, large_off = 0, small_total
    for name, value, buf, n in tensors:
        if n <= _SMALL_PAYLOAD:
            fields[name] = ["t", value.dtype, list(value.shape), small_off, n]
            small_off += n
            if n:
                small_parts.append(buf)
        else:
            fields[name] = ["t", value.dtype, list(value.shape), large_off, n]
            large_off += n
            large.append(buf)
    header = msgpack.packb({"i": gidx, "f": fields}, use_bin_type=True)
    if len(header) > 0xFFFFFFFF:
        raise ValueError(f"global index {gidx}: record header too large ({len(header)} bytes)")
    prefix = _PREFIX.pack(RECORD_MAGIC, len(header))
    head = b"".join([prefix, header, *small_parts]) if small_parts else prefix + header
    length = len(head) + large_off - small_total
    if not with_crc:
        return head, large, length
    crc = checksum(head)
    for buf in large:
        crc = checksum(buf, crc)
    return [head, *large], length, crc


def encode_record(gidx: int, row: dict) -> tuple[list, int, int]:
    """Encode one row as a record: ``(buffers, length, crc32)``.

    ``buffers`` concatenated form the record; large tensor payloads are the row's own
    buffers (only the bytes of each tensor, never the larger buffer they may slice).
    Raises ValueError/TypeError for values that cannot be stored.
    """
    return _encode(gidx, row, True)


def _bad(where, msg):
    return DumpFormatError(f"{where}: {msg}")


def decode_record(buf, *, expected_gidx: int | None = None,
                  where: str = "record") -> tuple[int, dict]:
    """Decode a record; tensor data are memoryview slices of ``buf`` (no copy).

    Validates magic, header length and structure, that tensor payloads exactly tile the
    payload, and the global index if ``expected_gidx`` is given. Does not check the crc.
    Raises DumpFormatError naming ``where``.
    """
    view = memoryview(buf)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    total = view.nbytes
    if total < PREFIX_SIZE:
        raise _bad(where, f"record of {total} bytes is shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(view, 0)
    if magic != RECORD_MAGIC:
        raise _bad(where, f"bad record magic {magic!r} (expected {RECORD_MAGIC!r})")
    start = PREFIX_SIZE + hlen
    if start > total:
        raise _bad(where, f"header length {hlen} exceeds the record ({total} bytes)")
    try:
        header = _unpack(view[PREFIX_SIZE:start])
    except codec.CodecError as exc:
        raise _bad(where, f"malformed record header: {exc}") from None
    if type(header) is not dict or len(header) != 2 or "i" not in header or "f" not in header:
        raise _bad(where, "malformed record header (expected keys 'i' and 'f')")
    gidx, specs = header["i"], header["f"]
    if type(gidx) is not int:
        raise _bad(where, f"record global index is not an int: {gidx!r}")
    if expected_gidx is not None and gidx != expected_gidx:
        raise _bad(where, f"record holds global index {gidx}, expected {expected_gidx}")
    if type(specs) is not dict:
        raise _bad(where, "malformed record header (field table is not a map)")
    row: dict = {}
    ranges = []
    for name, spec in specs.items():
        if type(name) is not str or type(spec) is not list or not spec:
            raise _bad(where, f"malformed entry for field {name!r}")
        kind = spec[0]
        if kind == "t":
            if len(spec) != 5:
                raise _bad(where, f"malformed tensor entry for field {name!r}")
            _, dtype, shape, off, n = spec
            size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
            if size is None:
                raise _bad(where, f"field {name!r} has unknown dtype {dtype!r}")
            if type(shape) is not list or type(off) is not int or type(n) is not int or off < 0:
                raise _bad(where, f"malformed tensor entry for field {name!r}")
            expected = size
            for s in shape:
                if type(s) is not int or s < 0:
                    raise _bad(where, f"field {name!r} has invalid shape {shape!r}")
                expected *= s
            if n != expected:
                raise _bad(where, f"field {name!r}: {n} bytes for dtype {dtype} shape {shape}")
            ranges.append((off, n, name, dtype, shape))
            row[name] = None  # keeps the header's field order
        elif kind == "o":
            if len(spec) != 2 or type(spec[1]) is not bytes:
                raise _bad(where, f"malformed object entry for field {name!r}")
            try:
                row[name] = _unpack(spec[1])
            except codec.CodecError as exc:
                raise _bad(where, f"field {name!r}: malformed value: {exc}") from None
        else:
            raise _bad(where, f"field {name!r} has unknown kind {kind!r}")
    payload = total - start
    if ranges:
        ranges.sort(key=_range_key)
        pos = 0
        for off, n, name, dtype, shape in ranges:
            if off != pos:
                raise _bad(where, f"field {name!r} payload at {off} overlaps or leaves a gap "
                                  f"(expected {pos})")
            pos += n
            row[name] = _new_tensor(dtype, tuple(shape), view[start + off:start + pos])
    else:
        pos = 0
    if pos != payload:
        raise _bad(where, f"record length mismatch: header describes {pos} payload bytes, "
                          f"record has {payload}")
    return gidx, row


def _range_key(r):
    return r[0], r[1]


@contextmanager
def _naming(path, action: str):
    """Re-raise an OSError that names no file (write, writev and fsync errors on a
    descriptor) as the same errno naming ``path``, e.g. ``[Errno 28] No space left on
    device (writing shard): '/d.tmp-1/shards/unit-0.bin'``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, f"{exc.strerror} ({action})", os.fspath(path)) from exc


def _writev_all(fd: int, bufs: list) -> None:
    """Write every buffer of ``bufs`` (bytes or 1-D byte memoryviews) in order."""
    i, n = 0, len(bufs)
    while i < n:
        chunk = bufs[i:i + _IOV_MAX]
        written = os.writev(fd, chunk)
        if written == sum(map(len, chunk)):
            i += len(chunk)
            continue
        if written <= 0:
            raise OSError(errno.EIO, f"writev wrote {written} bytes")
        for j, b in enumerate(chunk):  # partial write: resume inside buffer i + j
            if written < len(b):
                i += j
                bufs[i] = memoryview(b)[written:]
                break
            written -= len(b)


class ShardWriter:
    """Append-only writer of one shard file (created exclusively).

    ``entries`` lists ``[global_index, offset, length, crc32]`` per record written and
    ``bytes_written`` the shard size so far. Usable as a context manager: a clean exit
    closes (with fsync), an exception aborts (closes and removes the file).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.fd: int | None = os.open(
            self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_CLOEXEC, 0o644)
        self.entries: list[list[int]] = []
        self.bytes_written = 0
        self._pool: ThreadPoolExecutor | None = None

    def write_rows(self, rows: Iterable[tuple[int, dict]]) -> None:
        """Append one record per ``(global_index, row)``, batched through os.writev.

        Large batches are written by a helper thread while the next batch is encoded
        and checksummed (both release the GIL), so crc32 and copying overlap.
        """
        if self.fd is None:
            raise ValueError(f"{self.path}: shard writer is closed")
        iov: list = []
        pending: list[list[int]] = []
        pending_bytes = 0
        offset = self.bytes_written
        inflight: Future | None = None
        crc32 = checksum
        try:
            for gidx, row in rows:
                head, large, length = _encode(gidx, row, False)
                if iov and (len(iov) + 1 + len(large) > _IOV_MAX
                            or pending_bytes >= _BATCH_BYTES):
                    inflight = self._submit(inflight, iov, pending, pending_bytes)
                    iov, pending, pending_bytes = [], [], 0
                crc = crc32(head)
                iov.append(head)
                for buf in large:
                    crc = crc32(buf, crc)
                    iov.append(buf)
                pending.append([gidx, offset, length, crc])
                pending_bytes += length
                offset += length
            if iov:
                inflight = self._submit(inflight, iov, pending, pending_bytes)
            if inflight is not None:
                inflight.result()
        except BaseException:
            if inflight is not None:
                inflight.exception()  # wait: the file must not be written behind our back
            self._close_fd()  # the file now ends at an unknown position
            raise

    def _submit(self, inflight, iov, pending, nbytes):
        if inflight is not None:
            inflight.result()
        if nbytes < _ASYNC_MIN_BYTES:
            self._flush(iov, pending, nbytes)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tqtx-shard-writer")
        return self._pool.submit(self._flush, iov, pending, nbytes)

    def _flush(self, iov: list, pending: list, nbytes: int) -> None:
        with _naming(self.path, "writing shard"):
            _writev_all(self.fd, iov)
        self.entries.extend(pending)
        self.bytes_written += nbytes

    def close(self, fsync: bool = True) -> list:
        """Fsync (optionally) and close the shard; returns ``entries``."""
        if self.fd is None:
            return self.entries
        try:
            faults.hit("unit.dump.after_write")
            if fsync:
                with _naming(self.path, "fsync of shard"):
                    os.fsync(self.fd)
        finally:
            self._close_fd()
        if fsync:
            _fsync_dir(self.path.parent)
        return self.entries

    def abort(self) -> None:
        """Close without fsync and remove the partial shard file."""
        self._close_fd()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _close_fd(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


def _pread_exact(fd: int, length: int, offset: int):
    """Read ``length`` bytes at ``offset``; returns fewer only at end of file."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    buf = bytearray(length)
    view = memoryview(buf)
    got = len(data)
    view[:got] = data
    while got < length:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            return bytes(view[:got])
        got += n
    return buf


def _read_entry(fd: int, entry, verify: bool, label: str):
    gidx, offset, length, crc = entry
    data = _pread_exact(fd, length, offset)
    if len(data) != length:
        raise DumpFormatError(f"{label}: record for global index {gidx} (offset {offset}, "
                              f"length {length}): truncated shard: read {len(data)} bytes")
    if verify and checksum(data) != crc:
        raise DumpFormatError(f"{label}: record for global index {gidx} (offset {offset}, "
                              f"length {length}): checksum (CRC-32C) mismatch ({checksum(data):#010x}, "
                              f"index says {crc:#010x})")
    try:
        return decode_record(data, expected_gidx=gidx, where=label)
    except DumpFormatError as exc:
        # Build the detailed location only on failure (keeps the hot path cheap).
        msg = str(exc)[len(label) + 2:]
        raise DumpFormatError(f"{label}: record for global index {gidx} (offset {offset}, "
                              f"length {length}): {msg}") from None


def read_records(path, entries, *, batch: int = 128, verify: bool = True,
                 where_prefix: str | None = None) -> Iterator[list[tuple[int, dict]]]:
    """Read ``entries`` ([gidx, offset, length, crc32]) from a shard, ``batch`` at a time.

    Yields lists of ``(global_index, row)`` with at most ``batch`` rows, each record read
    (by offset order within its batch) into its own bytes object; checks crc32 if
    ``verify``. Errors raise DumpFormatError naming the file and the global index.
    """
    if batch < 1:
        raise ValueError("batch must be >= 1")
    label = f"{where_prefix}: {path}" if where_prefix else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    except FileNotFoundError:
        raise _error(label, "shard file is missing", missing=True) from None
    try:
        for start in range(0, len(entries), batch):
            chunk = sorted(entries[start:start + batch], key=_offset_key)
            yield [_read_entry(fd, e, verify, label) for e in chunk]
    finally:
        os.close(fd)


def _offset_key(entry):
    return entry[1]


# --------------------------------------------------------------------------- schemas

def infer_schema(values: list) -> dict:
    """Field schema of a non-empty list of values of one field.

    All RawTensors → ``{"kind": "tensor", ...}`` (same dtype and ndim required; differing
    shapes give ``shape=None, jagged=True``); no RawTensor → ``{"kind": "object"}``.
    Raises ValueError for mixed kinds, dtypes or ndims.
    """
    if not values:
        raise ValueError("cannot infer a field schema from no values")
    first = values[0]
    if not isinstance(first, RawTensor):
        if any(isinstance(v, RawTensor) for v in values):
            raise ValueError("field mixes tensor and non-tensor values")
        return {"kind": "object"}
    dtype, shape = first.dtype, first.shape
    ndim = len(shape)
    jagged = False
    for v in values:
        if not isinstance(v, RawTensor):
            raise ValueError("field mixes tensor and non-tensor values")
        if v.dtype != dtype:
            raise ValueError(f"field mixes dtypes {dtype} and {v.dtype}")
        if v.shape != shape:
            if len(v.shape) != ndim:
                raise ValueError(f"field mixes tensors of {ndim} and {len(v.shape)} dimensions")
            jagged = True
    return {"kind": "tensor", "dtype": dtype, "shape": None if jagged else list(shape),
            "jagged": jagged, "ndim": ndim}


def merge_schema(a: dict, b: dict) -> dict:
    """Schema covering the values of both ``a`` and ``b``; ValueError if incompatible."""
    if a["kind"] != b["kind"]:
        raise ValueError(f"field mixes {a['kind']} and {b['kind']} values")
    if a["kind"] != "tensor":
        return dict(a)
    if a["dtype"] != b["dtype"]:
        raise ValueError(f"field mixes dtypes {a['dtype']} and {b['dtype']}")
    if a["ndim"] != b["ndim"]:
        raise ValueError(f"field mixes tensors of {a['ndim']} and {b['ndim']} dimensions")
    jagged = bool(a.get("jagged") or b.get("jagged") or a.get("shape") != b.get("shape"))
    return {"kind": "tensor", "dtype": a["dtype"], "shape": None if jagged else list(a["shape"]),
            "jagged": jagged, "ndim": a["ndim"]}


def validate_row(row: dict, schema: dict, *, where: str) -> None:
    """Check every value of ``row`` against ``schema`` ({field: field schema})."""
    for name, value in row.items():
        fs = schema.get(name)
        if fs is None:
            raise DumpFormatError(f"{where}: field {name!r} is not in the dump's field schema")
        kind = fs.get("kind")
        if kind == "object":
            if isinstance(value, RawTensor):
                raise DumpFormatError(f"{where}: field {name!r} holds a tensor, schema says object")
            continue
        if kind != "tensor":
            raise DumpFormatError(f"{where}: field {name!r} has unknown schema kind {kind!r}")
        if not isinstance(value, RawTensor):
            raise DumpFormatError(
                f"{where}: field {name!r} holds a {type(value).__name__}, schema says tensor")
        if value.dtype != fs.get("dtype"):
            raise DumpFormatError(
                f"{where}: field {name!r} has dtype {value.dtype}, schema says {fs.get('dtype')}")
        if len(value.shape) != fs.get("ndim"):
            raise DumpFormatError(
                f"{where}: field {name!r} has {len(value.shape)} dimensions, "
                f"schema says {fs.get('ndim')}")
        if not fs.get("jagged") and fs.get("shape") is not None \
                and list(value.shape) != list(fs["shape"]):
            raise DumpFormatError(
                f"{where}: field {name!r} has shape {list(value.shape)}, "
                f"schema says {list(fs['shape'])}")
        itemsize = DTYPE_SIZES.get(value.dtype)
        expected = prod(value.shape) * itemsize if itemsize else -1
        if memoryview(value.data).nbytes != expected:
            raise DumpFormatError(
                f"{where}: field {name!r} has {memoryview(value.data).nbytes} bytes, "
                f"expected {expected}")


# --------------------------------------------------------------------------- writing indexes

# Filesystems that cannot fsync a directory say so with these; any other error is real.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def fsync_dir(path) -> None:
    """fsync a directory so creations and renames inside it are durable.

    Only "not supported on this filesystem" is tolerated; EIO, ENOSPC and the rest raise,
    and an fsync error is never retried into success.
    """
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise OSError(exc.errno, f"{exc.strerror} (fsync of directory)",
                          os.fspath(path)) from exc
    finally:
        os.close(fd)


_fsync_dir = fsync_dir


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | _O_CLOEXEC, 0o644)
    try:
        with _naming(path, "writing file"):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        with _naming(path, "fsync of file"):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_row_index(staging_dir, *, partition_id: str, dump_id: str, field_schema: dict,
                    rows) -> dict:
    """Write ``rows.msgpack`` ([key, gidx, fields, tag] per row) and fsync it.

    Returns the manifest entry ``{"file", "size", "crc32"}``.
    """
    data = _pack({"format_version": FORMAT_VERSION, "partition_id": partition_id,
                  "dump_id": dump_id, "field_schema": field_schema,
                  "rows": [list(r) for r in rows]})
    _write_file(Path(staging_dir) / ROW_INDEX, data)
    return {"file": ROW_INDEX, "size": len(data), "crc32": checksum(data)}


def write_shard_index(staging_dir, unit, entries) -> dict:
    """Write ``shards/unit-<unit>.index`` and fsync it; returns ``{"file", "size", "crc32"}``."""
    rel = shard_index_name(unit)
    data = _pack({"format_version": FORMAT_VERSION, "unit": unit,
                  "shard": shard_file_name(unit), "records": [list(e) for e in entries]})
    path = Path(staging_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_file(path, data)
    return {"file": rel, "size": len(data), "crc32": checksum(data)}


def write_manifest(staging_dir, *, dump_id: str, partition_id: str, keys: int,
                   rows_with_data: int, bytes: int, row_index: dict, shards: list,
                   writer: str, tqtx_version: str) -> dict:
    """Write ``dump_info.json`` atomically (temp file, fsync, rename); returns the manifest.

    Directory entries of everything written before are made durable first, so a visible
    manifest implies a complete dump.
    """
    staging = Path(staging_dir)
    manifest = {
        "format_version": FORMAT_VERSION,
        "dump_id": dump_id,
        "partition_id": partition_id,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "tqtx_version": tqtx_version,
        "keys": keys,
        "rows_with_data": rows_with_data,
        "bytes": bytes,
        "row_index": dict(row_index),
        "shards": [dict(s) for s in shards],
        "writer": writer,
    }
    if (staging / SHARDS_DIR).is_dir():
        _fsync_dir(staging / SHARDS_DIR)
    _fsync_dir(staging)
    tmp = staging / (MANIFEST + ".tmp")
    _write_file(tmp, (json.dumps(manifest, indent=2) + "\n").encode())
    os.replace(tmp, staging / MANIFEST)
    _fsync_dir(staging)
    return manifest


# --------------------------------------------------------------------------- reading indexes

@dataclass
class DumpIndex:
    """Everything known about a dump without reading shard payloads."""

    dump_dir: Path
    manifest: dict
    partition_id: str
    dump_id: str
    field_schema: dict
    rows: list = field(default_factory=list)    # (key, gidx, fields, tag)
    shards: list = field(default_factory=list)  # {"unit", "file", "path", "size", "records"}

    def record_locations(self) -> dict:
        """``{global_index: (shard_path, offset, length, crc32)}`` for every record."""
        out = {}
        for shard in self.shards:
            path = shard["path"]
            for gidx, offset, length, crc in shard["records"]:
                out[gidx] = (path, offset, length, crc)
        return out


def _check_rel_path(dump_dir: Path, real_dir: str, rel, manifest_path: Path, what: str) -> Path:
    if not isinstance(rel, str) or not rel:
        raise _error(manifest_path, f"{what}: file path must be a non-empty string, got {rel!r}")
    if rel.startswith("/") or os.path.isabs(rel) or "\\" in rel or "\x00" in rel:
        raise _error(manifest_path, f"{what}: file path {rel!r} must be relative to the dump")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise _error(manifest_path,
                     f"{what}: file path {rel!r} is not normalized or escapes the dump directory")
    path = dump_dir / rel
    if not os.path.realpath(path).startswith(real_dir + os.sep):
        raise _error(manifest_path,
                     f"{what}: file path {rel!r} resolves outside the dump directory")
    return path


def _check_file_entry(entry, manifest_path: Path, what: str) -> None:
    if (not isinstance(entry, dict) or not _is_int(entry.get("size")) or entry["size"] < 0
            or not _is_int(entry.get("crc32"))):
        raise _error(manifest_path, f"{what}: entry must have a file, a size and a crc32")


def _read_checked(path: Path, entry: dict, manifest_name: str):
    """Read an index file, check size and crc32 against the manifest, and unpack it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _error(path, "file is missing", missing=True) from None
    except OSError as exc:
        raise _error(path, f"cannot read: {exc}") from None
    if len(data) != entry["size"]:
        raise _error(path, f"size is {len(data)} bytes, {manifest_name} says {entry['size']}")
    crc = checksum(data)
    if crc != entry["crc32"]:
        raise _error(path, f"checksum (CRC-32C) mismatch ({crc:#010x}, {manifest_name} says "
                           f"{entry['crc32']:#010x})")
    try:
        return _unpack(data)
    except codec.CodecError as exc:
        raise _error(path, f"malformed msgpack: {exc}") from None


def _check_field_schema(schema, path: Path) -> None:
    if not isinstance(schema, dict):
        raise _error(path, "field_schema is not a map")
    for name, fs in schema.items():
        if not isinstance(name, str) or not isinstance(fs, dict):
            raise _error(path, f"malformed field schema for {name!r}")
        kind = fs.get("kind")
        if kind == "object":
            continue
        if kind != "tensor":
            raise _error(path, f"field {name!r} has unknown schema kind {kind!r}")
        shape = fs.get("shape")
        dtype = fs.get("dtype")
        if (type(dtype) is not str or dtype not in DTYPE_SIZES or not _is_int(fs.get("ndim"))
                or not isinstance(fs.get("jagged"), bool)
                or not (shape is None or (isinstance(shape, list)
                                          and all(_is_int(s) and s >= 0 for s in shape)))
                or (shape is not None and len(shape) != fs["ndim"])
                or (shape is None and not fs["jagged"])):
            raise _error(path, f"malformed tensor schema for field {name!r}: {fs!r}")


@contextmanager
def _gc_paused():
    # Unpacking a big row index creates millions of containers; the cyclic GC would
    # rescan them repeatedly (3x slower), and none of them can form cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_dump_index(dump_dir, *, check_files: bool = True) -> DumpIndex:
    """Read and cross-check manifest, row index and shard indexes (no shard payload read).

    With ``check_files`` also checks that each shard exists with the manifest's size.
    Raises DumpFormatError naming the offending file (and key / global index).
    """
    with _gc_paused():
        return _read_dump_index(dump_dir, check_files)


def _read_dump_index(dump_dir, check_files: bool) -> DumpIndex:
    dump_dir = Path(os.path.abspath(dump_dir))
    mpath = dump_dir / MANIFEST
    try:
        raw = mpath.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        if not dump_dir.is_dir():
            raise _error(dump_dir, "dump directory not found", missing=True) from None
        raise _error(mpath, f"no {MANIFEST} in the directory "
                            f"(not a tqtx dump or an unfinished one)", missing=True) from None
    except OSError as exc:
        raise _error(mpath, f"cannot read: {exc}") from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise _error(mpath, f"invalid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise _error(mpath, "manifest is not a JSON object")
    version = manifest.get("format_version")
    if not _is_int(version) or version < 1:
        raise _error(mpath, f"invalid format_version {version!r} "
                            f"(Unsupported dump format version {version!r})")
    if version > FORMAT_VERSION:
        raise _error(mpath, f"format_version {version} is newer than this tqtx supports "
                            f"(format_version {FORMAT_VERSION}). Unsupported dump format "
                            f"version {version}: upgrade tqtx to read it")
    for name, typ in (("dump_id", str), ("partition_id", str), ("keys", int),
                      ("rows_with_data", int), ("bytes", int), ("row_index", dict),
                      ("shards", list)):
        value = manifest.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise _error(mpath, f"missing or invalid {name!r}")
    real_dir = os.path.realpath(dump_dir)

    # Row index.
    ri = manifest["row_index"]
    _check_file_entry(ri, mpath, "row_index")
    rpath = _check_rel_path(dump_dir, real_dir, ri.get("file"), mpath, "row_index")
    index = _read_checked(rpath, ri, MANIFEST)
    if not isinstance(index, dict) or not isinstance(index.get("rows"), list):
        raise _error(rpath, "malformed row index (expected a map with 'rows')")
    for name in ("format_version", "partition_id", "dump_id"):
        if index.get(name) != manifest[name]:
            raise _error(rpath, f"{name} {index.get(name)!r} differs from {MANIFEST} "
                                f"({manifest[name]!r})")
    field_schema = index.get("field_schema")
    _check_field_schema(field_schema, rpath)

    rows = []
    keys_seen = set()
    gidx_key: dict[int, str] = {}
    with_data: dict[int, str] = {}
    for r in index["rows"]:
        if type(r) is not list or len(r) != 4:
            raise _error(rpath, f"malformed row entry {r!r}")
        key, gidx, fields, tag = r
        if type(key) is not str or type(gidx) is not int or type(fields) is not list \
                or not (tag is None or type(tag) is dict):
            raise _error(rpath, f"malformed row entry for key {key!r}", key=key)
        if key in keys_seen:
            raise _error(rpath, f"duplicate key {key!r}", key=key, global_index=gidx)
        keys_seen.add(key)
        if gidx in gidx_key:
            raise _error(rpath, f"global index {gidx} is used by keys {gidx_key[gidx]!r} "
                                f"and {key!r}", key=key, global_index=gidx)
        gidx_key[gidx] = key
        if fields:
            for f in fields:
                if type(f) is not str or f not in field_schema:
                    raise _error(rpath, f"row {key!r} has field {f!r} missing from "
                                        f"field_schema", key=key, global_index=gidx)
            if len(fields) > 1 and len(set(fields)) != len(fields):
                raise _error(rpath, f"row {key!r} lists a field twice", key=key,
                             global_index=gidx)
            with_data[gidx] = key
        rows.append((key, gidx, fields, tag))
    if manifest["keys"] != len(rows):
        raise _error(mpath, f"keys is {manifest['keys']} but {ROW_INDEX} has {len(rows)} rows")
    if manifest["rows_with_data"] != len(with_data):
        raise _error(mpath, f"rows_with_data is {manifest['rows_with_data']} but {ROW_INDEX} "
                            f"has {len(with_data)} rows with fields")

    # Shards and their indexes.
    shards = []
    units_seen = set()
    files_seen = set()
    record_shard: dict[int, str] = {}
    for s in manifest["shards"]:
        if not isinstance(s, dict) or "unit" not in s or not _is_int(s.get("size")) \
                or s["size"] < 0 or not _is_int(s.get("records")):
            raise _error(mpath, f"malformed shard entry {s!r}")
        unit = s["unit"]
        if type(unit) not in (int, str):
            raise _error(mpath, f"malformed shard entry: unit {unit!r}")
        if unit in units_seen:
            raise _error(mpath, f"unit {unit!r} has two shards")
        units_seen.add(unit)
        spath = _check_rel_path(dump_dir, real_dir, s.get("file"), mpath, f"shard of unit {unit}")
        ientry = s.get("index")
        _check_file_entry(ientry, mpath, f"index of unit {unit}")
        ipath = _check_rel_path(dump_dir, real_dir, ientry.get("file"), mpath,
                                f"index of unit {unit}")
        for p in (spath, ipath):
            if p in files_seen:
                raise _error(mpath, f"file {p.relative_to(dump_dir)} is listed twice")
            files_seen.add(p)
        sidx = _read_checked(ipath, ientry, MANIFEST)
        if not isinstance(sidx, dict) or not isinstance(sidx.get("records"), list):
            raise _error(ipath, "malformed shard index (expected a map with 'records')")
        if sidx.get("format_version") != version or sidx.get("unit") != unit \
                or sidx.get("shard") != s["file"]:
            raise _error(ipath, f"shard index header (unit {sidx.get('unit')!r}, shard "
                                f"{sidx.get('shard')!r}) does not match {MANIFEST}")
        records = sidx["records"]
        if len(records) != s["records"]:
            raise _error(ipath, f"has {len(records)} records, {MANIFEST} says {s['records']}")
        size = s["size"]
        for rec in records:
            if type(rec) is not list or len(rec) != 4:
                raise _error(ipath, f"malformed record entry {rec!r}")
            gidx, offset, length, crc = rec
            if type(gidx) is not int or type(offset) is not int or type(length) is not int \
                    or type(crc) is not int:
                raise _error(ipath, f"malformed record entry {rec!r}")
            if offset < 0 or length < PREFIX_SIZE or offset + length > size \
                    or not 0 <= crc <= 0xFFFFFFFF:
                raise _error(spath, f"record for global index {gidx} (offset {offset}, "
                                    f"length {length}) lies outside the shard ({size} bytes)",
                             global_index=gidx)
            if gidx not in with_data:
                why = (f"row {gidx_key[gidx]!r} has no fields" if gidx in gidx_key
                       else "no row has that global index")
                raise _error(ipath, f"record for global index {gidx}, but {why} in {ROW_INDEX}",
                             global_index=gidx, key=gidx_key.get(gidx))
            if gidx in record_shard:
                raise _error(ipath, f"global index {gidx} has a second record (first in "
                                    f"{record_shard[gidx]})", global_index=gidx,
                             key=with_data[gidx])
            record_shard[gidx] = s["file"]
        prev_end = 0
        for gidx, offset, length, _ in sorted(records, key=_offset_key):
            if offset < prev_end:
                raise _error(spath, f"record for global index {gidx} overlaps the previous "
                                    f"record", global_index=gidx)
            prev_end = offset + length
        if check_files:
            try:
                st = os.stat(spath)
            except FileNotFoundError:
                raise _error(spath, "shard file is missing", missing=True) from None
            if st.st_size != size:
                raise _error(spath, f"shard is {st.st_size} bytes, {MANIFEST} says {size} "
                                    f"(truncated or altered)")
        shards.append({"unit": unit, "file": s["file"], "path": spath, "size": size,
                       "records": records})
    if len(record_shard) != len(with_data):
        missing = [g for g in with_data if g not in record_shard]
        g = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _error(rpath, f"row {with_data[g]!r} (global index {g}) has fields but no "
                            f"record in any shard{more}", key=with_data[g], global_index=g)
    return DumpIndex(dump_dir=dump_dir, manifest=manifest, partition_id=manifest["partition_id"],
                     dump_id=manifest["dump_id"], field_schema=field_schema, rows=rows,
                     shards=shards)


def read_row_index(dump_dir) -> dict:
    """Public view of a dump's rows: ``{"format_version", "partition_id", "dump_id",
    "rows": {key: {"global_index", "fields", "tag"}}, "field_schema"}``.

    Shard files are not opened; tags keep their RawTensors.
    """
    idx = read_dump_index(dump_dir, check_files=False)
    with _gc_paused():
        rows = {key: {"global_index": gidx, "fields": list(fields), "tag": tag}
                for key, gidx, fields, tag in idx.rows}
    return {"format_version": idx.manifest["format_version"], "partition_id": idx.partition_id,
            "dump_id": idx.dump_id,
            "rows": rows,
            "field_schema": idx.field_schema}


def verify_dump(dump_dir) -> dict:
    """Check a whole dump, reading every record (crc32, decoding, schema).

    Returns ``{"ok", "dump_dir", "records", "bytes", "errors": [{"file", "global_index",
    "key", "error"}]}``; record errors are collected, an index-level error is the only one.
    """
    result = {"ok": False, "dump_dir": str(dump_dir), "records": 0, "bytes": 0, "errors": []}
    try:
        idx = read_dump_index(dump_dir)
    except DumpFormatError as exc:
        result["errors"].append({"file": getattr(exc, "file", str(dump_dir)),
                                 "global_index": getattr(exc, "global_index", None),
                                 "key": getattr(exc, "key", None), "error": str(exc)})
        return result
    fields_of = {gidx: (key, fields) for key, gidx, fields, _ in idx.rows}
    errors = result["errors"]
    for shard in idx.shards:
        path = shard["path"]
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except OSError as exc:
            errors.append({"file": str(path), "global_index": None, "key": None,
                           "error": f"{path}: cannot open: {exc}"})
            continue
        try:
            for entry in sorted(shard["records"], key=lambda e: e[1]):
                gidx = entry[0]
                key, fields = fields_of[gidx]
                try:
                    _, row = _read_entry(fd, entry, True, str(path))
                    where = f"{path}: record for global index {gidx} (key {key!r})"
                    if set(row) != set(fields):
                        raise DumpFormatError(f"{where}: fields {sorted(row)} differ from the "
                                              f"row index {sorted(fields)}")
                    validate_row(row, idx.field_schema, where=where)
                except DumpFormatError as exc:
                    errors.append({"file": str(path), "global_index": gidx, "key": key,
                                   "error": str(exc)})
                result["records"] += 1
                result["bytes"] += entry[2]
        finally:
            os.close(fd)
    result["ok"] = not errors
    return result


def _jsonable(value):
    if isinstance(value, RawTensor):
        return f"tensor({value.dtype}, {list(value.shape)})"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"bytes({memoryview(value).nbytes})"
    return value


def inspect_dump(dump_dir) -> dict:
    """JSON-friendly summary of a dump (no shard payload read)."""
    idx = read_dump_index(dump_dir)
    m = idx.manifest
    fields = {}
    for name, fs in idx.field_schema.items():
        if fs.get("kind") == "tensor":
            fields[name] = {"kind": "tensor", "dtype": fs["dtype"], "shape": fs.get("shape"),
                            "jagged": fs.get("jagged", False)}
        else:
            fields[name] = {"kind": fs.get("kind")}
    tags = []
    for key, _, _, tag in idx.rows:
        if tag is not None:
            tags.append({"key": key, "tag": _jsonable(tag)})
            if len(tags) == 5:
                break
    return {"dump_dir": str(idx.dump_dir), "partition_id": idx.partition_id,
            "dump_id": idx.dump_id, "format_version": m["format_version"],
            "created_at": m.get("created_at"), "tqtx_version": m.get("tqtx_version"),
            "writer": m.get("writer"), "keys": m["keys"], "rows_with_data": m["rows_with_data"],
            "bytes": m["bytes"], "fields": fields,
            "shards": [{"unit": s["unit"], "file": s["file"], "size": s["size"],
                        "records": len(s["records"])} for s in idx.shards],
            "sample_tags": tags}
