"""The config that ``tq.init(config)`` takes: tqtx's own keys, and TransferQueue's config.

A trainer written for TransferQueue passes TransferQueue's config (a dict or an OmegaConf
``DictConfig``: ``backend.SimpleStorage.num_data_storage_units``, ``controller.*``,
``metrics.*``). What has a meaning in tqtx is translated, everything else is ignored with
one log line; TransferQueue's config never raises. A plain tqtx config keeps one check: a
key that is not tqtx's but looks like a misspelt tqtx key (``num_unit``) raises
``ValueError``, since silently starting with defaults would hide the typo.
"""
from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping

log = logging.getLogger("tqtx.init")

# Every top-level key tqtx itself reads (see tqtx.api.init).
TQTX_KEYS = {"num_units", "state_dir", "host", "port", "timeout", "address", "unit_env", "env",
             "server_key", "keys_dir", "client_key", "insecure", "metrics", "compat",
             "strict", "durability", "warm_dump", "polling_mode",
             # Ray placement (tqtx.placement.ray_cluster, docs/deployment.md)
             "placement", "unit_node_resource", "ray_num_cpus", "ray_start_timeout", "ray_name"}

# Top-level sections only TransferQueue's config has: their presence marks a TQ config.
TQ_SECTIONS = {"controller", "backend"}
TQ_METRICS_KEYS = {"enabled", "port"}  # TransferQueue's metrics keys mean the same in tqtx
SIMPLE_STORAGE = "SimpleStorage"


def _is_omegaconf(obj) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "omegaconf"


def as_plain_dict(config) -> dict:
    """``config`` (None, a Mapping or an OmegaConf ``DictConfig``) as nested plain dicts."""
    if config is None:
        return {}
    if _is_omegaconf(config):
        # The caller has omegaconf (it made the object); tqtx does not depend on it.
        from omegaconf import OmegaConf
        try:
            config = OmegaConf.to_container(config, resolve=True)
        except Exception:  # an unresolvable interpolation in a section tqtx ignores anyway
            config = OmegaConf.to_container(config, resolve=False)
    if not isinstance(config, Mapping):
        raise TypeError(f"tq.init config must be a dict or a DictConfig, "
                        f"got {type(config).__name__}")
    return {str(k): (as_plain_dict(v) if isinstance(v, Mapping) or _is_omegaconf(v) else v)
            for k, v in config.items()}


def _leaves(prefix: str, value) -> list[str]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _leaves(f"{prefix}.{k}", v)]
    return [prefix]


def resolve(config) -> dict:
    """tqtx's config from ``config``; logs (once) what was ignored.

    Raises ``ValueError`` only for a plain tqtx config with a key that looks like a
    misspelt tqtx key; TransferQueue configs (an OmegaConf object, a ``controller`` or
    ``backend`` section, or ``compat: "transferqueue"``) never raise.
    """
    raw = as_plain_dict(config)
    tq_style = (_is_omegaconf(config) or bool(TQ_SECTIONS & raw.keys())
                or raw.get("compat") == "transferqueue")
    out = {k: v for k, v in raw.items() if k in TQTX_KEYS}
    ignored: list[str] = []   # known TransferQueue options tqtx has no use for
    unknown: list[str] = []   # keys neither tqtx nor TransferQueue 0.1.11 knows
    typos = {}
    for key in raw.keys() - TQTX_KEYS - TQ_SECTIONS:
        close = difflib.get_close_matches(key, sorted(TQTX_KEYS), n=1, cutoff=0.75)
        if close and not tq_style:
            typos[key] = close[0]
        else:
            unknown.append(key)
    if typos:
        hints = ", ".join(f"{k!r} (did you mean {v!r}?)" for k, v in sorted(typos.items()))
        raise ValueError(f"unknown config keys: {hints}; tqtx keys are {sorted(TQTX_KEYS)}")

    backend = raw.get("backend")
    if isinstance(backend, dict):
        name = backend.get("storage_backend") or SIMPLE_STORAGE
        if name != SIMPLE_STORAGE:
            unknown.append(f"backend.storage_backend={name!r} (tqtx has its own storage units)")
        for section, value in backend.items():
            if section == "storage_backend":
                continue
            if section != SIMPLE_STORAGE or name != SIMPLE_STORAGE or not isinstance(value, dict):
                ignored.append(f"backend.{section}")
                continue
            for key, v in value.items():
                if key == "num_data_storage_units" and v is not None:
                    if "num_units" not in out:
                        out["num_units"] = int(v)
                    elif int(v) != int(out["num_units"]):
                        ignored.append(f"backend.SimpleStorage.num_data_storage_units={v} "
                                       f"(num_units={out['num_units']} wins)")
                elif key == "required_node_resource" and v:  # used by Ray placement
                    out.setdefault("unit_node_resource", str(v))
                elif key != "num_data_storage_units":
                    ignored.extend(_leaves(f"backend.SimpleStorage.{key}", v))
    elif backend is not None:
        ignored.append("backend")
    controller = raw.get("controller")
    if isinstance(controller, dict):
        # polling_mode: get_meta returns at once when too few samples are ready (tqtx.dataplane)
        if controller.get("polling_mode") is not None:
            out.setdefault("polling_mode", bool(controller["polling_mode"]))
        sampler = controller.get("sampler")
        rest = {k: v for k, v in controller.items() if k not in ("polling_mode", "sampler")}
        if sampler not in (None, "SequentialSampler"):
            unknown.append(f"controller.sampler={sampler!r} (tqtx samples sequentially)")
        ignored.extend(_leaves("controller", rest) if rest else [])
    elif controller is not None:
        ignored.append("controller")
    metrics = out.get("metrics")
    if isinstance(metrics, dict) and tq_style:
        # TransferQueue writes metrics.endpoint back into its config; tqtx has no use for it
        extra = {k: v for k, v in metrics.items() if k not in TQ_METRICS_KEYS | {"host"}}
        ignored.extend(_leaves("metrics", extra) if extra else [])
        out["metrics"] = {k: v for k, v in metrics.items() if k not in extra}
    if ignored or unknown:
        level = logging.WARNING if unknown else logging.INFO
        log.log(level, "tq.init ignores config keys tqtx has no use for: %s",
                ", ".join(sorted(ignored) + sorted(unknown)))
    return out
