"""TransferQueue 0.1.11's low-level client calls on tqtx: what ``tq.get_client()`` returns.

verl's workers (``transferqueue_utils``, ``protocol.py``) and NeMo-RL's adapter call
``get_meta``, ``put``, ``get_data``, ``kv_retrieve_meta``, ``kv_retrieve_keys``,
``check_consumption_status``, ... (and their ``async_`` forms) with
:class:`~tqtx.client.batchmeta.BatchMeta` batches. Each call here is TransferQueue's, in the same
signature, done with tqtx's requests: metadata from the controller (KV_META, KV_KEYS,
STREAM_META, ...; :mod:`tqtx.controller.dataplane`), rows by key through the KV path, so
payload moves between the units and this process directly. Results have TransferQueue's
shapes (jagged tensor fields, fields in name order). The object also has every method of
tqtx's own :class:`~tqtx.client.Client`.

Not provided: ``put`` without metadata and ``get_meta(mode="insert")`` (TransferQueue's
insert mode makes rows without keys; every tqtx row has a key: use ``kv_batch_put``), custom
samplers, and the controller/storage checkpoint calls (use ``tq.save_checkpoint``).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import weakref

from ..client.batchmeta import BatchMeta
from ..arguments.table import ANY_KEYS, check_keys

log = logging.getLogger("tqtx.compat.dataplane")

INSERT_MODE = ("TransferQueue's insert mode (put without metadata, get_meta(mode='insert')) "
               "makes rows without keys; every tqtx row has a key: put new rows with "
               "tq.kv_batch_put(keys, partition_id, fields)")
# How long get_meta(mode="fetch") waits for enough ready samples unless polling_mode is on.
GET_META_TIMEOUT = float(os.environ.get("TQTX_GET_META_TIMEOUT", "5"))

_facades: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def client_for(client) -> "DataPlaneClient":
    """The one :class:`DataPlaneClient` of tqtx ``client``."""
    facade = _facades.get(client)
    if facade is None:
        facade = _facades[client] = DataPlaneClient(client)
    return facade


def list_lost_keys(partition_id: str | None = None) -> dict:
    """``{partition_id: {key: {"tag", "fields", "unit"}}}``: keys whose rows were lost
    (their unit restarted without them) while the deployment runs. kv_list leaves them
    out and kv_batch_get of one raises RowsLostError; put them again (re-generate them),
    restore a dump that holds them, or kv_clear them."""
    from .. import api
    from ..arguments.table import check_call
    check_call("list_lost_keys", locals())
    from ..client.tensors import decode_object
    raw = api._client_of().call_controller("LIST", {"partition_id": partition_id, "lost": True},
                                           what="listing lost keys")
    return {pid: {k: {**v, "tag": decode_object(v["tag"])} for k, v in keys.items()}
            for pid, keys in raw.items()}


def _field_schema(schemas: dict, fields) -> dict:
    """TransferQueue's batch field schema from tqtx field schemas."""
    import torch
    out = {}
    for f in fields:
        s = schemas.get(f)
        if s is None:
            continue
        tensor = s.get("kind") == "tensor"
        out[f] = {"dtype": getattr(torch, s["dtype"]) if tensor else None,
                  "shape": torch.Size(s["shape"]) if tensor and s.get("shape") is not None
                  else None,
                  "is_nested": bool(tensor and s.get("jagged")), "is_non_tensor": not tensor}
    return out


def _batch(pid: str, res: dict, fields, produced) -> BatchMeta:
    from ..client.tensors import decode_object
    n = len(res["indexes"])
    return BatchMeta(res["indexes"], [pid] * n, _field_schema(res["schemas"], fields),
                     [1 if p else 0 for p in produced],
                     custom_meta=[decode_object(t) for t in res["tags"]], keys=res["keys"])


