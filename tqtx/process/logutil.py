"""Logging that a full disk cannot turn into a flood (no torch; servers use it).

* :class:`Throttle`: one line per kind of failure, then at most one per ``every`` seconds
  saying how many were not logged since; a failing journal write under a stream of puts
  is one line a minute, not a traceback per put.
* :class:`DiskSafeFileHandler` / :class:`QuietStreamHandler`: a log file (or stderr) that
  cannot be written drops its records instead of printing ``--- Logging error ---`` and a
  traceback for each; the file handler says so once on stderr, reopens its file at the next
  record and, once that works, writes how many records it dropped.
"""
from __future__ import annotations

import logging
import sys
import threading
import time


class Throttle:
    """Rate-limits log lines by key: :meth:`allow` says whether to log now, and how many
    lines of that key were held back since the last one."""

    def __init__(self, every: float = 60.0, keys: int = 256):
        self.every, self.keys = every, keys
        self._last: dict = {}  # key -> [time logged, held back since]
        self._lock = threading.Lock()

    def allow(self, key) -> tuple[bool, int]:
        now = time.monotonic()
        with self._lock:
            entry = self._last.get(key)
            if entry is None or now - entry[0] >= self.every:
                held = 0 if entry is None else entry[1]
                if entry is None and len(self._last) >= self.keys:
                    self._last.clear()  # bounded: forget old kinds rather than grow
                self._last[key] = [now, 0]
                return True, held
            entry[1] += 1
            return False, entry[1]


def log_throttled(logger: logging.Logger, throttle: Throttle, key, level: int, msg: str,
                  *args) -> None:
    """``logger.log(level, msg, *args)`` unless ``throttle`` holds ``key`` back; the line
    that gets through says how many it held back."""
    ok, held = throttle.allow(key)
    if ok:
        if held:
            msg += " (and %d more like it since the last such line)"
            args = (*args, held)
        logger.log(level, msg, *args)


class DiskSafeFileHandler(logging.FileHandler):
    """A FileHandler whose write errors (a full disk) drop records quietly: one line on
    stderr when it starts failing, the file reopened at the next record, and a line in the
    file saying how many records were dropped once it can write again."""

    def __init__(self, filename, mode: str = "a", encoding=None, delay: bool = False):
        super().__init__(filename, mode, encoding, delay)
        self.dropped = 0
        self._failed = False

    def emit(self, record) -> None:
        try:
            if self.stream is None:
                self.stream = self._open()
        except OSError:
            self._drop(sys.exc_info()[1])
            return
        self._failed = False
        logging.StreamHandler.emit(self, record)
        if not self._failed and self.dropped:
            dropped, self.dropped = self.dropped, 0
            note = logging.LogRecord(record.name, logging.WARNING, __file__, 0,
                                     "log file %s could be written again: %d records were "
                                     "dropped while it could not", (self.baseFilename,
                                                                    dropped), None)
            logging.StreamHandler.emit(self, note)

    def handleError(self, record) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            self._drop(exc)
        else:
            super().handleError(record)

    def _drop(self, exc: BaseException) -> None:
        self._failed = True
        first = self.dropped == 0
        self.dropped += 1
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                stream.close()  # its buffer cannot be written either
            except OSError:
                pass
        if first:
            try:
                sys.stderr.write(f"tqtx: cannot write log file {self.baseFilename} ({exc}); "
                                 f"dropping its records until it can\n")
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - stderr may be on the same full disk
                pass


class QuietStreamHandler(logging.StreamHandler):
    """A StreamHandler (stderr) that drops a record it cannot write (a full disk under a
    redirected stderr, a closed pipe) instead of printing a traceback about it there."""

    def handleError(self, record) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)
