"""Start and stop a deployment: one controller and N storage-unit processes (no torch)."""
from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import subprocess
import sys
import time

from ..layout import paths
from ..errors import StateDirInUseError, TqtxError
from ..process.servers import controller_command, stop_child, unit_command

log = logging.getLogger("tqtx.deploy")


def _read_announcement(proc: subprocess.Popen, what: str, timeout: float) -> dict:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            for line in buf.split(b"\n"):
                if line.startswith(b"TQTX "):
                    return json.loads(line[5:])
    finally:
        sel.close()
    rc = proc.poll()
    raise TqtxError(f"{what} did not start within {timeout:.0f}s"
                    + (f" (exit code {rc})" if rc is not None else ""))


class LocalDeployment:
    """A controller and ``num_units`` units as child processes of this one.

    Children exit when this process dies (they watch a pipe), and on :meth:`stop`.
    With ``owner_record`` (default) it writes ``<state_dir>/deployment.json`` once ready,
    so a bare ``tq.init()`` in another process attaches (see :mod:`tqtx.deploy.owner`); stop
    removes it. The durability setting comes from ``env`` over this process's environment
    (``TQTX_DURABILITY`` ..., :mod:`tqtx.deploy.durable`); every process gets it mapped.
    """

    def __init__(self, *, num_units: int = 2, state_dir: str, host: str = "127.0.0.1",
                 port: int = 0, start_timeout: float = 60.0, env: dict | None = None,
                 unit_env: dict | None = None, metrics: dict | None = None,
                 owner_record: bool = True):
        self.num_units = num_units
        self.state_dir = os.path.abspath(state_dir)
        self.host = host
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}
        self._parent_r, self._parent_w = os.pipe()
        os.set_inheritable(self._parent_r, False)
        self.env = {**os.environ, **(env or {})}
        # every process gets the mapped durability setting (tqtx.deploy.durable)
        from .durable import resolve as resolve_durability
        self.durability = resolve_durability({}, self.env)
        self.env.update(self.durability.env(self.state_dir))
        if metrics and metrics.get("enabled", True):
            # Prometheus export: controller at the base port, unit k at base + 1 + k.
            self.env["TQTX_METRICS_PORT"] = str(int(metrics.get("port") or 9464))
            self.env.setdefault("TQTX_METRICS_HOST", metrics.get("host") or host)
        self.metrics_port = int(self.env["TQTX_METRICS_PORT"]) if self.env.get(
            "TQTX_METRICS_PORT", "").strip() else None
        # unit ids as ints: a config that went through JSON/OmegaConf has them as strings
        self.unit_env = {int(k): v for k, v in (unit_env or {}).items()}
        self.stopped = False
        self.record: dict | None = None  # the owner record this process wrote (tqtx.deploy.owner)
        log_dir = paths.log_dir(self.state_dir)
        os.makedirs(log_dir, exist_ok=True)
        try:
            self._start_controller(port, start_timeout)
            procs = []
            for uid in range(num_units):
                procs.append((f"unit {uid}", self._start_unit(
                    uid, {**self.env, **self.unit_env.get(uid, {})})))
            for name, proc in procs:
                self._ready(name, proc, start_timeout)
            if owner_record:
                from .owner import publish
                self.record = publish(self)
        except BaseException:
            self.stop(graceful=False)
            raise
        atexit.register(self.stop)

    def _start(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        args = [*args, "--parent-fd", str(self._parent_r)]
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, env=env,
                                pass_fds=(self._parent_r,), stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        self.pids[name] = proc.pid
        return proc

    def _ready(self, name: str, proc: subprocess.Popen, timeout: float) -> dict:
        msg = _read_announcement(proc, name, timeout)
        if "error" in msg:
            if msg["error"] == "StateDirInUseError":
                raise StateDirInUseError(msg["message"])
            if msg["error"] == "PermissionError":
                raise PermissionError(msg["message"])
            raise TqtxError(f"{name} failed to start: {msg['error']}: {msg['message']}")
        return msg

    def _start_unit(self, uid: int, env: dict) -> subprocess.Popen:
        return self._start(f"unit {uid}", unit_command(
            controller=self.address, unit_id=uid, host=self.host, state_dir=self.state_dir,
            log_file=paths.process_log(self.state_dir, f"unit-{uid}")), env)

    def _start_controller(self, port: int, timeout: float, env: dict | None = None) -> None:
        proc = self._start("controller", controller_command(
            num_units=self.num_units, state_dir=self.state_dir, host=self.host, port=port,
            log_file=paths.process_log(self.state_dir, "controller")),
            {**self.env, **(env or {})})
        ctl = self._ready("controller", proc, timeout)
        self.address = ctl["ready"]  # with port 0, the one it bound: a restart reuses it
        self.incarnation = ctl.get("incarnation")

    def stop_controller(self, kill: bool = True, timeout: float = 10.0) -> None:
        """Kill -9 the controller (``kill=False``: SIGTERM, a clean stop); units keep running."""
        proc = self.procs.get("controller")
        if proc is not None:
            stop_child(proc, graceful=not kill, timeout=timeout)

    def restart_controller(self, kill: bool = True, timeout: float = 60.0,
                           env: dict | None = None) -> None:
        """Stop the controller (kill -9 unless ``kill=False``) and start a new incarnation
        on the same state dir, host and port (``env`` added to its environment), waiting
        for its ready announcement. The units keep running; attached clients reconnect to
        the same address by themselves."""
        if self.stopped:
            raise RuntimeError("the deployment is stopped")
        self.stop_controller(kill=kill)
        port = int(self.address.rsplit(":", 1)[1])
        self._start_controller(port, timeout, env)
        if self.record is not None:  # attached processes check the recorded pids
            from .owner import publish
            self.record = publish(self)

    def controller_replaced(self) -> bool:
        """Whether the controller process this deployment started has exited (another
        one, restarted by hand on its state dir and port, may serve its address)."""
        proc = self.procs.get("controller")
        return proc is not None and proc.poll() is not None

    def wait_state_dir_free(self, timeout: float = 10.0) -> bool:
        """Wait until no controller holds this deployment's ``controller.lock``."""
        return paths.controller_running(self.state_dir, timeout) is False

    def liveness(self, name: str):
        """A callable telling why process ``name`` is gone (None while it runs)."""
        def check():
            proc = self.procs.get(name)
            if proc is None or proc.poll() is None:
                return None
            return f"pid {proc.pid} exited with code {proc.returncode}"
        return check

    def restart_unit(self, uid: int, timeout: float = 60.0, env: dict | None = None) -> None:
        """Start unit ``uid`` again (after it died); it re-registers, empty or with the rows
        of its row log (durability buffer, sync)."""
        self.restart_units([uid], timeout, env)

    def restart_units(self, uids, timeout: float = 60.0, env: dict | None = None) -> None:
        """Start units ``uids`` again (after they died), all at once, and wait until every
        one has announced itself: their start-ups and row-log replays overlap."""
        started = []
        for uid in uids:
            name = f"unit {uid}"
            old = self.procs.get(name)
            if old is not None and old.poll() is None:
                raise RuntimeError(f"{name} is still running")
            started.append((name, self._start_unit(uid, {**self.env, **(env or {})})))
        for name, proc in started:
            self._ready(name, proc, timeout)
        if self.record is not None:  # attached processes check the recorded pids
            from .owner import publish
            self.record = publish(self)

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        lock = None
        if self.record is not None and self.record.get("owner_pid") == os.getpid():
            # Under the creation lock, so a concurrent tq.init() either attached before
            # (and sees the processes go) or starts a new deployment after they are gone.
            from . import owner
            lock = owner.creation_lock(self.state_dir)
            try:
                owner.acquire(lock, timeout=30.0)
            except TqtxError as exc:
                log.warning("stopping without the creation lock: %s", exc)
                lock = None
            owner.withdraw(self, self.record)
        try:
            self._stop_processes(graceful, timeout)
        finally:
            if lock is not None:
                lock.release()

    def _stop_processes(self, graceful: bool, timeout: float) -> None:
        # units first, then the controller, so the journal records a clean end
        for name, proc in sorted(self.procs.items(), key=lambda p: p[0] == "controller"):
            stop_child(proc, graceful=graceful, timeout=timeout)
        for fd in (self._parent_r, self._parent_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass
