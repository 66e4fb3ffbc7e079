"""Process plumbing shared by controller and unit processes (no torch)."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading


def watch_parent(fd: int | None) -> None:
    """Exit this process as soon as the parent's end of pipe ``fd`` closes (parent died)."""
    if fd is None or fd < 0:
        return

    def wait():
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os._exit(0)

    threading.Thread(target=wait, name="tqtx-parent-watch", daemon=True).start()


def announce(obj: dict) -> None:
    """Tell the launching process we are ready (or why we failed): one JSON line on stdout."""
    sys.stdout.write("TQTX " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def setup_logging(level: str | None = None, log_file: str | None = None, name: str = "") -> None:
    """stderr gets ``TQTX_LOG_LEVEL`` (WARNING); the log file gets at least INFO from ``tqtx.*``
    (``TQTX_LOG_FILE_LEVEL``, default INFO), so dump/restore lines always reach the file.
    Neither floods when it cannot be written (a full disk: :mod:`tqtx.logutil`)."""
    from .logutil import DiskSafeFileHandler, QuietStreamHandler
    level = (level or os.environ.get("TQTX_LOG_LEVEL", "WARNING")).upper()
    stderr = QuietStreamHandler(sys.stderr)
    stderr.setLevel(level)
    handlers: list[logging.Handler] = [stderr]
    tqtx_level = logging.getLevelName(level)
    if log_file:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        file_level = os.environ.get("TQTX_LOG_FILE_LEVEL", "INFO").upper()
        fh = DiskSafeFileHandler(log_file)  # a full disk drops records, never floods
        fh.setLevel(min(logging.getLevelName(file_level), tqtx_level))
        handlers.append(fh)
        tqtx_level = fh.level
    fmt = f"%(asctime)s {name}[%(process)d] %(name)s %(levelname)s %(message)s"
    # The root level filters other libraries; tqtx's own records pass at the file's level.
    logging.basicConfig(level=level, format=fmt, handlers=handlers, force=True)
    logging.getLogger("tqtx").setLevel(tqtx_level)


def stop_on_signals(stop) -> None:
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
