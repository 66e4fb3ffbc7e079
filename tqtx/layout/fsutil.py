"""Durable file I/O: fsync helpers, the fsynced small-file writer, writev / pread loops.

Errors of calls on a descriptor name no file; :func:`naming` puts the path into them, so an
ENOSPC or EIO says which file it hit. Torch-free, stdlib only.
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

try:
    IOV_MAX = max(16, int(os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):
    IOV_MAX = 1024

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

# Filesystems that cannot fsync a directory say so with these; any other error is real.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


@contextmanager
def naming(path, action: str):
    """Re-raise an OSError that names no file (write, writev and fsync errors on a
    descriptor) as the same errno naming ``path``, e.g. ``[Errno 28] No space left on
    device (writing shard): '/d.tmp-1/shards/unit-0.bin'``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, f"{exc.strerror} ({action})", os.fspath(path)) from exc


def fsync_dir(path) -> None:
    """fsync a directory so creations and renames inside it are durable.

    Only "not supported on this filesystem" is tolerated; EIO, ENOSPC and the rest raise,
    and an fsync error is never retried into success.
    """
    fd = os.open(path, os.O_RDONLY | O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise OSError(exc.errno, f"{exc.strerror} (fsync of directory)",
                          os.fspath(path)) from exc
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync one regular file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, *, files: bool = True) -> int:
    """One bottom-up pass: fsync every file, then its directory. Returns total file bytes.

    ``files=False`` fsyncs the directories only, for a tree whose every file was fsynced
    by its writer before it was closed (its data and inode are durable then, whichever
    process wrote it); the directory fsyncs still make the entries durable.
    """
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):  # symlinks and special files: not ours to count
                if files:
                    fsync_file(p)
                total += st.st_size
        fsync_dir(dirpath)
    return total


def write_file_synced(path: Path, data: bytes, *, exclusive: bool = False,
                      mode: int = 0o644) -> None:
    """Create or truncate ``path`` (``exclusive``: create only, FileExistsError if it
    exists), write ``data`` and fsync it (not its directory).

    Not atomic by itself: :func:`replace_file_synced` is.
    """
    fd = os.open(path, os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | os.O_WRONLY
                 | O_CLOEXEC, mode)
    try:
        with naming(path, "writing file"):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        with naming(path, "fsync of file"):
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_file_synced(path, data: bytes, *, mode: int = 0o644, tmp=None) -> None:
    """Replace ``path`` by a file holding ``data``, atomically: ``data`` is written and
    fsynced to ``tmp`` (default ``<path>.tmp.<pid>``), which is then renamed over ``path``
    (a crash leaves the old file or the new one, never a mix). The directory entry is not
    fsynced: callers that need the rename durable fsync the directory."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        write_file_synced(tmp, data, mode=mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def link_or_copy(src, dst) -> None:
    """Hard-link ``src`` as ``dst``; where the file system cannot (another device, no hard
    links), copy it and fsync the copy."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(src, dst)
        fsync_file(dst)


def _move_all(step, bufs: list, what: str) -> None:
    """Move every buffer of ``bufs`` with ``step(chunk) -> bytes moved`` (one vectored
    call), at most :data:`IOV_MAX` buffers a call; ``bufs`` is modified on a short move."""
    i, n = 0, len(bufs)
    while i < n:
        chunk = bufs[i:i + IOV_MAX]
        moved = step(chunk)
        if moved == sum(map(len, chunk)):
            i += len(chunk)
            continue
        if moved <= 0:
            raise OSError(errno.EIO, f"{what} moved {moved} bytes")
        for j, b in enumerate(chunk):  # short move: resume inside buffer i + j
            if moved < len(b):
                i += j
                bufs[i] = memoryview(b)[moved:]
                break
            moved -= len(b)


def writev_all(fd: int, bufs: list) -> None:
    """Write every buffer of ``bufs`` (bytes or 1-D byte memoryviews) in order.

    At most :data:`IOV_MAX` buffers go to one writev; ``bufs`` is modified on a partial write.
    """
    _move_all(lambda chunk: os.writev(fd, chunk), bufs, "writev")


def preadv_all(fd: int, bufs: list, offset: int) -> None:
    """Fill every buffer of ``bufs`` (writable 1-D byte memoryviews), in order, from ``fd``
    at ``offset``; OSError if the file ends first. ``bufs`` is modified on a short read."""
    at = [offset]

    def step(chunk):
        got = os.preadv(fd, chunk, at[0])
        at[0] += max(got, 0)
        return got

    _move_all(step, bufs, "preadv")


# Reads at least this long go into fresh populated memory (see pread_fresh).
FRESH_MIN = 64 << 10
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def fresh_buffer(size: int) -> mmap.mmap:
    """``size`` bytes of fresh memory for a read to fill: an anonymous mapping whose pages
    are made in one call (``MAP_POPULATE``) rather than faulted in one by one as the read
    fills them, and not zeroed twice as a bytearray is. Its memory goes back to the OS as
    soon as the last view of it goes (no allocator keeps it)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)


def pread_fresh(fd: int, length: int, offset: int):
    """:func:`pread_exact` into memory of its own that the caller keeps (a record a unit
    stores): at least :data:`FRESH_MIN` bytes go into a :func:`fresh_buffer` (a view of
    it is returned), shorter ones into a bytes object."""
    if length < FRESH_MIN:
        return pread_exact(fd, length, offset)
    view = memoryview(fresh_buffer(length))
    got = pread_into(fd, view, offset)
    return view if got == length else bytes(view[:got])


def pread_exact(fd: int, length: int, offset: int):
    """Read ``length`` bytes at ``offset``; returns fewer only at end of file."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    buf = bytearray(length)
    view = memoryview(buf)
    view[:len(data)] = data
    got = pread_into(fd, view, offset, len(data))
    return buf if got == length else bytes(view[:got])


def pread_into(fd: int, view: memoryview, offset: int, got: int = 0) -> int:
    """Read into ``view`` from its byte ``got`` on (file offset ``offset`` + ``got``) until
    it is full or the file ends; the bytes it then holds."""
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got
