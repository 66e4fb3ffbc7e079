"""The config that ``tq.init(config)`` takes: tqtx's own keys, and TransferQueue's config.

A trainer written for TransferQueue passes TransferQueue's config (a dict or an OmegaConf
``DictConfig``: ``backend.SimpleStorage.num_data_storage_units``, ``controller.*``,
``metrics.*``). What has a meaning in tqtx is translated, everything else is ignored with
one log line; a key TransferQueue's config holds never raises for being unknown. A plain
tqtx config keeps one more check: a key that is not tqtx's but looks like a misspelt tqtx
key (``num_unit``) raises ``ValueError``, since silently starting with defaults would hide
the typo. The value of every key tqtx uses is checked (:data:`KEY_KINDS`: ``num_units`` an
int from 1, ``port`` 0-65535, ``timeout`` above 0 ...): TypeError or ValueError naming the
key (the dotted TransferQueue key it came from), what it got and what it accepts.
"""
from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping

from .. import durability as dur
from ..arguments.kinds import Address, Choice, Flag, Kind, Number, PathArg, Refused, Text, shown

log = logging.getLogger("tqtx.init")

MAX_UNITS = 4096  # a sanity bound: each unit is a process


class EnvMap(Kind):
    """Environment variables for the processes: a dict of str -> str."""

    says = "a dict of str -> str"

    def refuse(self, value) -> None:
        if not isinstance(value, Mapping):
            raise Refused(TypeError)
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise Refused(TypeError, f"{shown(k)}: {shown(v)} (names and values are str)")


class UnitEnv(Kind):
    """Per-unit environment: a dict of unit id (an int, or its digits) -> dict of str -> str."""

    says = "a dict of unit id (int) -> dict of str -> str"

    def refuse(self, value) -> None:
        if not isinstance(value, Mapping):
            raise Refused(TypeError)
        for uid, env in value.items():
            if isinstance(uid, bool) or not (isinstance(uid, int) or
                                             (isinstance(uid, str) and uid.isdigit())):
                raise Refused(TypeError, f"unit id {shown(uid)}")
            EnvMap().refuse(env)


PORT = Number("an int from 0 to 65535 (0: any free port)", integer=True, low=0, high=65535)


class Metrics(Kind):
    """``metrics``: a dict with ``enabled`` (True/False), ``port`` (0-65535), ``host``."""

    says = "a dict with 'enabled' (True or False), 'port' (0-65535) and 'host' (str)"
    parts = {"enabled": Flag(), "port": PORT, "host": Text("a non-blank host name",
                                                              spaces=False)}

    def refuse(self, value) -> None:
        if not isinstance(value, Mapping):
            raise Refused(TypeError)
        for name, kind in self.parts.items():
            if value.get(name) is not None:
                try:
                    kind.refuse(value[name])
                except Refused as r:
                    raise Refused(r.exc_type, f"metrics.{name} {r.why or shown(value[name])} "
                                              f"(must be {kind.says})") from None


# What each tqtx config key accepts (None, or a key left out, means its default).
KEY_KINDS: dict[str, Kind] = {
    "num_units": Number(f"an int from 1 to {MAX_UNITS}", integer=True, low=1, high=MAX_UNITS),
    "state_dir": PathArg(),
    "host": Text("a non-blank host name or address", spaces=False),
    "port": PORT,
    "timeout": Number("a number of seconds above 0", above=0),
    "address": Address(),
    "unit_env": UnitEnv(),
    "env": EnvMap(),
    "server_key": Text("a non-blank str (a CURVE public key)", spaces=False),
    "keys_dir": PathArg(),
    "client_key": PathArg(),
    "insecure": Flag(),
    "metrics": Metrics(),
    "compat": Choice("tqtx", "transferqueue"),
    # the values of earlier releases are accepted and mapped by tqtx.deploy.durable
    "durability": Choice(*dur.DURABILITY, also=tuple(dur.DEPRECATED)),
    "flush_interval_s": Number("a number of seconds above 0", above=0),
    "unit_data_dir": PathArg(),
    "warm_dump": Flag(),
    "placement": Choice("local", "ray"),
    "unit_node_resource": Text("a non-blank str (a Ray resource name)"),
    "ray_num_cpus": Number("a number of CPUs, 0 or more", low=0),
    "ray_start_timeout": Number("a number of seconds above 0", above=0),
    "ray_name": Text("a non-blank str"),
}
NUM_DATA_STORAGE_UNITS = "backend.SimpleStorage.num_data_storage_units"


def check_keys(config: dict, origin: dict | None = None) -> None:
    """TypeError / ValueError naming the first key of ``config`` (tqtx's keys; ``origin``
    maps a key to the dotted TransferQueue key it came from) whose value is refused."""
    for key, value in config.items():
        kind = KEY_KINDS.get(key)
        if kind is not None and value is not None:
            name = (origin or {}).get(key, key)
            kind.check("tq.init config", f"key {name!r}", value)

# Every top-level key tqtx itself reads (see tqtx.api.init).
TQTX_KEYS = {"num_units", "state_dir", "host", "port", "timeout", "address", "unit_env", "env",
             "server_key", "keys_dir", "client_key", "insecure", "metrics", "compat",
             "strict", "durability", "flush_interval_s", "unit_data_dir", "warm_dump",
             "polling_mode",
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

    Raises ``ValueError`` for a plain tqtx config with a key that looks like a misspelt
    tqtx key (TransferQueue configs: an OmegaConf object, a ``controller`` or ``backend``
    section, or ``compat: "transferqueue"``, are never refused for their keys), and
    TypeError / ValueError for a value :data:`KEY_KINDS` refuses.
    """
    raw = as_plain_dict(config)
    tq_style = (_is_omegaconf(config) or bool(TQ_SECTIONS & raw.keys())
                or raw.get("compat") == "transferqueue")
    # a key set to None (OmegaConf's null) means its default, as if it were left out
    out = {k: v for k, v in raw.items() if k in TQTX_KEYS and v is not None}
    origin: dict[str, str] = {}
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
                    KEY_KINDS["num_units"].check("tq.init config",
                                                 f"key {NUM_DATA_STORAGE_UNITS!r}", v)
                    if "num_units" not in out:
                        out["num_units"] = v
                        origin["num_units"] = NUM_DATA_STORAGE_UNITS
                    elif v != out["num_units"]:
                        ignored.append(f"{NUM_DATA_STORAGE_UNITS}={v} "
                                       f"(num_units={out['num_units']} wins)")
                elif key == "required_node_resource" and v is not None:  # Ray placement
                    if "unit_node_resource" not in out:
                        out["unit_node_resource"] = v
                        origin["unit_node_resource"] = "backend.SimpleStorage." + key
                elif key != "num_data_storage_units":
                    ignored.extend(_leaves(f"backend.SimpleStorage.{key}", v))
    elif backend is not None:
        ignored.append("backend")
    controller = raw.get("controller")
    if isinstance(controller, dict):
        # polling_mode: get_meta returns at once when too few samples are ready
        # (tqtx.compat.dataplane)
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
    check_keys(out, origin)
    if ignored or unknown:
        level = logging.WARNING if unknown else logging.INFO
        log.log(level, "tq.init ignores config keys tqtx has no use for: %s",
                ", ".join(sorted(ignored) + sorted(unknown)))
    return out
