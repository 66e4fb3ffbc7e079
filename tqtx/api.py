"""Module-level API, compatible with TransferQueue's KV and checkpoint functions.

``import tqtx as tq; tq.init()`` starts an embedded deployment (controller + units as
child processes on 127.0.0.1); ``tq.init(address=...)`` or ``TQTX_ADDRESS`` attaches to
a running one.
"""
from __future__ import annotations

import asyncio
import functools
import os
import threading

from .client import Client, KVBatchMeta, check_keys, check_partition
from .errors import TqtxError

__all__ = [
    "init", "close", "kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list",
    "kv_clear", "save_checkpoint", "load_checkpoint", "dump_data_by_key", "load_data_by_key",
    "read_row_index", "recover_data_load", "list_restores", "get_client", "KVBatchMeta",
]

_lock = threading.RLock()
_client: Client | None = None
_deployment = None
_config: dict | None = None

DEFAULTS = {"num_units": 2, "host": "127.0.0.1", "port": 0, "timeout": 300.0}


def _default_state_dir() -> str:
    from .journal.store import default_state_dir
    return str(default_state_dir())


def init(config: dict | None = None, *, address: str | None = None) -> dict:
    """Start an embedded deployment, or attach to ``address`` / ``$TQTX_ADDRESS``.

    ``config`` keys: ``num_units`` (2), ``state_dir`` ($TQTX_STATE_DIR or a per-user
    state dir), ``host`` (127.0.0.1), ``port`` (0 = any), ``timeout`` (seconds),
    ``address`` (attach instead of starting). Returns the effective config.
    Access control (see docs/security.md): ``server_key`` (the deployment's public key,
    or $TQTX_SERVER_KEY), ``keys_dir`` (a ``tqtx keys init`` key dir, or $TQTX_KEYS_DIR;
    default ``<state_dir>/keys``), ``client_key`` (a client secret certificate file),
    ``insecure`` (allow a non-loopback host without keys, with a warning).
    ``metrics`` (``{"enabled": bool, "port": int}``): Prometheus endpoints, controller at
    ``port`` and unit k at ``port + 1 + k`` (see docs/operations.md).
    Calling init again while initialized returns the current config.
    """
    global _client, _deployment, _config
    with _lock:
        if _client is not None:
            return dict(_config)
        cfg = {**DEFAULTS, **(config or {})}
        unknown = set(cfg) - {*DEFAULTS, "state_dir", "address", "unit_env", "env",
                              "server_key", "keys_dir", "client_key", "insecure", "metrics"}
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        address = address or cfg.get("address") or os.environ.get("TQTX_ADDRESS")
        if address:
            from .security import attach_curve
            curve = attach_curve(address, state_dir=cfg.get("state_dir")
                                 or os.environ.get("TQTX_STATE_DIR"),
                                 server_key=cfg.get("server_key"), keys_dir=cfg.get("keys_dir"),
                                 client_key_file=cfg.get("client_key"),
                                 insecure=bool(cfg.get("insecure")))
            client = Client(address, timeout=float(cfg["timeout"]), curve=curve)
            topo = client.topology
            _config = {"mode": "attached", "address": address, "num_units": topo["num_units"],
                       "state_dir": topo["state_dir"], "host": address.split("//")[-1].rsplit(":", 1)[0],
                       "timeout": float(cfg["timeout"]), "units": topo["units"],
                       "incarnation": topo["incarnation"]}
            _client = client
            return dict(_config)
        from .deploy import LocalDeployment
        state_dir = cfg.get("state_dir") or os.environ.get("TQTX_STATE_DIR") or _default_state_dir()
        num_units = int(cfg["num_units"])
        if num_units < 1:
            raise ValueError("num_units must be >= 1")
        env = dict(cfg.get("env") or {})
        if cfg.get("insecure"):
            env["TQTX_INSECURE"] = "1"
        if cfg.get("keys_dir"):
            env["TQTX_KEYS_DIR"] = os.path.abspath(cfg["keys_dir"])
        dep = LocalDeployment(num_units=num_units, state_dir=state_dir, host=cfg["host"],
                              port=int(cfg["port"]), env=env or None,
                              unit_env=cfg.get("unit_env"), metrics=cfg.get("metrics"))
        try:
            from .security import client_curve_for
            curve = client_curve_for(dep.state_dir, host=cfg["host"], keys_dir=cfg.get("keys_dir"),
                                     server_key=cfg.get("server_key"),
                                     client_key_file=cfg.get("client_key"),
                                     force=env.get("TQTX_CURVE") == "1")
            client = Client(dep.address, timeout=float(cfg["timeout"]), deployment=dep,
                            curve=curve)
        except BaseException:
            dep.stop(graceful=False)
            raise
        _deployment, _client = dep, client
        _config = {"mode": "embedded", "address": dep.address, "num_units": num_units,
                   "state_dir": dep.state_dir, "host": cfg["host"],
                   "timeout": float(cfg["timeout"]), "units": client.unit_addresses,
                   "incarnation": dep.incarnation, "pids": dict(dep.pids),
                   "metrics_port": dep.metrics_port}
        return dict(_config)


