"""Same-host GET_ROWS payload through a RAM file system instead of the TCP socket.

A client makes one private directory under ``/dev/shm`` (mode 0700, named
``tqtx-get-<pid>-<start time>-<random>``) holding a probe file with a random token, and names both in
its ``GET_ROWS`` requests. A unit that can read that token at that path shares the
client's host and file system namespace; it then writes the reply's tensor columns with
``os.writev`` straight from its row buffers into a new file there (``O_EXCL|O_NOFOLLOW``,
0600, never written again) and replies with where each column starts. The client opens
the file, unlinks it at once and reads the rows with ``os.preadv`` straight into its
result tensors: the result is the client's own copy, so a later overwrite on the unit
changes nothing and no unit memory is pinned. A unit that cannot (other host, no
``/dev/shm``, a full file system) answers with frames as before.

Faster still, and preferred where the kernel allows it (:mod:`tqtx.wire.vmcopy`): a unit
whose share holds at least ``MIN_BYTES`` of tensor columns answers a ``GET_ROWS`` whose
hint says ``into`` with the columns' dtypes and row shapes only (the *layout*); the client
lays the rows out in request order, allocates each tensor column's result (fresh memory of
its own) and sends ``GET_INTO`` with where each of the unit's rows goes; the unit copies
its rows there with ``process_vm_writev`` (:meth:`ReplyFiles.write_into`), straight from
its row buffers. Each byte is then copied once, by the units in parallel, where reply
files copy it twice (into the file, out of it). A unit writes only into the process that
made the inbox it proved (the pid and start time in the inbox's name). Where the kernel
refuses (Yama's ``ptrace_scope`` >= 1, a seccomp profile), the client goes back to reply
files for good.

A same-host put goes the other way (``PUT_ROWS`` with ``from``): the client names the
inbox it proved and, per tensor column, its rows' dtype, shapes and addresses in its own
memory; the unit allocates each row's buffer and fills it with ``process_vm_readv``
(:meth:`ReplyFiles.read_from`), one copy, while ZeroMQ frames cost a copy into the socket
and one out of it. A unit that cannot (not the inbox's host, the kernel refuses) stores
nothing and says so; the client then sends that unit's rows as frames.

Files of a client that died in the middle of a get stay in its directory; the next
client on the host removes directories whose pid is gone, and only those that carry
this module's marker file and belong to the same user.
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import threading
from array import array
from math import prod

from ..layout import fsutil
from ..process.pids import process_alive, process_started
from . import vmcopy
from .columns import unpack_int64
from .values import DTYPE_SIZES, RawTensor

log = logging.getLogger("tqtx.shm")

PREFIX = "tqtx-get-"
PROBE = ".tqtx-get-probe"
# Replies with fewer tensor bytes than this go as frames: the file costs a few syscalls.
MIN_BYTES = int(os.environ.get("TQTX_SHM_MIN_BYTES", str(1 << 20)))
# What a reply file must leave free on the RAM file system, at the least (see write).
RESERVE_BYTES = int(os.environ.get("TQTX_SHM_RESERVE_BYTES", str(256 << 20)))
# ... and at least this share of its size.
RESERVE_SHARE = 0.25
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def default_root() -> str | None:
    """The RAM file system clients use (``$TQTX_SHM_DIR``, ``/dev/shm``), or None:
    ``TQTX_SHM_DIR=off`` (or a missing directory) turns the path off."""
    root = os.environ.get("TQTX_SHM_DIR", "/dev/shm")
    if root.lower() in ("", "0", "off", "none", "false"):
        return None
    return root if os.path.isdir(root) else None


# ---------------------------------------------------------------- client side
class GetInbox:
    """The client's directory for reply files (one per client process)."""

    def __init__(self, root: str):
        sweep_stale(root)
        self.token = secrets.token_hex(16)
        self.pid = pid = os.getpid()
        started = process_started(pid) or 0
        self.dir = os.path.join(root, f"{PREFIX}{pid}-{started}-{secrets.token_hex(4)}")
        os.mkdir(self.dir, 0o700)
        fd = os.open(os.path.join(self.dir, PROBE), os.O_WRONLY | os.O_CREAT | os.O_EXCL
                     | _NOFOLLOW | _CLOEXEC, 0o600)
        try:
            os.write(fd, self.token.encode())
        finally:
            os.close(fd)

    def open_reply(self, name: str) -> int:
        """Open reply file ``name`` (a plain name a unit wrote here) and unlink it: the
        returned descriptor is then the only reference to its memory."""
        if os.sep in name or name.startswith("."):
            raise ValueError(f"bad reply file name {name!r}")
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        os.unlink(path)
        return fd

    def hint_for(self, get_id: str, *, into: bool = False) -> dict:
        """What a GET_ROWS request carries: the inbox, its token and the get's ID (which
        starts the names of the get's files); ``into``: the client takes layouts and
        ``GET_INTO`` (see the module's docstring)."""
        hint = {"dir": self.dir, "token": self.token, "get": get_id}
        if into:
            hint["into"] = True
        return hint

    def discard_get(self, get_id: str) -> None:
        """Remove the files of get ``get_id`` that are still there (not opened: its get
        failed, or a unit was asked twice)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            if name.startswith(get_id + "-"):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass

    def close(self) -> None:
        """Remove the inbox (only in the process that made it, not in a forked child)."""
        if os.getpid() == self.pid:
            shutil.rmtree(self.dir, ignore_errors=True)


def sweep_stale(root: str) -> list[str]:
    """Remove inbox directories under ``root`` left by dead clients of this user: named
    ``tqtx-get-<pid>-*``, owned by us, holding the probe file, whose pid is gone."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        owner = _name_owner(name)
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if owner is None or st.st_uid != os.geteuid() \
                    or not os.path.isdir(path) or os.path.islink(path) \
                    or process_alive(*owner):
                continue
            if not os.path.isfile(os.path.join(path, PROBE)):
                continue  # not made by this module: never touched
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _name_owner(name: str) -> tuple[int, str] | None:
    """(pid, start time) from an inbox directory's name (``tqtx-get-<pid>-<start>-<rnd>``)."""
    parts = name[len(PREFIX):].split("-") if name.startswith(PREFIX) else ()
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


