"""Module-level API, compatible with TransferQueue's KV and checkpoint functions.

``import tqtx as tq; tq.init()`` starts an embedded deployment (controller + units as
child processes on 127.0.0.1) or, in the job's other processes, attaches to the one
that owns the state dir; ``tq.init(address=...)`` or ``TQTX_ADDRESS`` attaches to a
running one by address.
"""
from __future__ import annotations

import asyncio
import functools
import os
import threading

from . import public
from .arguments.table import as_key_list, check_call
from .client import semantics
from .client.client import Client
from .client.kvmeta import KVBatchMeta
from .compat.dataplane import list_lost_keys  # noqa: F401  (tq.list_lost_keys)
from .errors import NotInitializedError
from .process.gcpause import gc_paused
from .arguments.kinds import is_tensordict

__all__ = [*public.CALLS, "KVBatchMeta"]

_lock = threading.RLock()
_client: Client | None = None
_deployment = None
_config: dict | None = None

DEFAULTS = {"num_units": 2, "host": "127.0.0.1", "port": 0, "timeout": 300.0}


def _default_state_dir() -> str:
    from .layout.paths import default_state_dir
    return str(default_state_dir())


def init(conf=None, *, address: str | None = None, config=None) -> dict:
    """Create the state dir's deployment or attach to it, or attach to ``address``.

    Without ``address`` / ``$TQTX_ADDRESS``, the first process of a job to call init
    starts an embedded deployment (``mode: "embedded"``) and the others, calling the same
    bare ``init()`` with the same state dir, attach to it (``mode: "attached"``); only the
    creator's close() or exit stops it (see :mod:`tqtx.deploy.owner`).
    ``conf`` (TransferQueue's parameter name; ``config=`` is the same) is a dict, or
    TransferQueue's config (dict or OmegaConf; its
    ``backend.SimpleStorage.num_data_storage_units`` is ``num_units``, the rest is
    ignored with one log line; see :mod:`tqtx.deploy.initconfig`). Its keys: ``num_units`` (2),
    ``state_dir`` ($TQTX_STATE_DIR or a per-user state dir; the deployment is shared by
    the processes using the same state dir), ``host`` (127.0.0.1), ``port`` (0 = any),
    ``timeout`` (seconds), ``address`` (attach instead of starting). Returns the effective
    config (``mode``, ``address``, ``units``, ``pids``, ``owner_pid``, ...).
    Access control (see docs/security.md): ``server_key`` (the deployment's public key,
    or $TQTX_SERVER_KEY), ``keys_dir`` (a ``tqtx keys init`` key dir, or $TQTX_KEYS_DIR;
    default ``<state_dir>/keys``), ``client_key`` (a client secret certificate file),
    ``insecure`` (allow a non-loopback host without keys, with a warning).
    ``warm_dump`` (None): import the dump path during init so the first dump is as fast as
    later ones; None does it only when this process starts the deployment.
    ``metrics`` (``{"enabled": bool, "port": int}``): Prometheus endpoints, controller at
    ``port`` and unit k at ``port + 1 + k`` (see docs/operations.md).
    ``placement: "ray"`` (with ``unit_node_resource``, ``ray_num_cpus``,
    ``ray_start_timeout``, ``ray_name``) runs the controller and units as Ray actors across
    the cluster; inside a Ray job that has one, a bare init attaches (docs/deployment.md).
    ``durability`` (``"memory"``, ``"controller"`` (default), ``"buffer"``, ``"sync"``; or
    $TQTX_DURABILITY), ``flush_interval_s`` (1.0; $TQTX_FLUSH_INTERVAL_S) and
    ``unit_data_dir`` (``<state_dir>/units``; $TQTX_UNIT_DATA_DIR): what of the buffer
    survives which crash (docs/reliability.md, *Durability*).
    Calling init again while initialized returns the current config.
    """
    check_call("init", locals())
    global _client, _deployment, _config
    if conf is not None and config is not None:
        raise TypeError("init() takes conf or config, not both")
    config = conf if conf is not None else config
    with _lock:
        from .deploy.durable import normalise_config
        from .deploy.initconfig import resolve
        # checked also when it is not used (already initialized); an earlier durability
        # value is mapped here, with its one DeprecationWarning
        given = normalise_config(resolve(config))
        if _client is not None:
            return dict(_config)
        # TransferQueue's results by default; {"strict": True} opts into tqtx's checks
        semantics.configure(strict=given.pop("strict", None), compat=given.pop("compat", None))
        cfg = {**DEFAULTS, **given}
        warm = cfg.get("warm_dump")  # None: only in a process that starts the deployment
        if warm not in (None, True, False):
            raise TypeError(f"warm_dump must be True, False or None, got {warm!r}")
        if warm:
            _warm_dump_path()
        address = address or cfg.get("address") or os.environ.get("TQTX_ADDRESS")
        if address:
            from .wire.security import attach_curve
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
        from .deploy.durable import resolve as resolve_durability
        # before anything starts: a refused $TQTX_* value names its variable, an earlier
        # one warns once here; what follows reads the mapped setting from cfg
        cfg.update(resolve_durability(cfg).config())
        if warm is None and cfg.get("placement") == "ray":
            _warm_dump_path()  # this process places the deployment on the cluster
        from .placement.ray_init import init_on_ray  # imports Ray only if asked or loaded
        placed = init_on_ray({**cfg, "num_units_given": given.get("num_units")},
                             _default_state_dir)
        if placed is not None:  # placement "ray", or inside a Ray job with a deployment
            _deployment, _client, _config = placed
            _deployment_options(cfg)
            return dict(_config)
        state_dir = os.path.abspath(cfg.get("state_dir") or os.environ.get("TQTX_STATE_DIR")
                                    or _default_state_dir())
        num_units = int(cfg["num_units"])
        if num_units < 1:
            raise ValueError("num_units must be >= 1")
        from .deploy import owner
        lock = owner.creation_lock(state_dir)
        owner.acquire(lock)
        try:
            rec = owner.live_record(state_dir, cfg)
            if rec is not None:
                _client, _config = _attach_recorded(rec, cfg, given.get("num_units"))
                return dict(_config)
            if warm is None:
                _warm_dump_path()  # overlaps the servers' start
            _deployment, _client, _config = _start_embedded(cfg, state_dir, num_units)
            _deployment_options(cfg)
            return dict(_config)
        finally:
            lock.release()