def close(*, cancel_dumps: bool = False) -> dict:
    """Disconnect; shut the deployment down if this process started it.

    Returns ``{"waited": [dump_ids], "cancelled": [dump_ids]}`` for background dumps.
    """
    global _client, _deployment, _config
    with _lock:
        report = {"waited": [], "cancelled": []}
        if _client is None:
            return report
        from .dump import save
        report = save.settle_background_dumps(cancel=cancel_dumps)
        try:
            _client.close()
        finally:
            if _deployment is not None:
                _deployment.stop()
            _client = _deployment = _config = None
        return report


def get_client() -> Client:
    """The process-wide client (raises if :func:`init` was not called)."""
    if _client is None:
        raise TqtxError("tqtx is not initialized: call tqtx.init() first")
    return _client


def _deployment_handle():
    return _deployment


# ---------------------------------------------------------------- kv
def kv_put(key: str, partition_id: str, fields=None, tag: dict | None = None) -> KVBatchMeta:
    """Put one sample: ``fields`` is a dict (tensors get a batch dim) or a TensorDict row."""
    from . import tensors
    if not isinstance(key, str):
        raise TypeError(f"key must be str, got {type(key).__name__}")
    check_partition(partition_id)
    if tag is not None and not isinstance(tag, dict):
        raise TypeError("tag must be a dict")
    columns = {}
    if fields is not None:
        if hasattr(fields, "batch_size") and len(fields.batch_size) >= 1:
            if fields.batch_size[0] != 1:
                raise ValueError(f"kv_put takes one sample; got batch size {list(fields.batch_size)}")
            columns = tensors.columns_from_tensordict(fields, 1)
        else:
            items = fields.items() if hasattr(fields, "items") else None
            if items is None:
                raise TypeError("fields must be a dict or a TensorDict")
            columns = tensors.columns_from_dict(dict(items))
    return _put([key], partition_id, columns, [tag] if tag is not None else None)


def kv_batch_put(keys: list[str], partition_id: str, fields=None,
                 tags: list[dict] | None = None) -> KVBatchMeta:
    """Put a batch: ``fields`` is a TensorDict with batch_size == len(keys)."""
    from . import tensors
    keys = check_keys(keys)
    check_partition(partition_id)
    if tags is not None:
        tags = list(tags)
        if len(tags) != len(keys):
            raise ValueError(f"got {len(tags)} tags for {len(keys)} keys")
        for t in tags:
            if t is not None and not isinstance(t, dict):
                raise TypeError("each tag must be a dict or None")
    columns = {}
    if fields is not None:
        if isinstance(fields, dict):
            from tensordict import TensorDict
            fields = TensorDict(fields, batch_size=[len(keys)])
        columns = tensors.columns_from_tensordict(fields, len(keys))
    return _put(keys, partition_id, columns, tags)


def _put(keys, pid, columns, tags) -> KVBatchMeta:
    from . import tensors
    schemas = {}
    for field, values in columns.items():
        try:
            schemas[field] = tensors.column_schema(values)
        except ValueError as exc:
            raise ValueError(f"field {field!r}: {exc}") from None
    wire_tags = None
    if tags is not None:
        wire_tags = [tensors.encode_object(t or {}, "tag") for t in tags]
    fields = get_client().put_columns(keys, pid, columns, schemas, wire_tags)
    return KVBatchMeta(keys=list(keys), tags=list(tags) if tags is not None else [{} for _ in keys],
                       partition_id=pid, fields=fields)