class DataPlaneClient:
    """TransferQueue's ``TransferQueueClient`` calls over tqtx ``client`` (see the module
    docstring); other attributes are the tqtx Client's."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)

    def __setattr__(self, name, value):  # e.g. reconnect_timeout: the Client's own
        if name == "_client":
            object.__setattr__(self, name, value)
        else:
            setattr(self._client, name, value)

    def _call(self, op: str, body: dict, what: str):
        return self._client.call_controller(op, body, what=what)

    # ---------------------------------------------------------------- by key
    def kv_retrieve_meta(self, keys, partition_id: str, create: bool = False) -> BatchMeta:
        """The BatchMeta of ``keys`` that exist (unknown ones left out; with ``create``
        they are made first, without fields or tags), with the fields they all have."""
        keys = check_keys("kv_retrieve_meta()", keys, ANY_KEYS)
        body = {"partition_id": partition_id, "keys": keys}
        res = self._call("KV_META", body, f"looking up {len(keys)} key(s)")
        if create and len(res["keys"]) != len(keys):
            have = set(res["keys"])
            missing = list(dict.fromkeys(k for k in keys if k not in have))
            self._client.put_columns(missing, partition_id, {}, {}, None)
            res = self._call("KV_META", body, f"looking up {len(keys)} key(s)")
        if len(res["keys"]) != len(keys):
            log.warning("kv_retrieve_meta: keys %s were not found in partition %r; they are "
                        "left out", sorted(set(keys) - set(res["keys"]))[:20], partition_id)
        ready = [bool(res["fields"])] * len(res["keys"])
        return _batch(partition_id, res, res["fields"], ready)

    def kv_retrieve_keys(self, global_indexes, partition_id: str) -> list[str]:
        """The keys of ``global_indexes`` in the partition (RuntimeError if one has none)."""
        if isinstance(global_indexes, int):
            global_indexes = [global_indexes]
        elif isinstance(global_indexes, list):
            if not global_indexes:
                raise ValueError("Received an empty list as `global_indexes`.")
            if not all(isinstance(i, int) for i in global_indexes):
                raise TypeError("Not all elements in `global_indexes` are int.")
        else:
            raise TypeError("Only int or list of int are allowed as `global_indexes`.")
        try:
            return self._call("KV_KEYS", {"partition_id": partition_id,
                                          "indexes": global_indexes},
                              f"looking up the keys of {len(global_indexes)} index(es)")["keys"]
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None

    def kv_list(self, partition_id: str | None = None) -> dict:
        from .. import api
        return api.kv_list(partition_id)

    def _keys_of(self, meta: BatchMeta, positions: list[int], pid: str) -> list[str]:
        if meta._keys is not None:
            return [meta._keys[i] for i in positions]
        return self.kv_retrieve_keys([meta.global_indexes[i] for i in positions], pid)

    @staticmethod
    def _by_partition(meta: BatchMeta) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, pid in enumerate(meta.partition_ids):
            groups.setdefault(pid, []).append(i)
        return groups

    # ---------------------------------------------------------------- streaming
    def get_meta(self, data_fields: list[str], batch_size: int, partition_id: str,
                 mode: str = "fetch", task_name: str | None = None,
                 sampling_config: dict | None = None) -> BatchMeta:
        """TransferQueue's get_meta with its default (sequential) sampler: ``fetch`` hands
        ``task_name`` the first ``batch_size`` ready samples it has not consumed (an empty
        batch in polling mode when fewer are ready, else it waits up to
        ``$TQTX_GET_META_TIMEOUT`` s, then TimeoutError); ``force_fetch`` every sample.
        ``sampling_config`` is for other samplers and is not used."""
        if mode == "insert":
            raise NotImplementedError(INSERT_MODE)
        body = {"partition_id": partition_id, "data_fields": list(data_fields or []),
                "batch_size": batch_size, "mode": mode, "task_name": task_name}
        deadline = time.monotonic() + GET_META_TIMEOUT
        while True:
            res = self._call("STREAM_META", body, f"fetching metadata of {partition_id!r}")
            if res["keys"] or mode != "fetch" or res["polling_mode"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Timeout while waiting for sufficient data for task {task_name}. "
                    f"Required: {batch_size}, Available: {res['available']}")
            time.sleep(0.05)
        return _batch(partition_id, res, body["data_fields"], res["ready"])

    def put(self, data, metadata: BatchMeta | None = None, partition_id: str | None = None,
            data_parser=None) -> BatchMeta:
        """Write ``data`` (a TensorDict, one row per sample of ``metadata``) to those samples,
        with ``metadata``'s custom_meta as their tags; returns ``metadata`` with the new
        fields added."""
        from .. import api
        api._refuse_data_parser(data_parser)
        if metadata is None:
            if partition_id is None:
                raise ValueError("partition_id must be provided if metadata is not given")
            raise NotImplementedError(INSERT_MODE)
        if not metadata or metadata.size == 0:
            raise ValueError("metadata cannot be none or empty")
        groups = self._by_partition(metadata)
        for pid, positions in groups.items():
            rows = data if len(groups) == 1 else _rows(data, positions)
            api.kv_batch_put(self._keys_of(metadata, positions, pid), pid, fields=rows,
                             tags=[metadata.custom_meta[i] for i in positions])
        return metadata.add_fields(data)

    def get_data(self, metadata: BatchMeta):
        """The rows of ``metadata``'s samples and fields, in its order (a field not
        produced for one of them is a FieldsNotFoundError)."""
        from ..client import semantics
        from ..client.tensors import TensorDict
        if not metadata or metadata.size == 0 or not metadata.field_names:
            log.warning("get_data: an empty BatchMeta; returning an empty TensorDict")
            return TensorDict({}, batch_size=[0])
        groups = self._by_partition(metadata)
        parts = {pid: semantics.read(self._client, self._keys_of(metadata, pos, pid), pid,
                                     metadata.field_names) for pid, pos in groups.items()}
        if len(parts) == 1:
            return next(iter(parts.values()))
        return _merge(parts, groups, metadata.size, metadata.field_names)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store ``metadata``'s custom_meta as its samples' tags (merged into them, as
        kv_batch_put's tags are)."""
        from .. import api
        if metadata.size == 0:
            return
        for pid, positions in self._by_partition(metadata).items():
            api.kv_batch_put(self._keys_of(metadata, positions, pid), pid,
                             tags=[metadata.custom_meta[i] for i in positions])

    def clear_samples(self, metadata: BatchMeta) -> None:
        from .. import api
        if metadata.size == 0:
            log.warning("clear_samples: an empty BatchMeta; nothing to clear")
            return
        for pid, positions in self._by_partition(metadata).items():
            api.kv_clear(self._keys_of(metadata, positions, pid), pid)

    def clear_partition(self, partition_id: str) -> None:
        """Clear every key of the partition (lost ones too)."""
        from .. import api
        keys = list(api.kv_list(partition_id).get(partition_id, {}))
        keys += list(api.list_lost_keys(partition_id).get(partition_id, {}))
        if not keys:
            log.warning("clear_partition: partition %r does not exist; nothing to clear",
                        partition_id)
            return
        api.kv_clear(keys, partition_id)

    def get_consumption_status(self, task_name: str, partition_id: str):
        """(global indexes, int8 consumed flags) of the partition's samples for the task,
        or (None, None) when the partition does not exist."""
        import torch
        res = self._call("CONSUMPTION", {"partition_id": partition_id, "task_name": task_name},
                         "reading consumption")
        if res is None:
            return None, None
        return (torch.tensor(res["indexes"], dtype=torch.long),
                torch.tensor(res["consumed"], dtype=torch.int8))

    def get_production_status(self, data_fields: list[str], partition_id: str):
        """(global indexes, int8 ``[samples, fields]`` produced flags), or (None, None)."""
        import torch
        res = self._call("PRODUCTION", {"partition_id": partition_id,
                                        "data_fields": list(data_fields or [])},
                         "reading production")
        if res is None:
            return None, None
        flags = torch.tensor(res["produced"], dtype=torch.int8)
        return (torch.tensor(res["indexes"], dtype=torch.long),
                flags.reshape(len(res["indexes"]), len(data_fields)))

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        _, status = self.get_consumption_status(task_name, partition_id)
        return bool(status is not None and status.numel() > 0 and bool((status == 1).all()))

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        _, status = self.get_production_status(data_fields, partition_id)
        return bool(status is not None and bool((status == 1).all()))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return bool(self._call("RESET_CONSUMPTION", {"partition_id": partition_id,
                                                     "task_name": task_name},
                               "resetting consumption")["success"])

    def get_partition_list(self) -> list[str]:
        return self._call("PARTITIONS", {}, "listing partitions")["partition_ids"]