def _deployment_options(cfg: dict) -> None:
    """The creating process tells its controller TransferQueue's ``controller.polling_mode``
    (the other processes' configs are not applied, as in TransferQueue)."""
    if _deployment is not None and cfg.get("polling_mode") is not None:
        _client.controller.call("DATAPLANE_OPTIONS", {"polling_mode": cfg["polling_mode"]})


def _warm_dump_path() -> None:
    """Import the dump path (SQLAlchemy and the journals, ~0.4 s of CPU and ~24 MiB) in a
    daemon thread while init waits for the servers, so the first dump costs what later
    ones do. By default only the process that starts the deployment (the trainer) does it;
    attaching workers, which rarely dump, do not (config ``warm_dump`` True / False
    decides instead). A dump that comes early waits on the import lock; a failure here
    shows again at the dump."""
    def run():
        try:
            from .dump import save
            save.warm()
        except Exception:
            pass
    threading.Thread(target=run, name="tqtx-warm-dump", daemon=True).start()


def _attach_recorded(rec: dict, cfg: dict, asked_units):
    """Attach to the live deployment described by owner record ``rec``."""
    from .deploy.owner import RecordedDeployment, record_curve
    asked = cfg.get("durability")
    if asked is not None and rec.get("durability") not in (None, asked):
        import logging
        logging.getLogger("tqtx.init").warning(
            "attaching to the running deployment of %s with durability %r (config asked for "
            "%r)", rec["state_dir"], rec.get("durability"), asked)
    if asked_units is not None and int(asked_units) != rec.get("num_units"):
        # TransferQueue ignores the config of every init() but the first one, too.
        import logging
        logging.getLogger("tqtx.init").warning(
            "attaching to the running deployment of %s with %s units (config asked for %s)",
            rec["state_dir"], rec.get("num_units"), asked_units)
    client = Client(rec["address"], timeout=float(cfg["timeout"]),
                    deployment=RecordedDeployment(rec), curve=record_curve(rec, cfg))
    topo = client.topology
    return client, {"mode": "attached", "address": rec["address"],
                    "num_units": topo["num_units"], "state_dir": topo["state_dir"],
                    "host": rec["address"].split("//")[-1].rsplit(":", 1)[0],
                    "timeout": float(cfg["timeout"]), "units": topo["units"],
                    "incarnation": topo["incarnation"], "pids": dict(rec.get("pids") or {}),
                    "owner_pid": rec.get("owner_pid")}


