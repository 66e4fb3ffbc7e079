"""Ray placement: a controller and N units as Ray actors owning the real server processes.

``tq.init({"placement": "ray", "num_units": N})`` (see docs/deployment.md):

* The controller's actor is pinned to the driver's node (the state dir and journal live
  there) and is the deployment's named actor in namespace ``tqtx`` (``ray_name``, default
  ``tqtx-<job id>``): any process of the job calling a bare ``tq.init()`` attaches.
* Units are hard-pinned (``NodeAffinitySchedulingStrategy(soft=False)``) round-robin over
  the alive nodes in node-ID order, only nodes with a positive ``unit_node_resource`` if
  given, skipping nodes whose CPUs are all taken by earlier units (``ray_num_cpus`` each).
* Start-up is bounded by ``ray_start_timeout``: a placement that cannot fit fails at once
  naming what is missing; actors Ray does not schedule in time fail naming the units, their
  nodes and the resources asked; either way every actor started is killed first.
* The actors are owned by the creating driver (not detached): they, and the server
  processes they own, end with ``close()`` or with the driver, even a SIGKILLed one.

This module imports Ray; only :mod:`tqtx.placement.ray_init` imports it, and only when Ray
placement is asked for or Ray is already initialized in this process.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..layout import paths
from ..errors import StateDirInUseError, TqtxError
from ..process.servers import controller_command, unit_command
from .plan import RayPlacementError, node_label, plan_units
from .ray_host import ServerHost, read_key_files

log = logging.getLogger("tqtx.ray")

NAMESPACE = "tqtx"
RECORD_VERSION = 1
STOPPED = {"stopped": True}  # the named actor's record while its deployment stops
NODE_CACHE_SECONDS = 1.0


class DeploymentNameTaken(TqtxError):
    """The job's deployment name is taken: another process created it (attach instead)."""


def default_name() -> str:
    """The named actor of this Ray job's deployment: ``tqtx-<job id>``."""
    return f"tqtx-{ray.get_runtime_context().get_job_id()}"