def inbox_owner(hint) -> tuple[int, str] | None:
    """(pid, start time) of the process that made the inbox ``hint`` names, from its name."""
    return _name_owner(os.path.basename(str(hint.get("dir", ""))))


class ReplyFile:
    """An open, already unlinked reply file; its memory is freed when it is closed."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self):
        self.close()


class FileRows:
    """The rows of one column that a unit wrote into a reply file: their ``dtype``, their
    ``shapes`` in request order and where the first starts (they follow back to back)."""

    __slots__ = ("dtype", "shapes", "file", "offset")

    def __init__(self, dtype: str, shapes: list, file: ReplyFile, offset: int):
        self.dtype, self.shapes, self.file, self.offset = dtype, shapes, file, offset


# A bytearray of n bytes left unfilled (the C API's documented NULL source): the kernel's
# copy fills every byte of it, where bytearray(n) would zero them first, a pass over the
# row's memory for nothing.
_unfilled = ctypes.pythonapi.PyByteArray_FromStringAndSize
_unfilled.restype = ctypes.py_object
_unfilled.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


# ---------------------------------------------------------------- unit side
class ReplyFiles:
    """A unit's side: check a client's hint once, write reply files into its inbox."""

    def __init__(self, unit_id: int):
        self.unit_id = unit_id
        self._ok: dict[tuple[str, str], bool] = {}
        self._lock = threading.Lock()
        self.files = 0
        self.copies = 0  # GET_INTO columns copied into a client (STATS: "result_copies")
        self.reads = 0  # PUT_ROWS read from a client's memory (STATS: "put_reads")

    def usable(self, hint) -> bool:
        """True if ``hint`` names an inbox this process can see (same host and mount
        namespace: the probe file there holds the token)."""
        if not isinstance(hint, dict):
            return False
        d, token = hint.get("dir"), hint.get("token")
        if not isinstance(d, str) or not isinstance(token, str) or \
                not os.path.basename(d).startswith(PREFIX):
            return False
        key = (d, token)
        with self._lock:
            known = self._ok.get(key)
        if known is not None:
            return known and os.path.isdir(d)
        try:
            fd = os.open(os.path.join(d, PROBE), os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            try:
                ok = os.read(fd, 256) == token.encode() and os.fstat(fd).st_uid == os.geteuid()
            finally:
                os.close(fd)
        except OSError:
            ok = False
        with self._lock:
            if len(self._ok) > 256:
                self._ok.clear()
            self._ok[key] = ok
        return ok

    def write(self, hint: dict, buffers: list, nbytes: int) -> str | None:
        """Write ``buffers`` (``nbytes`` in all; the list is used up) back to back into a new file of the inbox;
        its name, or None if it could not or should not be written (the caller then
        replies with frames). A RAM file system is shared with everything else on the host
        (data loader workers, NCCL): a reply that would leave less than ``RESERVE_SHARE``
        of it (at least ``RESERVE_BYTES``) free goes as frames."""
        get_id = hint.get("get")
        if not isinstance(get_id, str) or not get_id.isalnum():
            return None
        try:
            fs = os.statvfs(hint["dir"])
        except OSError:
            return None
        if fs.f_bavail * fs.f_frsize - nbytes < max(fs.f_blocks * fs.f_frsize * RESERVE_SHARE,
                                                     RESERVE_BYTES):
            return None
        name = f"{get_id}-u{self.unit_id}-{secrets.token_hex(4)}"
        path = os.path.join(hint["dir"], name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC,
                         0o600)
        except OSError as exc:
            log.debug("unit %d: no reply file in %s: %s", self.unit_id, hint["dir"], exc)
            return None
        try:
            fsutil.writev_all(fd, buffers)
        except OSError as exc:  # ENOSPC on a small /dev/shm: frames instead
            log.info("unit %d: reply file in %s failed (%s); replying with frames",
                     self.unit_id, hint["dir"], exc)
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        os.close(fd)
        self.files += 1
        return name

    def _proven_client(self, hint: dict) -> int:
        """The pid of the live process that made the inbox ``hint`` names, which this unit
        proved (:meth:`usable`); OSError otherwise."""
        owner = inbox_owner(hint)
        if owner is None or not self.usable(hint) or not process_alive(*owner):
            raise OSError(f"unit {self.unit_id}: no proven client process for inbox "
                          f"{hint.get('dir')!r}")
        return owner[0]

    def write_into(self, hint: dict, target, rows: list) -> None:
        """Copy ``rows`` (contiguous byte buffers) into the memory ``target``
        (``[address, size, offsets]``, offsets packed int64, one per row) names in the
        process that made ``hint``'s inbox. OSError if the inbox is not proven or the
        kernel refuses, ValueError for a malformed target or a row outside it."""
        try:
            address, size, offsets = target
            starts = unpack_int64(offsets)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed GET_INTO target: {exc}") from None
        if not all(type(x) is int and x > 0 for x in (address, size)):
            raise ValueError(f"malformed GET_INTO target {address!r}, {size!r}")
        if len(starts) != len(rows):
            raise ValueError(f"GET_INTO: {len(starts)} offsets for {len(rows)} rows")
        pid = self._proven_client(hint)
        todo = []
        for at, buf in zip(starts, rows):
            n = len(buf)
            if n:
                if at < 0 or at + n > size:
                    raise ValueError(f"GET_INTO: a row of {n} bytes at {at} is outside the "
                                     f"{size}-byte result")
                todo.append((at, buf))
        vmcopy.write(pid, address, todo)
        self.copies += 1

    def read_from(self, hint, columns) -> dict:
        """The rows of a same-host put, read out of the client's memory: ``columns`` maps a
        field to ``[dtype, row shapes, row addresses]`` (addresses packed unsigned 64-bit,
        :func:`vmcopy.addresses`) in the process that made ``hint``'s inbox. Returns field
        -> the rows' RawTensors, each owning a buffer of its own. OSError if the inbox is
        not proven or the kernel refuses (nothing is kept), ValueError if malformed."""
        if not isinstance(hint, dict) or not isinstance(columns, dict):
            raise ValueError("PUT_ROWS: malformed 'from'")
        pid = self._proven_client(hint)
        out, todo = {}, []
        for field, spec in columns.items():
            try:
                dtype, shapes, packed = spec
                size = DTYPE_SIZES[dtype]
                at = array("Q")
                at.frombytes(packed)
            except (TypeError, ValueError, KeyError) as exc:
                raise ValueError(f"PUT_ROWS: field {field!r}: malformed rows to read "
                                 f"({type(exc).__name__}: {exc})") from None
            if not isinstance(shapes, list) or len(shapes) != len(at):
                raise ValueError(f"PUT_ROWS: field {field!r}: {len(at)} addresses for "
                                 f"{len(shapes) if isinstance(shapes, list) else 'no'} shapes")
            rows, new = [], RawTensor.of  # shapes checked below, dtype above
            for shape, address in zip(shapes, at):
                if type(shape) not in (list, tuple) or not all(
                        type(d) is int and d >= 0 for d in shape):
                    raise ValueError(f"PUT_ROWS: field {field!r}: malformed shape {shape!r}")
                n = prod(shape) * size
                buf = _unfilled(None, n) if n else bytearray()
                if n:
                    todo.append((address, buf))
                rows.append(new(dtype, tuple(shape), buf))
            out[field] = rows
        vmcopy.read(pid, todo)
        self.reads += 1
        return out
