"""``tq.init`` on Ray: create the job's Ray deployment, or attach to it (no Ray import here).

:func:`init_on_ray` is called by :func:`tqtx.init` before it starts an embedded
deployment. It acts when the config says ``placement: "ray"``, or when no placement is
given and Ray is already imported and initialized in this process (a Ray driver or actor,
as TransferQueue's ``init`` is always a Ray call): then the deployment goes on the Ray
cluster, or, if the job has one, this process attaches to it. ``placement: "local"`` keeps
the embedded deployment of the state dir. Ray is never imported by tqtx unless this process
already did, or asked for Ray placement.

A process that finds the job's deployment record but cannot reach the controller it names
raises :class:`~tqtx.errors.TqtxError` naming that address and this node; it never starts a
second deployment its peers would not see.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("tqtx.init")

PLACEMENTS = ("local", "ray")
# How long an attaching process waits for the recorded controller to answer.
ATTACH_TIMEOUT = float(os.environ.get("TQTX_ATTACH_TIMEOUT", "30"))


def _ray_ready() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and getattr(ray, "is_initialized", lambda: False)()


def init_on_ray(cfg: dict, state_dir_default):
    """``(deployment or None, client, config)`` for Ray placement, or None (not on Ray)."""
    placement = cfg.get("placement")
    if placement is None:
        placement = "ray" if _ray_ready() else "local"
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    if placement != "ray":
        return None
    try:
        import ray
    except ImportError:
        raise ImportError("placement 'ray' needs Ray: pip install 'tqtx[ray]'") from None
    if not ray.is_initialized():
        log.info("placement 'ray': ray.init() (connects to RAY_ADDRESS or starts a local Ray)")
        ray.init()
    from . import ray_cluster
    wait = float(cfg.get("ray_start_timeout") or 60.0)
    for _ in range(2):  # a second look when another process of the job created it first
        rec = ray_cluster.find_record(cfg.get("ray_name"), wait=wait)
        if rec is not None:
            return None, *_attach(rec, cfg)
        num_units = int(cfg["num_units"])
        if num_units < 1:
            raise ValueError("num_units must be >= 1")
        state_dir = os.path.abspath(cfg.get("state_dir") or os.environ.get("TQTX_STATE_DIR")
                                    or state_dir_default())
        try:
            dep = ray_cluster.RayDeployment(num_units=num_units, state_dir=state_dir, cfg=cfg,
                                            name=cfg.get("ray_name"))
        except ray_cluster.DeploymentNameTaken as exc:
            log.info("%s; attaching to it", exc)
            continue
        try:
            client, config = _connect(dep.record, cfg, dep, "ray")
        except BaseException:
            dep.stop(graceful=False)
            raise
        config["owner_pid"] = os.getpid()
        config.update(dep.durability.record(dep.state_dir))
        return dep, client, config
    raise ray_cluster.DeploymentNameTaken(
        f"the job's tqtx deployment {cfg.get('ray_name') or ray_cluster.default_name()!r} "
        f"exists but gave no record within {wait:g}s")


def _attach(rec: dict, cfg: dict):
    from .ray_cluster import RayAttached
    asked = cfg.get("num_units_given")
    if asked is not None and int(asked) != rec["num_units"]:
        log.warning("attaching to the job's Ray deployment %s with %s units (config asked "
                    "for %s)", rec["name"], rec["num_units"], asked)
    return _connect(rec, cfg, RayAttached(rec), "attached")


def _connect(rec: dict, cfg: dict, deployment, mode: str):
    from ..client.client import Client
    from ..errors import TqtxError
    from .ray_cluster import record_curve
    try:
        client = Client(rec["address"], timeout=float(cfg["timeout"]), deployment=deployment,
                        curve=record_curve(rec), wait_ready=ATTACH_TIMEOUT)
    except TqtxError as exc:
        if mode != "attached":
            raise
        raise TqtxError(
            f"this process (node {_here()}) found the job's tqtx deployment (Ray actor "
            f"{rec['name']!r} in namespace 'tqtx') but cannot reach its controller at "
            f"{rec['address']} within {ATTACH_TIMEOUT:g}s ($TQTX_ATTACH_TIMEOUT): {exc}. It "
            f"does not start a second deployment: make that address reachable from this node "
            f"(network, firewall; a CURVE deployment's keys come with the record)") from exc
    try:
        topo = client.topology
        nodes = rec.get("nodes") or {}
        config = {
            "mode": mode, "placement": "ray", "ray_name": rec["name"], "address": rec["address"],
            "num_units": topo["num_units"], "state_dir": topo["state_dir"],
            "host": rec["address"].split("//")[-1].rsplit(":", 1)[0],
            "timeout": float(cfg["timeout"]), "units": topo["units"],
            "incarnation": topo["incarnation"], "pids": dict(rec.get("pids") or {}),
            "controller_node": nodes.get("controller"),
            "unit_nodes": [{"unit": u, **nodes.get(f"unit {u}", {})}
                           for u in range(topo["num_units"])],
            "curve": bool(rec.get("curve")), "owner_pid": rec.get("owner_pid")}
    except BaseException:
        client.close()
        raise
    return client, config


def _here() -> str:
    import socket
    try:
        import ray
        node = ray.get_runtime_context().get_node_id()[:8]
    except Exception:  # only for the message
        node = "?"
    return f"{node} ({socket.gethostname()})"