# ---------------------------------------------------------------- keys
def _curve_keys(cfg: dict, state_dir: str, wanted: bool) -> dict | None:
    """The key files every server gets: the state dir's (or ``keys_dir``'s) keys if it has
    some, else fresh keys made for this deployment when CURVE is ``wanted``, else None."""
    from ..wire import security
    keys_dir = cfg.get("keys_dir") or security.keys_dir_for(state_dir)
    if keys_dir and security.has_server_keys(keys_dir):
        return read_key_files(keys_dir)
    if not wanted:
        return None
    import zmq.auth
    tmp = tempfile.mkdtemp(prefix="tqtx-keys-")  # fresh keys for this deployment only
    zmq.auth.create_certificates(tmp, "server")
    zmq.auth.create_certificates(tmp, "client")
    os.makedirs(os.path.join(tmp, "authorized"), mode=0o700)
    shutil.copyfile(os.path.join(tmp, "client.key"), os.path.join(tmp, "authorized", "client.key"))
    try:
        return read_key_files(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _z85(text: str, secret: bool) -> str:
    key = "secret-key" if secret else "public-key"
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(key):
            return line.split("=", 1)[1].strip().strip('"')
    raise ValueError(f"no {key} in certificate")


def record_curve(rec: dict):
    """The client socket configurator for a recorded Ray deployment (None: plain)."""
    if not rec.get("curve"):
        return None
    from ..wire.security import _client_configurator
    return _client_configurator(rec["server_key"].encode(), rec["client_public"].encode(),
                                rec["client_secret"].encode())


# A scheduled server process announces itself within this many seconds (as LocalDeployment).
PROCESS_START_TIMEOUT = 60.0


# ---------------------------------------------------------------- node liveness
class _Nodes:
    """Which Ray nodes are alive, read from the GCS at most once a second."""

    def __init__(self):
        self._alive: dict[str, bool] = {}
        self._at = 0.0
        self._lock = threading.Lock()

    def gone(self, node_id: str) -> bool:
        with self._lock:
            if time.monotonic() - self._at > NODE_CACHE_SECONDS:
                try:
                    self._alive = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
                except Exception:  # Ray itself is going away: say nothing rather than guess
                    return False
                self._at = time.monotonic()
            return self._alive.get(node_id) is False


class _RayTopology:
    """What the client asks of a Ray deployment: names with nodes, node liveness."""

    units_local = False

    def _init_nodes(self, nodes: dict):
        self.nodes = nodes  # process name -> {"node_id", "ip", "hostname"}
        self._node_state = _Nodes()

    def node_of(self, name: str) -> str | None:
        n = self.nodes.get(name)
        return node_label(n["node_id"], n.get("ip")) if n else None

    def unit_node(self, uid: int) -> str | None:
        return self.node_of(f"unit {uid}")

    def peer_name(self, name: str) -> str:
        node = self.node_of(name)
        return f"{name} (node {node})" if node else name

    def liveness(self, name: str):
        node = self.nodes.get(name)

        def check():
            if node is not None and self._node_state.gone(node["node_id"]):
                return f"its node {node_label(node['node_id'], node.get('ip'))} left the Ray cluster"
            return None
        return check


class RayAttached(_RayTopology):
    """A Ray deployment this process attached to through its named actor."""

    def __init__(self, rec: dict):
        self.record = rec
        self._init_nodes(rec.get("nodes") or {})


# ---------------------------------------------------------------- the deployment
class RayDeployment(_RayTopology):
    """The controller and ``num_units`` units as Ray actors, created by this process."""

    def __init__(self, *, num_units: int, state_dir: str, cfg: dict, name: str | None = None):
        self.num_units = num_units
        self.state_dir = os.path.abspath(state_dir)
        self.name = name or default_name()
        self.start_timeout = float(cfg.get("ray_start_timeout") or 60.0)
        self.num_cpus = float(cfg.get("ray_num_cpus", 1.0))
        self.resource = cfg.get("unit_node_resource") or None
        self.actors: dict[str, object] = {}
        self.pids: dict[str, int] = {}
        self.logs: dict[str, str] = {}
        self.stopped = False
        self.record: dict | None = None
        self._init_nodes({})
        env = {k: str(v) for k, v in (cfg.get("env") or {}).items()}
        if cfg.get("insecure"):
            env["TQTX_INSECURE"] = "1"
        # The servers' environment is their node's, not this process's: the durability
        # setting goes in explicitly, a "~" unit data dir left for the unit's node to expand.
        from ..deploy.durable import resolve as resolve_durability
        self.durability = resolve_durability(cfg)
        env.update(self.durability.env(self.state_dir, expand_user=False))
        unit_env = {int(k): v for k, v in (cfg.get("unit_env") or {}).items()}
        deadline = time.monotonic() + self.start_timeout
        try:
            if _find_actor(self.name) is not None:
                raise DeploymentNameTaken(
                    f"a tqtx deployment named {self.name!r} already runs in Ray namespace "
                    f"{NAMESPACE!r}; attach with a bare tq.init() or give another ray_name")
            plan = plan_units(ray.nodes(), num_units, self.resource, self.num_cpus)
            here = ray.get_runtime_context().get_node_id()
            ips = {n.get("NodeManagerAddress") for n in plan} | {_node_ip(here)}
            from ..wire.security import is_loopback
            self.curve = env.get("TQTX_CURVE") == "1" or not all(is_loopback(ip or "") for ip in ips)
            key_files = _curve_keys(cfg, self.state_dir, self.curve)
            self.curve = key_files is not None and (self.curve or bool(cfg.get("keys_dir")))
            if self.curve:
                env["TQTX_CURVE"] = "1"  # every process of the deployment speaks CURVE
            host = ray.remote(ServerHost)
            try:
                ctl = host.options(
                    name=self.name, namespace=NAMESPACE, num_cpus=0, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
                ).remote("controller")
            except ValueError as exc:  # another process of the job took the name first
                raise DeploymentNameTaken(f"tqtx deployment {self.name!r}: {exc}") from None
            self.actors["controller"] = ctl
            self._scheduled({"controller": ctl}, {"controller": here}, deadline)
            log_dir = paths.log_dir(self.state_dir)
            os.makedirs(log_dir, exist_ok=True)
            info = self._start({"controller": ctl.start.remote(
                controller_command(num_units=num_units, state_dir=self.state_dir,
                                   host="{host}", port=0), env, key_files,
                paths.process_log(self.state_dir, "controller"),
                self._process_timeout(deadline))}, deadline)
            self.address = info["controller"]["ready"]
            self.incarnation = info["controller"].get("incarnation")
            units, wanted = {}, {}
            for uid, node in enumerate(plan):
                name = f"unit {uid}"
                wanted[name] = node["NodeID"]
                units[name] = self.actors[name] = host.options(
                    num_cpus=self.num_cpus, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
                ).remote(name)
            self._scheduled(units, wanted, deadline)
            refs = {}
            for uid in range(num_units):
                name = f"unit {uid}"
                same = wanted[name] == here
                args = unit_command(controller=self.address, unit_id=uid, host="{host}",
                                    state_dir=self.state_dir if same else None)
                refs[name] = units[name].start.remote(
                    args, {**env, **{k: str(v) for k, v in unit_env.get(uid, {}).items()}},
                    key_files, paths.process_log(self.state_dir, f"unit-{uid}") if same else None,
                    self._process_timeout(deadline))
            self._start(refs, deadline)
            self.record = self._make_record(key_files)
            ray.get(ctl.set_record.remote(self.record), timeout=self._left(deadline) + 5)
        except BaseException:
            self.stop(graceful=False)
            raise
        atexit.register(self.stop)

    # ---------------------------------------------------------------- start-up steps
    def _left(self, deadline: float) -> float:
        return max(1.0, deadline - time.monotonic())

    def _process_timeout(self, deadline: float) -> float:
        """How long a scheduled server process may take to announce itself. Not bounded
        by ray_start_timeout alone (that bounds scheduling, which is what can hang): a
        busy node may need longer than a short ray_start_timeout to start Python."""
        return max(self._left(deadline), PROCESS_START_TIMEOUT)

    def _scheduled(self, actors: dict, wanted: dict, deadline: float) -> None:
        """Wait until Ray placed every actor (``where`` answers) or raise naming the rest."""
        refs = {a.where.remote(): name for name, a in actors.items()}
        ready, pending = ray.wait(list(refs), num_returns=len(refs),
                                  timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            where = ray.get(ref)
            self.nodes[refs[ref]] = {k: where[k] for k in ("node_id", "ip", "hostname")}
        if pending:
            names = sorted(refs[r] for r in pending)
            asked = f"{self.num_cpus:g} CPU"
            free = _free_cpus()
            detail = "; ".join(
                f"{n} on node {node_label(wanted[n], _node_ip(wanted[n]))} (asks "
                f"{asked if n != 'controller' else '0 CPU'}; free there now: "
                f"{free.get(wanted[n], '?')} CPU)" for n in names)
            raise RayPlacementError(
                f"Ray did not schedule {len(names)} of the deployment's actors within "
                f"ray_start_timeout={self.start_timeout:g}s: {detail}. Their CPUs are held by "
                f"other tasks or actors; free them, lower num_units or ray_num_cpus, or raise "
                f"ray_start_timeout. Nothing was left running.")

    def _start(self, refs: dict, deadline: float) -> dict:
        """Wait for the servers' announcements; raise the first failure naming its node."""
        out = {}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs),
                                  timeout=self._process_timeout(deadline) + 10)
        names = {r: n for n, r in refs.items()}
        for ref in ready:
            name = names[ref]
            msg = ray.get(ref)
            self.pids[name] = msg["pid"]
            self.logs[name] = msg.get("log_file")
            if "error" in msg:
                where = f"{name} on node {self.node_of(name)}"
                if msg["error"] == "StateDirInUseError":
                    raise StateDirInUseError(msg["message"])
                if msg["error"] == "PermissionError":
                    raise PermissionError(f"{where}: {msg['message']}")
                raise TqtxError(f"{where} failed to start: {msg['error']}: {msg['message']}")
            out[name] = msg
        if pending:
            raise TqtxError(f"{sorted(names[r] for r in pending)} did not start within "
                            f"{self._process_timeout(deadline):.0f}s of being scheduled")
        return out

    def _make_record(self, key_files: dict | None) -> dict:
        rec = {"version": RECORD_VERSION, "placement": "ray", "name": self.name,
               "address": self.address, "incarnation": self.incarnation,
               "num_units": self.num_units, "state_dir": self.state_dir,
               "nodes": dict(self.nodes), "pids": dict(self.pids), "logs": dict(self.logs),
               "owner_pid": os.getpid(),
               "job_id": ray.get_runtime_context().get_job_id(), "curve": self.curve,
               **self.durability.record(self.state_dir)}
        if self.curve:
            rec["server_key"] = _z85(key_files["server.key"], False)
            rec["client_public"] = _z85(key_files["client.key_secret"], False)
            rec["client_secret"] = _z85(key_files["client.key_secret"], True)
        return rec

    # ---------------------------------------------------------------- running
    def unit_nodes(self) -> list[dict]:
        """``[{"unit", "node_id", "ip", "hostname"}]`` in unit order."""
        return [{"unit": u, **self.nodes.get(f"unit {u}", {})} for u in range(self.num_units)]

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop units, then the controller (SIGTERM, then SIGKILL), then kill every actor."""
        if self.stopped:
            return
        self.stopped = True
        ctl = self.actors.get("controller")
        try:
            if ctl is not None:
                try:
                    ray.get(ctl.set_record.remote(STOPPED), timeout=5)  # no new attachers
                except Exception:
                    pass
            units = [a for n, a in self.actors.items() if n != "controller"]
            for group in (units, [ctl] if ctl is not None else []):
                refs = [a.stop.remote(graceful, timeout) for a in group]
                if refs:
                    try:
                        ray.wait(refs, num_returns=len(refs), timeout=timeout + 10)
                    except Exception:
                        pass
        finally:
            for actor in self.actors.values():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            self.actors.clear()
            # ray.kill is asynchronous: wait (bounded) until the name is free again, so a
            # next tq.init in this job can create a deployment under the same name
            for _ in range(100 if ctl is not None else 0):
                if _find_actor(self.name) is None:
                    break
                time.sleep(0.1)
            try:
                atexit.unregister(self.stop)
            except Exception:
                pass


def _node_ip(node_id: str) -> str | None:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return n.get("NodeManagerAddress")
    return None


def _free_cpus() -> dict:
    try:
        from ray._private.state import available_resources_per_node
        return {nid: r.get("CPU", 0) for nid, r in available_resources_per_node().items()}
    except Exception:  # a private API: the error message just says "?"
        return {}


def _find_actor(name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def find_record(name: str | None, wait: float = 60.0) -> dict | None:
    """The record of this job's deployment (``name``), or None when there is none.

    Waits (up to ``wait`` s) while the deployment is still starting."""
    actor = _find_actor(name or default_name())
    if actor is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            rec = ray.get(actor.get_record.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except Exception as exc:  # the actor died between the lookup and the call
            log.warning("tqtx deployment actor %s did not answer: %s", name, exc)
            return None
        if rec is not None and rec.get("stopped"):
            return None
        if rec is not None or time.monotonic() > deadline:
            return rec
        time.sleep(0.2)