def _start_embedded(cfg: dict, state_dir: str, num_units: int):
    """Start this process's deployment of ``state_dir`` (its owner record included)."""
    from .deploy import durable
    from .deploy.local import LocalDeployment
    env = dict(cfg.get("env") or {})
    if cfg.get("insecure"):
        env["TQTX_INSECURE"] = "1"
    if cfg.get("keys_dir"):
        env["TQTX_KEYS_DIR"] = os.path.abspath(cfg["keys_dir"])
    setting = durable.resolve(cfg)  # before anything starts: a refused value names its source
    env.update(setting.env(state_dir))
    dep = LocalDeployment(num_units=num_units, state_dir=state_dir, host=cfg["host"],
                          port=int(cfg["port"]), env=env or None,
                          unit_env=cfg.get("unit_env"), metrics=cfg.get("metrics"))
    try:
        from .wire.security import client_curve_for
        curve = client_curve_for(dep.state_dir, host=cfg["host"], keys_dir=cfg.get("keys_dir"),
                                 server_key=cfg.get("server_key"),
                                 client_key_file=cfg.get("client_key"),
                                 force=env.get("TQTX_CURVE") == "1")
        client = Client(dep.address, timeout=float(cfg["timeout"]), deployment=dep,
                        curve=curve)
    except BaseException:
        dep.stop(graceful=False)
        raise
    return dep, client, {
        "mode": "embedded", "address": dep.address, "num_units": num_units,
        "state_dir": dep.state_dir, "host": cfg["host"], "timeout": float(cfg["timeout"]),
        "units": client.unit_addresses, "incarnation": dep.incarnation,
        "pids": dict(dep.pids), "metrics_port": dep.metrics_port, "owner_pid": os.getpid(),
        **setting.record(dep.state_dir)}


def close(*, cancel_dumps: bool = False, keep_buffer: bool = False) -> dict:
    """Disconnect; shut the deployment down if this process started it.

    The process that started the deployment ends its buffer: the controller discards the
    journaled metadata (END_BUFFER), each unit is sent SHUTDOWN ``{"keep_buffer": false}``
    (a unit deletes its row log: durability ``"buffer"`` / ``"sync"``), then the processes
    stop. ``keep_buffer=True`` keeps both, so the next ``init`` on the state dir recovers
    the buffer as after a crash. Returns ``{"waited": [dump_ids], "cancelled": [dump_ids]}``
    for background dumps.
    """
    check_call("close", locals())
    global _client, _deployment, _config
    with _lock:
        report = {"waited": [], "cancelled": []}
        if _client is None:
            return report
        from .dump import save
        report = save.settle_background_dumps(cancel=cancel_dumps)
        try:
            if _deployment is not None:
                from .deploy.closing import close_deployment
                close_deployment(_client, _deployment, keep_buffer=keep_buffer)
        finally:
            _client.close()
            _client = _deployment = _config = None
        return report


def get_metrics_endpoint() -> str | None:
    """The controller's Prometheus endpoint ``host:port`` (unit k at port + 1 + k), or None
    when metrics export is off or tqtx is not initialized (as in TransferQueue)."""
    if _client is None:
        return None
    return _client.controller.call("TOPOLOGY").get("metrics_endpoint")


def _refuse_data_parser(data_parser) -> None:
    if data_parser is not None:
        raise NotImplementedError(
            "data_parser is not supported by tqtx: the callable would have to be shipped to "
            "the storage units as code (pickle), which tqtx never does; parse the data "
            "before kv_put / kv_batch_put")


def _client_of() -> Client:
    """The process-wide :class:`~tqtx.client.Client` (raises if :func:`init` was not called)."""
    if _client is None:
        raise NotInitializedError("tqtx is not initialized: call tqtx.init() first")
    return _client


def get_client():
    """The process-wide client: TransferQueue's low-level client calls
    (:mod:`tqtx.compat.dataplane`) over tqtx's own Client, whose methods it also has.
    Raises if init was not called."""
    from .compat.dataplane import client_for
    return client_for(_client_of())


