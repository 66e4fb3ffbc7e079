"""Helpers shared by the benchmarks: process memory, page cache, file system, cleanup, and
the JSON-lines protocol of their worker subprocesses.

Stdlib only: workers may run under another interpreter (e.g. a TransferQueue venv).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

MiB = 2**20


def median(xs):
    """Median of ``xs``, NaN when empty."""
    return statistics.median(xs) if xs else float("nan")


def fs_type(path: str) -> str:
    """File system type (``/proc/mounts``) of the mount holding ``path``."""
    path = os.path.realpath(path)
    best, fstype = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[2]
    return fstype


def proc_status(pid="self") -> dict:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak(pid="self") -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak RSS growth of a set of processes over a block (VmHWM after - VmRSS at reset)."""

    def __init__(self, pids):
        self.pids = list(pids)
        self.growth: dict = {}

    def __enter__(self):
        self.base = {}
        for p in self.pids:
            reset_peak(p)
            self.base[p] = proc_status(p)["VmRSS"]
        return self

    def __exit__(self, *exc):
        for p in self.pids:
            st = proc_status(p)
            self.growth[p] = max(0, st["VmHWM"] - self.base[p])
        return False

    @property
    def total(self) -> int:
        return sum(self.growth.values())


def drop_cache(*paths) -> None:
    """Evict the files' pages from the page cache (they are fsynced, so clean)."""
    for path in paths:
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for fn in files:
            try:
                fd = os.open(fn, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rm(path) -> None:
    """Remove a dump dir or file and its siblings (journal, lock, staging ...)."""
    for p in [path, *glob.glob(glob.escape(path) + ".*")]:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def timed_background_dump(tq, path, keys, pid) -> tuple[float, float]:
    """``dump_data_by_key(block=False)`` to ``path``: (seconds until the call returned,
    seconds until ``result()`` did); the dump is removed afterwards."""
    t0 = time.perf_counter()
    handle = tq.dump_data_by_key(path, keys, pid, block=False)
    t1 = time.perf_counter()
    handle.result()
    t2 = time.perf_counter()
    rm(path)
    return t1 - t0, t2 - t0


def files_of(dump_dir):
    """Every file under ``dump_dir``, sorted."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(dump_dir) for f in fs)


# ---------------------------------------------------------------- worker subprocesses
# Commands go to a worker's stdin as JSON lines ({"op": ..., ...}; {"op": "stop"} ends it);
# it answers each on the --result-fd pipe with {"result": ...} or {"error": "..."} (its
# stdout stays free for the libraries it runs).
def error_reply(exc: BaseException) -> str:
    """The ``{"error": ...}`` answer line for ``exc``."""
    return json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n"


def serve(res, handle) -> None:
    """Worker side: answer each command on stdin with ``handle(cmd)`` on ``res`` until stop."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        try:
            res.write(json.dumps({"result": handle(cmd)}) + "\n")
        except Exception as exc:
            res.write(error_reply(exc))


class JsonWorker:
    """Parent side: a worker subprocess, ``argv`` plus ``--result-fd N``, stderr to ``log``."""

    def __init__(self, name: str, argv, log: str, env=None, cwd=None):
        r, w = os.pipe()
        self.name = name
        self.proc = subprocess.Popen(
            [*argv, "--result-fd", str(w)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=open(log, "a"),
            pass_fds=(w,), env=env, text=True, cwd=cwd)
        os.close(w)
        self.res = os.fdopen(r)

    def read(self) -> dict:
        """The next answer; RuntimeError if it is an error or the worker has exited."""
        line = self.res.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()}); "
                               f"see its log")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name} worker: {msg['error']}")
        return msg

    def call(self, op: str, **fields):
        """Send ``{"op": op, **fields}``; the answer's result."""
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.read()["result"]

    def stop(self) -> None:
        """Ask the worker to stop; kill it if it cannot be told or takes over 120 s."""
        try:
            self.proc.stdin.write('{"op": "stop"}\n')
            self.proc.stdin.flush()
            self.proc.wait(120)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


_REPLAYED = re.compile(r"replayed (\d+) keys .* in ([0-9.]+)s")


def replay_logged(state_dir: str):
    """(keys, seconds) of the last replay line in the controller's log, or None."""
    try:
        with open(os.path.join(state_dir, "logs", "controller.log"), errors="replace") as f:
            hits = _REPLAYED.findall(f.read())
    except OSError:
        return None
    return (int(hits[-1][0]), float(hits[-1][1])) if hits else None
