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
    level = level or os.environ.get("TQTX_LOG_LEVEL", "WARNING")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    fmt = f"%(asctime)s {name}[%(process)d] %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, handlers=handlers, force=True)
    logging.getLogger("tqtx").setLevel(level.upper())


def stop_on_signals(stop) -> None:
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
