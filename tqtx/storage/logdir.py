"""A unit's row log directory: owned by one unit process, listed, replayed, removed.

The files are :mod:`tqtx.format.rowlog`'s; :mod:`tqtx.storage.rowlog` writes them. Replay
applies the newest base, then the segments from its number on, each up to its last whole
entry (a crash in the middle of a write leaves a torn tail, which is logged and left
behind); files a base replaced, and unfinished bases (both written by earlier releases'
compaction), are removed.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import filelock

from ..layout import fsutil
from ..errors import DumpFormatError
from ..format import rowlog as fl
from .rows import drop_from, store_into

log = logging.getLogger("tqtx.unit")

LOCK = "lock"


class LogDir:
    """The row log directory ``directory``, held (flock) by this process: a second unit
    process on it is refused."""

    def __init__(self, directory: str):
        self.dir = os.fspath(directory)
        os.makedirs(self.dir, exist_ok=True)
        # not thread-local: the unit opens its log on one thread and closes it on another
        self._lock = filelock.FileLock(os.path.join(self.dir, LOCK), thread_local=False)
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise RuntimeError(f"{self.dir}: another unit process holds this row log") from None

    def path(self, kind: str, number: int, *, tmp: bool = False) -> str:
        return os.path.join(self.dir, fl.file_name(kind, number, tmp=tmp))

    def list(self, *, tmp: bool = False) -> list[tuple[str, int]]:
        """``(kind, number)`` of the log's files, sorted; with ``tmp`` those of bases
        being written (or left unfinished by a crash) instead."""
        out = []
        for name in os.listdir(self.dir):
            parsed = fl.parse_name(name)
            if parsed is not None and parsed[2] == tmp:
                out.append(parsed[:2])
        return sorted(out)

    @staticmethod
    def remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def replay(self, store: Callable[[int, int, dict], object],
               drop: Callable[[int, int], object],
               reset: Callable[[], object], *,
               mark: Callable[[str, str, int], object] | None = None,
               on_file: Callable[[str, int, int], object] | None = None
               ) -> tuple[dict, int, int]:
        """Apply the log through ``store(index, gen, values)``, ``drop(index, gen)``,
        ``reset()`` and ``mark(what, id, rows)`` (``on_file(kind, number, size)`` before
        each file's entries). Returns
        ``(stats, highest file number, bytes of the files replayed)``, stats
        ``{"entries", "bytes", "files", "seconds", "torn"}``."""
        t0 = time.perf_counter()
        for kind, n in self.list(tmp=True):  # a base an earlier release did not finish
            self.remove(self.path(kind, n, tmp=True))
        files = self.list()
        order = fl.replay_order(files)
        stats = {"files": len(order)}
        starts = None if on_file is None else \
            (lambda i, size: on_file(order[i][0], order[i][1], size))
        stats.update(replay_files([self.path(k, n) for k, n in order], store, drop, reset,
                                  mark=mark, on_file=starts))
        for kind, n in files:
            if (kind, n) not in order:
                self.remove(self.path(kind, n))
        disk = sum(os.path.getsize(self.path(k, n)) for k, n in order)
        stats["seconds"] = time.perf_counter() - t0
        return stats, max([n for _k, n in files] + [0]), disk

    def release(self, *, remove: bool = False) -> None:
        """Let go of the directory; with ``remove`` delete the log's files first (and the
        directory, if nothing else is in it: other files are not ours to remove)."""
        if remove:
            for kind, n in self.list():
                self.remove(self.path(kind, n))
            for kind, n in self.list(tmp=True):
                self.remove(self.path(kind, n, tmp=True))
        self._lock.release()
        if remove:
            self.remove(os.path.join(self.dir, LOCK))
            try:
                os.rmdir(self.dir)
            except OSError:
                pass


def row_log_options(unit_id: int, state_dir: str | None) -> dict:
    """The row log arguments of :class:`~tqtx.storage.unit.StorageUnit` from the durability
    setting the unit process was started with (``$TQTX_DURABILITY``,
    ``$TQTX_FLUSH_INTERVAL_S``): ``log_dir`` None unless ``buffer`` or ``sync``, then this
    unit's directory under ``$TQTX_UNIT_DATA_DIR``, else under ``<state dir>/units``."""
    from .. import durability as dur
    from ..layout.paths import unit_data_root
    setting, interval = dur.from_env()
    if setting not in dur.LOGGED:
        return {"log_dir": None, "sync": False, "flush_interval": interval}
    base = os.environ.get(dur.ENV_UNIT_DATA_DIR) or (
        unit_data_root(state_dir) if state_dir else None)
    if base is None:
        raise ValueError(f"durability {setting!r}: unit {unit_id} needs a data directory "
                         f"for its row log: pass --state-dir or set {dur.ENV_UNIT_DATA_DIR}")
    return {"log_dir": dur.unit_dir(base, unit_id), "sync": setting == dur.SYNC,
            "flush_interval": interval}


