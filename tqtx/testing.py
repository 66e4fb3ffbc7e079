"""In-process deployments for tests: a controller and N units as daemon threads.

Everything (controller, units, client, dump writer) runs in the calling process, so a test
can patch ``os`` functions, count calls or configure :mod:`tqtx.faults` and see every layer
react. Payload still travels over ZeroMQ (tcp on 127.0.0.1) exactly as in production::

    with InProcessDeployment(2, tmp_path / "state") as dep:
        dep.put("p", keys, {"x": tensor})
        tqtx.dump.save.dump_data_by_key(dep.client, dump_dir, keys, "p")

:meth:`InProcessDeployment.activate` also makes the module-level :mod:`tqtx.api` functions
(``tq.kv_batch_put``, ``tq.kv_batch_get``, ...) talk to this deployment.
"""
from __future__ import annotations

import contextlib
import os
import threading

from .client.client import Client
from .controller.server import Controller
from .storage.logdir import row_log_options
from .storage.unit import StorageUnit
from .wire.peer import Peer

__all__ = ["InProcessDeployment"]


class InProcessDeployment:
    """A controller and ``num_units`` storage units serving from threads of this process.

    ``durability``, ``flush_interval_s`` and ``unit_data_dir``: the deployment's durability
    setting (:mod:`tqtx.deploy.durable`; default: this process's ``TQTX_*`` variables, else
    ``"controller"``), given to the controller directly and to the units through the
    environment they are made in (:attr:`durability`)."""

    def __init__(self, num_units: int = 2, state_dir: str | os.PathLike = "", *,
                 timeout: float = 30.0, durability: str | None = None,
                 flush_interval_s: float | None = None,
                 unit_data_dir: str | os.PathLike | None = None):
        from .deploy.durable import resolve as resolve_durability
        if not state_dir:
            raise ValueError("state_dir is required")
        self.num_units = num_units
        self.state_dir = os.path.abspath(os.fspath(state_dir))
        self.timeout = timeout
        self.durability = resolve_durability({"durability": durability,
                                              "flush_interval_s": flush_interval_s,
                                              "unit_data_dir": unit_data_dir})
        self.threads: list[threading.Thread] = []
        self.units: list[StorageUnit] = []
        self.stopped = False
        self._saved_api = None
        self.controller = Controller(num_units=num_units, state_dir=self.state_dir,
                                     durability=self.durability.durability,
                                     flush_interval_s=self.durability.flush_interval_s)
        self.address = self.controller.address
        self._serve(self.controller.serve_forever, "controller")
        try:
            for uid in range(num_units):
                with self._unit_environment():
                    unit = StorageUnit(uid, self.address,
                                       **row_log_options(uid, self.state_dir))
                self.units.append(unit)
                self._serve(unit.serve_forever, f"unit-{uid}")
                unit.attach.register(timeout=timeout)
            self.client = Client(self.address, timeout=timeout, wait_ready=timeout)
        except BaseException:
            self.stop()
            raise

    @contextlib.contextmanager
    def _unit_environment(self):
        """This deployment's ``TQTX_DURABILITY`` ... in ``os.environ`` while a unit is made
        (:func:`tqtx.storage.rowlog.row_log_options` reads it from there)."""
        wanted = self.durability.env(self.state_dir)
        saved = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _serve(self, fn, name: str) -> None:
        t = threading.Thread(target=fn, name=f"tqtx-inproc-{name}", daemon=True)
        t.start()
        self.threads.append(t)

    # ------------------------------------------------------------------ helpers
    def activate(self) -> "InProcessDeployment":
        """Point :mod:`tqtx.api` (``tq.kv_*``, ``tq.dump_data_by_key`` ...) at this deployment."""
        from . import api
        with api._lock:
            if self._saved_api is None:
                self._saved_api = (api._client, api._deployment, api._config)
            api._client = self.client
            api._deployment = None
            api._config = {"mode": "in-process", "address": self.address,
                           "num_units": self.num_units, "state_dir": self.state_dir,
                           "timeout": self.timeout, "units": self.client.unit_addresses}
        return self

    def deactivate(self) -> None:
        from . import api
        if self._saved_api is not None:
            with api._lock:
                if api._client is self.client:
                    api._client, api._deployment, api._config = self._saved_api
            self._saved_api = None

    def unit_stats(self) -> list[dict]:
        return [self.client.unit(u).call("STATS") for u in range(self.num_units)]

    # ------------------------------------------------------------------ lifecycle
    def stop(self, timeout: float = 10.0, *, keep_buffer: bool = False) -> None:
        """SHUTDOWN every unit (``{"keep_buffer": keep_buffer}``: whether it keeps its row
        log), then the controller; wait for their threads."""
        if self.stopped:
            return
        self.stopped = True
        self.deactivate()
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        for unit in self.units:
            self._shutdown(unit.address, f"unit {unit.unit_id}", {"keep_buffer": keep_buffer})
        self._shutdown(self.address, "controller")
        for t in self.threads:
            t.join(timeout)

    @staticmethod
    def _shutdown(address: str, name: str, body: dict | None = None) -> None:
        peer = Peer(address, name, timeout=5.0)
        try:
            peer.call("SHUTDOWN", body or {}, timeout=5.0)
        except Exception:  # already gone: nothing to stop
            pass
        finally:
            peer.close()

    def alive(self) -> list[str]:
        return [t.name for t in self.threads if t.is_alive()]

    def __enter__(self) -> "InProcessDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
