"""Process plumbing shared by controller and unit processes and the code that starts them
(no torch): their command lines, the parent watch, the ready announcement, logging, stop."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

CONTROLLER_MODULE = "tqtx.controller"
UNIT_MODULE = "tqtx.storage"


def controller_args(*, num_units: int, state_dir: str, host: str, port: int | str,
                    log_file: str | None = None) -> list[str]:
    """The options of ``python -m tqtx.controller`` (its ``main(argv)``)."""
    args = ["--units", str(num_units), "--state-dir", state_dir, "--host", host,
            "--port", str(port)]
    return args + (["--log-file", log_file] if log_file else [])


def unit_args(*, controller: str, unit_id: int, host: str, port: int | str | None = None,
              state_dir: str | None = None, log_file: str | None = None) -> list[str]:
    """The options of ``python -m tqtx.storage`` (its ``main(argv)``); without
    ``state_dir`` the unit finds the deployment's keys by ``$TQTX_KEYS_DIR``."""
    args = ["--controller", controller, "--unit-id", str(unit_id), "--host", host]
    if port is not None:
        args += ["--port", str(port)]
    if state_dir is not None:
        args += ["--state-dir", state_dir]
    return args + (["--log-file", log_file] if log_file else [])


def controller_command(**options) -> list[str]:
    """``-m tqtx.controller`` and :func:`controller_args` (after ``sys.executable``)."""
    return ["-m", CONTROLLER_MODULE, *controller_args(**options)]


def unit_command(**options) -> list[str]:
    """``-m tqtx.storage`` and :func:`unit_args` (after ``sys.executable``)."""
    return ["-m", UNIT_MODULE, *unit_args(**options)]


def stop_child(proc: subprocess.Popen, *, graceful: bool = True,
               timeout: float = 10.0) -> int | None:
    """Stop a server child process: SIGTERM and up to ``timeout`` seconds for it to exit
    (``graceful``), then SIGKILL and up to 5 s more; its stdout pipe is closed. Returns its
    exit code (None if it outlived even that)."""
    if graceful and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
    rc = None
    try:
        rc = proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if proc.stdout is not None:
        proc.stdout.close()
    return rc


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
    Neither floods when it cannot be written (a full disk: :mod:`tqtx.process.logutil`)."""
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


def exit_now(rc: int, flush=None) -> None:
    """End a server process. After a clean stop (``rc`` 0: its loop ended, its journal
    closed, its lock released) skip the interpreter's finalization -- tearing down
    SQLAlchemy's and tqtx's modules costs a controller ~0.25 s of CPU at every stop and
    protects no data -- after doing what a normal exit does first: the threading module's
    shutdown (exit hooks such as concurrent.futures', then non-daemon threads awaited),
    ``flush()`` (the messaging layer sends what it still holds, e.g. the reply to
    SHUTDOWN), the logging handlers flushed and closed, stdio flushed. Any other code exits
    normally."""
    if rc != 0:
        sys.exit(rc)
    threading._shutdown()  # what Py_FinalizeEx runs first (CPython 3.8+)
    if flush is not None:
        flush()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)