def _deployment_handle():
    return _deployment


# ---------------------------------------------------------------- kv
def kv_put(key: str, partition_id: str, fields=None, tag: dict | None = None,
           data_parser=None) -> KVBatchMeta:
    """Put one sample: ``fields`` is a dict (tensors get a batch dim) or a TensorDict row.
    ``data_parser`` is refused (NotImplementedError): it would ship code."""
    check_call("kv_put", locals())
    from .client import tensors
    _refuse_data_parser(data_parser)
    if fields is None and tag is None:  # TransferQueue's check
        raise ValueError("Please provide at least one parameter of fields or tag.")
    columns = {}
    if fields is not None:
        if hasattr(fields, "batch_size") and len(fields.batch_size) >= 1:
            if fields.batch_size[0] != 1:
                raise ValueError(f"kv_put takes one sample; got batch size {list(fields.batch_size)}")
            columns = tensors.columns_from_tensordict(fields, 1)
        else:
            columns = tensors.columns_from_dict(dict(fields.items()))
    return _put([key], partition_id, columns, [tag] if tag is not None else None)


@gc_paused
def kv_batch_put(keys: list[str] | str, partition_id: str, fields=None,
                 tags: list[dict] | None = None, data_parser=None) -> KVBatchMeta:
    """Put a batch: ``fields`` is a TensorDict (or dict) with batch_size == len(keys); one
    str is one key. ``data_parser`` is refused (NotImplementedError): it would ship code."""
    check_call("kv_batch_put", locals())
    from .client import tensors
    _refuse_data_parser(data_parser)
    keys = as_key_list(keys)
    if fields is None and tags is None:  # TransferQueue's check
        raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
    if tags is not None:
        tags = list(tags)
        if len(tags) != len(keys):
            raise ValueError(f"got {len(tags)} tags for {len(keys)} keys")
    columns = {}
    if fields is not None:
        if not is_tensordict(fields):
            fields = tensors.batch_from_dict(fields, len(keys))
        columns = tensors.columns_from_tensordict(fields, len(keys))
    return _put(keys, partition_id, columns, tags)


def _put(keys, pid, columns, tags) -> KVBatchMeta:
    from .client import tensors
    from .client.tags import encode_tags
    from .schema import column_schema
    schemas = {}
    for field, values in columns.items():
        try:
            schemas[field] = column_schema(values)
        except ValueError as exc:
            raise ValueError(f"field {field!r}: {exc}") from None
    wire_tags = None if tags is None else encode_tags(tags)
    fields, stored = _client_of().put_columns(keys, pid, columns,
                                              semantics.mark_mixable(schemas), wire_tags,
                                              with_tags=True)
    # as TransferQueue: the keys' tags as stored now (earlier tags merged with these), each
    # a new object of this result
    return KVBatchMeta._of_own_tags(list(keys), [tensors.decode_object(t) for t in stored],
                                   partition_id=pid, fields=fields)


def _select_list(select_fields) -> list[str] | None:
    if select_fields is None:
        return None
    if isinstance(select_fields, str):
        return [select_fields]
    return list(select_fields)


@gc_paused
def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields=None):
    """Get rows in request order as a TensorDict (dense, jagged nested, NonTensorStack).

    ``keys`` and ``select_fields``: a str or a list. As TransferQueue by default: unknown
    keys and fields not produced for every key are left out, tensor fields come back
    jagged (see :mod:`tqtx.client.semantics`). Strict mode: an unknown key raises
    KeysNotFoundError, a field not produced for every key FieldsNotFoundError (both
    ValueErrors), uniform tensor fields come back dense. A key whose row was lost raises
    RowsLostError (a KeyError) in both modes, never left out."""
    check_call("kv_batch_get", locals())
    keys = as_key_list(keys)
    get = semantics.get_strict if semantics.strict() else semantics.get
    return get(_client_of(), keys, partition_id, _select_list(select_fields))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields=None):
    """Get the rows named by a :class:`KVBatchMeta` (its fields unless ``select_fields``,
    a str or a list, each of which must be in ``meta.fields``)."""
    check_call("kv_batch_get_by_meta", locals())
    from .errors import FieldsNotFoundError
    if meta.partition_id is None:
        raise ValueError("Must provide partition_id in the input KVBatchMeta.")
    select = _select_list(select_fields)
    if select is None:
        return kv_batch_get(meta.keys, meta.partition_id, meta.fields or None)
    absent = [f for f in select if f not in (meta.fields or ())]
    if absent:
        raise FieldsNotFoundError(f"select_fields {absent} not found in the KVBatchMeta's "
                                  f"fields {list(meta.fields or ())}")
    return kv_batch_get(meta.keys, meta.partition_id, select)