SYNC_CALLS = ("kv_retrieve_meta", "kv_retrieve_keys", "kv_list", "get_meta", "put", "get_data",
              "set_custom_meta", "clear_samples", "clear_partition", "get_consumption_status",
              "get_production_status", "check_consumption_status", "check_production_status",
              "reset_consumption", "get_partition_list")


def _async_of(name: str):
    sync = getattr(DataPlaneClient, name)

    @functools.wraps(sync)
    async def call(self, *args, **kwargs):
        return await asyncio.to_thread(sync, self, *args, **kwargs)
    call.__name__ = call.__qualname__ = f"async_{name}"
    return call


for _name in SYNC_CALLS:
    setattr(DataPlaneClient, f"async_{_name}", _async_of(_name))


def _rows(data, positions: list[int]):
    import torch
    return data[torch.tensor(positions, dtype=torch.long)]


def _merge(parts: dict, groups: dict, n: int, fields: list[str]):
    """One batch, in request order, of the per-partition batches ``parts``."""
    from ..client.tensors import NonTensorStack, TensorDict, pack_tensor_rows
    out = {}
    for f in fields:
        rows = [None] * n
        for pid, positions in groups.items():
            col = parts[pid][f]
            values = list(col.unbind(0)) if hasattr(col, "unbind") else list(col)
            for p, v in zip(positions, values):
                rows[p] = v
        tensors = [r for r in rows if hasattr(r, "dim")]
        out[f] = pack_tensor_rows(rows) if len(tensors) == n else NonTensorStack(*rows)
    return TensorDict(out, batch_size=[n])