def replay_files(paths: list[str], store, drop, reset, *, mark=None, strict: bool = False,
                 on_file=None) -> dict:
    """Apply the entries of ``paths``, in order, through ``store(index, gen, values)``,
    ``drop(index, gen)``, ``reset()`` and ``mark(what, id, rows)`` (marks are skipped
    without it; ``on_file(position, size)`` before each file's):
    ``{"entries", "bytes", "torn"}``. A file whose end is not a whole entry is replayed up
    to it and logged (``torn``), or with ``strict`` (a checkpoint's files, which were
    complete when saved) DumpFormatError."""
    stats = {"entries": 0, "bytes": 0, "torn": []}
    # The next file is read (a sequential read at the disk's pace, its pages faulted in by
    # the kernel) in a thread while this one's entries are decoded and applied.
    with ThreadPoolExecutor(1, thread_name_prefix="tqtx-replay-read") as reader:
        ahead = reader.submit(_read_whole, paths[0]) if paths else None
        for pos, path in enumerate(paths):
            read = ahead.result()
            ahead = reader.submit(_read_whole, paths[pos + 1]) if pos + 1 < len(paths) \
                else None
            if on_file is not None:
                on_file(pos, read[2])
            entries, good, size = _apply_file(path, read, store, drop, reset, mark)
            stats["entries"] += entries
            stats["bytes"] += good
            if good == size:
                continue
            if strict:
                raise DumpFormatError(f"{path}: the entry at offset {good} is truncated or "
                                      f"its checksum does not match")
            stats["torn"].append(path)
            log.warning("row log %s: %d bytes after offset %d are not a whole entry "
                        "(a write the process did not finish); the entries before are "
                        "replayed", path, size - good, good)
    return stats


def read_rows(paths: list[str]) -> tuple[dict[int, dict], dict[int, int]]:
    """The rows (and their generations) that a complete set of log files holds, replayed
    as a unit would (a checkpoint's files: every entry must be whole, see
    :func:`replay_files`)."""
    rows: dict[int, dict] = {}
    gens: dict[int, int] = {}

    def reset():
        rows.clear()
        gens.clear()

    replay_files(paths, lambda i, g, v: store_into(rows, gens, i, g, v),
                 lambda i, g: drop_from(rows, gens, i, g), reset, strict=True)
    return rows, gens


def _read_whole(path: str) -> tuple[memoryview | None, int, int]:
    """``(buffer, bytes read, file size)`` of one file, read whole into fresh memory (the
    kernel copying at the disk's pace): the rows' tensor values become views of it, no
    second copy. The caller copies the values out of a buffer that holds mostly dead
    entries (:func:`~tqtx.storage.rows.own_sparse_views`), so it can go."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None, 0, 0
        view = memoryview(fsutil.fresh_buffer(size))
        return view, fsutil.pread_into(f.fileno(), view, 0), size


def _apply_file(path: str, read: tuple, store, drop, reset, mark) -> tuple[int, int, int]:
    """``(entries applied, bytes of whole entries, file size)`` of one file that
    :func:`_read_whole` read."""
    view, got, size = read
    if view is None:
        return 0, 0, 0
    try:
        entries = 0
        reader = fl.EntryReader(view, got)
        for entry in reader:
            _apply(entry, f"{path} at {reader.end}", store, drop, reset, mark)
            entries += 1
        return entries, reader.end, size
    finally:
        view.release()


def _apply(entry, where: str, store, drop, reset, mark) -> None:
    """Apply one entry (tensor values stay views of the file's buffer)."""
    kind, idx, gen, body = entry
    if kind == fl.ROW:
        store(idx, gen, fl.decode_row(body, idx, where))
    elif kind == fl.DROP:
        for i, g in zip(*fl.decode_drop(body)):
            drop(i, g)
    elif kind == fl.RESET:
        reset()
    elif mark is not None:
        try:
            mark(*fl.decode_mark(body))
        except ValueError as exc:
            raise DumpFormatError(f"{where}: {exc}") from None
