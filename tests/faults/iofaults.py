"""Counting / failing wrappers around ``os`` I/O calls, limited to paths under one root.

``os.write``/``writev``/``fsync``/``pread`` act on file descriptors: the wrapper tracks the
descriptors ``os.open`` returned for paths under ``root`` (and forgets them on
``os.close``), so ZeroMQ, SQLite (which does its I/O in C anyway) and pytest are untouched.
``os.rename``/``replace``/``mkdir`` are matched on their path arguments.

Ops are named ``write``, ``writev``, ``fsync-file``, ``fsync-dir``, ``rename``, ``replace``,
``mkdir``, ``pread``.
"""
from __future__ import annotations

import errno as errno_mod
import os
import stat
import threading
from collections import Counter

FD_OPS = {"write": "write", "writev": "writev", "pread": "pread", "preadv": "preadv"}
PATH_OPS = ("rename", "replace", "mkdir")


class IOFaults:
    def __init__(self, monkeypatch, root):
        self.root = os.path.realpath(os.fspath(root))
        self.mp = monkeypatch
        self.lock = threading.Lock()
        self.fds: dict[int, bool] = {}        # tracked fd -> is a directory
        self.counts: Counter = Counter()
        self.target: tuple[str, int, int, bool] | None = None   # op, k, errno, persistent
        self.injected: list[dict] = []
        self._real = {n: getattr(os, n) for n in
                      ("open", "close", "write", "writev", "fsync", "pread", "preadv",
                       "rename", "replace", "mkdir")}
        self._install()

    # ------------------------------------------------------------------ control
    def arm(self, op: str, k: int, err: int, persistent: bool) -> None:
        with self.lock:
            self.counts.clear()
            self.injected.clear()
            self.target = (op, k, err, persistent)

    def count_only(self) -> None:
        with self.lock:
            self.counts.clear()
            self.injected.clear()
            self.target = None

    def disarm(self) -> None:
        with self.lock:
            self.target = None

    # ------------------------------------------------------------------ internals
    def _under(self, path) -> bool:
        try:
            p = os.path.realpath(os.fspath(path))
        except TypeError:
            return False
        return p == self.root or p.startswith(self.root + os.sep)

    def _check(self, op: str, detail: str, existed: bool = False) -> None:
        with self.lock:
            self.counts[op] += 1
            n = self.counts[op]
            t = self.target
            if t is None or t[0] != op:
                return
            _, k, err, persistent = t
            if n == k or (persistent and n > k):
                self.injected.append({"op": op, "n": n, "detail": detail, "existed": existed})
                raise OSError(err, os.strerror(err) + f" (injected: {op} #{n})")

    def _install(self) -> None:
        real = self._real
        me = self

        def w_open(path, flags, mode=0o777, *, dir_fd=None):
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if dir_fd is None and me._under(path):
                try:
                    isdir = stat.S_ISDIR(os.fstat(fd).st_mode)
                except OSError:
                    isdir = False
                with me.lock:
                    me.fds[fd] = isdir
            return fd

        def w_close(fd):
            with me.lock:
                me.fds.pop(fd, None)
            return real["close"](fd)

        def fdop(name):
            fn = real[name]

            def wrapper(fd, *args, **kw):
                if fd in me.fds:
                    me._check(name, f"fd {fd}")
                return fn(fd, *args, **kw)
            return wrapper

        def w_fsync(fd):
            isdir = me.fds.get(fd if isinstance(fd, int) else fd.fileno())
            if isdir is not None:
                me._check("fsync-dir" if isdir else "fsync-file", f"fd {fd}")
            return real["fsync"](fd)

        def pathop(name):
            fn = real[name]

            def wrapper(src, *args, **kw):
                if me._under(src):
                    me._check(name, os.fspath(src), existed=os.path.exists(src))
                return fn(src, *args, **kw)
            return wrapper

        mp = self.mp
        mp.setattr(os, "open", w_open)
        mp.setattr(os, "close", w_close)
        for name in ("write", "writev", "pread", "preadv"):
            mp.setattr(os, name, fdop(name))
        mp.setattr(os, "fsync", w_fsync)
        for name in PATH_OPS:
            mp.setattr(os, name, pathop(name))


ERRNOS = {"ENOSPC": errno_mod.ENOSPC, "EIO": errno_mod.EIO}
