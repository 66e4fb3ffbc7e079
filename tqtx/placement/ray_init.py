"""``tq.init`` on Ray: create the job's Ray deployment, or attach to it (no Ray import here).

:func:`init_on_ray` is called by :func:`tqtx.init` before it starts an embedded
deployment. It acts when the config says ``placement: "ray"``, or when Ray is already
imported and initialized in this process (a Ray driver or actor) and the job's named
deployment actor exists. Otherwise it returns None and init carries on as before: Ray is
never imported by tqtx unless this process already did, or asked for Ray placement.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("tqtx.init")

PLACEMENTS = ("local", "ray")


def _ray_ready() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and getattr(ray, "is_initialized", lambda: False)()


def init_on_ray(cfg: dict, state_dir_default):
    """``(deployment or None, client, config)`` for Ray placement, or None (not on Ray)."""
    placement = cfg.get("placement") or "local"
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    if placement != "ray" and not _ray_ready():
        return None
    try:
        import ray
    except ImportError:
        raise ImportError("placement 'ray' needs Ray: pip install 'tqtx[ray]'") from None
    if not ray.is_initialized():
        log.info("placement 'ray': ray.init() (connects to RAY_ADDRESS or starts a local Ray)")
        ray.init()
    from . import ray_cluster
    rec = ray_cluster.find_record(cfg.get("ray_name"),
                                  wait=float(cfg.get("ray_start_timeout") or 60.0))
    if rec is not None:
        return None, *_attach(rec, cfg)
    if placement != "ray":
        return None  # a Ray job without a tqtx deployment: the embedded one, as before
    num_units = int(cfg["num_units"])
    if num_units < 1:
        raise ValueError("num_units must be >= 1")
    state_dir = os.path.abspath(cfg.get("state_dir") or os.environ.get("TQTX_STATE_DIR")
                                or state_dir_default())
    dep = ray_cluster.RayDeployment(num_units=num_units, state_dir=state_dir, cfg=cfg,
                                    name=cfg.get("ray_name"))
    try:
        client, config = _connect(dep.record, cfg, dep, "ray")
    except BaseException:
        dep.stop(graceful=False)
        raise
    config["owner_pid"] = os.getpid()
    return dep, client, config


def _attach(rec: dict, cfg: dict):
    from .ray_cluster import RayAttached
    asked = cfg.get("num_units_given")
    if asked is not None and int(asked) != rec["num_units"]:
        log.warning("attaching to the job's Ray deployment %s with %s units (config asked "
                    "for %s)", rec["name"], rec["num_units"], asked)
    return _connect(rec, cfg, RayAttached(rec), "attached")


def _connect(rec: dict, cfg: dict, deployment, mode: str):
    from ..client import Client
    from .ray_cluster import record_curve
    client = Client(rec["address"], timeout=float(cfg["timeout"]), deployment=deployment,
                    curve=record_curve(rec))
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