def kv_batch_get(keys: list[str], partition_id: str, select_fields=None):
    """Get rows in request order as a TensorDict (dense, jagged nested, NonTensorStack)."""
    from . import tensors
    keys = check_keys(keys)
    check_partition(partition_id)
    if select_fields is not None:
        if isinstance(select_fields, str):
            select_fields = [select_fields]
        select_fields = list(select_fields)
    columns, schemas = get_client().get_columns(keys, partition_id, select_fields)
    return tensors.tensordict_from_columns(columns, schemas, len(keys))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields=None):
    """Get the rows named by a :class:`KVBatchMeta` (its fields unless ``select_fields``)."""
    fields = select_fields if select_fields is not None else (meta.fields or None)
    return kv_batch_get(meta.keys, meta.partition_id, fields)


def kv_list(partition_id: str | None = None) -> dict:
    """``{partition_id: {key: tag}}`` for one partition or all."""
    from . import tensors
    raw = get_client().list_keys(partition_id)
    return {pid: {k: tensors.decode_object(t) for k, t in keys.items()}
            for pid, keys in raw.items()}


def kv_clear(keys: list[str], partition_id: str) -> None:
    """Remove keys (unknown keys and partitions are ignored); their indexes are reused."""
    if isinstance(keys, str):
        keys = [keys]
    keys = list(keys)
    if not keys:
        return None
    get_client().clear(keys, partition_id)
    return None


# ---------------------------------------------------------------- checkpoint
def save_checkpoint(checkpoint_dir, *, metadata: dict | None = None) -> dict:
    """Save the whole system to ``checkpoint_dir`` (each unit writes its own file)."""
    from .checkpoint import save
    return save(get_client(), os.fspath(checkpoint_dir), metadata=metadata)


def load_checkpoint(checkpoint_dir) -> dict:
    """Replace the whole system's state with a checkpoint (same unit count required)."""
    from .checkpoint import load
    return load(get_client(), os.fspath(checkpoint_dir))


# ---------------------------------------------------------------- selective dump / restore
def dump_data_by_key(dump_dir, keys, partition_id: str, *, via: str = "units",
                     block: bool = True):
    """Save exactly ``keys`` of ``partition_id`` (all their fields and tags) to ``dump_dir``."""
    from .dump import save
    return save.dump_data_by_key(get_client(), os.fspath(dump_dir), keys, partition_id,
                                 via=via, block=block)


def load_data_by_key(dump_dir, *, partition_id: str | None = None, via: str = "units") -> dict:
    """Merge a dump into the running system as one transaction."""
    from .dump import load
    return load.load_data_by_key(get_client(), os.fspath(dump_dir), partition_id=partition_id,
                                 via=via)


def recover_data_load(dump_dir, *, cancel: bool = False) -> bool:
    """Settle the restore recorded for ``dump_dir``: True if committed or nothing pending."""
    from .dump import load
    return load.recover_data_load(get_client(), os.fspath(dump_dir), cancel=cancel)


def list_restores(partition_id: str | None = None) -> list[dict]:
    """Unresolved restores (with their per-unit states)."""
    return get_client().controller.call("LIST_RESTORES", {"partition_id": partition_id})["restores"]


def read_row_index(dump_dir) -> dict:
    """A dump's keys, source indexes, fields, tags and schemas, without reading any payload."""
    from . import tensors
    from .dump import format as fmt
    from .dump.publish import dump_lock, recover_publications
    path = os.path.abspath(os.fspath(dump_dir))
    if os.path.exists(path + ".lock") or os.path.exists(path + ".old"):
        with dump_lock(path):
            recover_publications(path)
    out = fmt.read_row_index(path)
    for row in out["rows"].values():
        row["tag"] = tensors.decode_object(row["tag"])
    return out


def __getattr__(name):
    if name == "DumpHandle":
        from .dump.save import DumpHandle
        return DumpHandle
    raise AttributeError(name)


# ---------------------------------------------------------------- async twins
def _async(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)
    wrapper.__name__ = "async_" + fn.__name__
    wrapper.__qualname__ = wrapper.__name__
    wrapper.__doc__ = f"Async twin of :func:`{fn.__name__}`."
    return wrapper


async_kv_put = _async(kv_put)
async_kv_batch_put = _async(kv_batch_put)
async_kv_batch_get = _async(kv_batch_get)
async_kv_batch_get_by_meta = _async(kv_batch_get_by_meta)
async_kv_list = _async(kv_list)
async_kv_clear = _async(kv_clear)
async_save_checkpoint = _async(save_checkpoint)
async_load_checkpoint = _async(load_checkpoint)
async_dump_data_by_key = _async(dump_data_by_key)
async_load_data_by_key = _async(load_data_by_key)
async_recover_data_load = _async(recover_data_load)