def kv_list(partition_id: str | None = None) -> dict:
    """``{partition_id: {key: tag}}`` for one partition or all. Keys whose rows were lost
    are left out (:func:`list_lost_keys` names them)."""
    check_call("kv_list", locals())
    return _client_of().list_keys(partition_id, decode=True)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove keys (unknown keys and partitions are ignored); their indexes are reused.
    ``keys``: a str or a non-empty list of str (an empty list is a ValueError, as in
    TransferQueue)."""
    check_call("kv_clear", locals())
    keys = as_key_list(keys)
    _client_of().clear(keys, partition_id)
    return None


# ---------------------------------------------------------------- checkpoint
def save_checkpoint(checkpoint_dir, *, include_storage: bool = True,
                    metadata: dict | None = None) -> dict:
    """Save the whole system to ``checkpoint_dir`` (each unit writes its own file).

    ``metadata`` goes to ``metadata.json`` as ``{"storage_saved": true, "user_metadata":
    metadata}``. ``include_storage=False`` has no effect (logged), as for TransferQueue's
    in-memory SimpleStorage: without the rows a restart would lose them."""
    check_call("save_checkpoint", locals())
    from .dump.checkpoint import save
    return save(_client_of(), os.fspath(checkpoint_dir), metadata=metadata,
                include_storage=include_storage)


def load_checkpoint(checkpoint_dir) -> dict:
    """Replace the whole system's state with a checkpoint (same unit count required).

    Returns ``{"dir", "metadata" (the user's), "storage_saved", "keys", "seconds"}``. A
    missing directory, ``metadata.json`` or unit file raises DumpNotFoundError (a
    FileNotFoundError) naming it, before anything is replaced."""
    check_call("load_checkpoint", locals())
    from .dump.checkpoint import load
    return load(_client_of(), os.fspath(checkpoint_dir))


# ---------------------------------------------------------------- selective dump / restore
def dump_data_by_key(dump_dir, keys, partition_id: str, *, via: str = "units",
                     block: bool = True):
    """Save exactly ``keys`` of ``partition_id`` (all their fields and tags) to ``dump_dir``."""
    check_call("dump_data_by_key", locals())
    from .dump import save
    return save.dump_data_by_key(_client_of(), os.fspath(dump_dir), keys, partition_id,
                                 via=via, block=block)


def load_data_by_key(dump_dir, *, partition_id: str | None = None, via: str = "units") -> dict:
    """Merge a dump into the running system as one transaction."""
    check_call("load_data_by_key", locals())
    from .dump import load
    return load.load_data_by_key(_client_of(), os.fspath(dump_dir), partition_id=partition_id,
                                 via=via)


def recover_data_load(dump_dir, *, cancel: bool = False) -> bool:
    """Settle the restore recorded for ``dump_dir``: True if committed or nothing pending."""
    check_call("recover_data_load", locals())
    from .dump import load
    return load.recover_data_load(_client_of(), os.fspath(dump_dir), cancel=cancel)


def list_restores(partition_id: str | None = None) -> list[dict]:
    """Unresolved restores (with their per-unit states)."""
    check_call("list_restores", locals())
    return _client_of().controller.call("LIST_RESTORES", {"partition_id": partition_id})["restores"]


def read_row_index(dump_dir) -> dict:
    """A dump's keys, source indexes, fields, tags and schemas, without reading any payload."""
    check_call("read_row_index", locals())
    from .client import tensors
    from . import format as fmt
    from .journal.publish import dump_lock, recover_publications
    from .layout.paths import check_path_arg, lock_path, old_path, siblings_writable
    path = check_path_arg(dump_dir, "dump_dir")
    # A read-only dump is read as it is: nothing can be published into it or recovered there.
    if siblings_writable(path) and (lock_path(path).exists() or old_path(path).exists()):
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
    if name == "BatchMeta":
        from .client.batchmeta import BatchMeta
        return BatchMeta
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
