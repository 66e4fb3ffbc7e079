"""Controller requests behind TransferQueue's low-level client (``tqtx.compat.dataplane``): batch
metadata by key or by index, streaming fetch with per-task consumption, production status.

No payload: rows are read and written through the KV requests (LOOKUP, ALLOC, COMMIT_PUT),
units to client directly. Consumption is TransferQueue's: a task consumed a sample once a
``fetch`` handed it out; it is kept in memory only (a restarted controller, a checkpoint
load or the end of the buffer forget it), per ``(partition, task)`` as ``{index: key}``,
so a cleared key whose index goes to another key is not consumed for it.

:class:`tqtx.controller.server.Controller` owns one :class:`DataPlaneRequests` and registers
its handlers; CLEAR, CHECKPOINT_REPLACE and END_BUFFER go through it to the KV requests, so
the consumption they make stale is forgotten with them.
"""
from __future__ import annotations

from .kv import KVRequests
from .metadata import EMPTY, Metadata

FETCH_MODES = ("fetch", "force_fetch")


class DataPlaneRequests:
    """Handlers of KV_META, KV_KEYS, STREAM_META, CONSUMPTION, PRODUCTION,
    RESET_CONSUMPTION, PARTITIONS and DATAPLANE_OPTIONS, and the forgetting forms of CLEAR,
    CHECKPOINT_REPLACE and END_BUFFER."""

    def __init__(self, *, meta: Metadata, kv: KVRequests):
        self.meta, self.kv = meta, kv
        self.consumed: dict[tuple[str, str], dict[int, str]] = {}
        self.polling_mode = False

    def _rows_of(self, part, keys: list[str]) -> dict:
        """Metadata of ``keys`` (all known to ``part``) as KV_META / STREAM_META send it."""
        indexes = [part.keys[k] for k in keys]
        common = None
        for i in indexes:
            f = part.fields.get(i, EMPTY)
            common = f if common is None else common & f
        fields = sorted(common or ())
        return {"keys": keys, "indexes": indexes, "fields": fields,
                "schemas": {f: part.schema[f] for f in fields if f in part.schema},
                "tags": [part.tags.get(k) or {} for k in keys]}

    def kv_meta(self, body, req):
        """Keys of ``keys`` the partition has (in request order) with their indexes, tags
        and the fields they all have; with ``create`` the caller made the others first."""
        part = self.meta.partition(body["partition_id"])
        if part is None:
            return {"keys": [], "indexes": [], "fields": [], "schemas": {}, "tags": []}
        return self._rows_of(part, [k for k in body["keys"] if k in part.keys])

    def kv_keys(self, body, req):
        """Keys of global ``indexes`` in the partition; a ValueError names the indexes that
        have none there."""
        pid, indexes = body["partition_id"], body["indexes"]
        part = self.meta.partition(pid)
        by_index = {} if part is None else {i: k for k, i in part.keys.items()}
        missing = [i for i in indexes if i not in by_index]
        if missing:
            raise ValueError(f"Some global_indexes have no corresponding keys! Indexes "
                             f"{missing[:20]} have no key in partition {pid!r}")
        return {"keys": [by_index[i] for i in indexes]}

    def _listed(self, part):
        """(index, key) of the partition's readable keys, in index order."""
        lost = part.lost
        return sorted((i, k) for k, i in part.keys.items() if i not in lost)

    def stream_meta(self, body, req):
        """TransferQueue's get_meta: ``fetch`` hands out the first ``batch_size`` samples (in
        index order) that have every field of ``data_fields`` and that ``task_name`` has not
        consumed, and marks them consumed, or nothing if fewer are ready; ``force_fetch``
        returns every sample, with whether it has the fields, and consumes nothing."""
        pid, mode = body["partition_id"], body.get("mode") or "fetch"
        fields = list(body.get("data_fields") or [])
        if mode not in FETCH_MODES:
            raise ValueError(f"get_meta mode {mode!r}: tqtx serves {list(FETCH_MODES)}")
        part = self.meta.partition(pid)
        out = {"keys": [], "indexes": [], "fields": fields, "schemas": {}, "tags": [],
               "ready": [], "available": 0, "polling_mode": self.polling_mode}
        if part is None:
            return out
        wanted = frozenset(fields)
        out["schemas"] = {f: part.schema[f] for f in fields if f in part.schema}
        rows = self._listed(part)
        if mode == "force_fetch":
            chosen = rows
            out["ready"] = [bool(wanted) and wanted <= part.fields.get(i, EMPTY)
                            for i, _ in rows]
        else:
            task = body.get("task_name")
            if task is None:
                raise ValueError("get_meta mode 'fetch' needs a task_name")
            done = self.consumed.setdefault((pid, task), {})
            ready = [(i, k) for i, k in rows
                     if done.get(i) != k and wanted <= part.fields.get(i, EMPTY)]
            out["available"] = len(ready)
            size = int(body["batch_size"])
            if len(ready) < size or not ready:
                return out
            chosen = ready[:size]
            done.update(chosen)
            out["ready"] = [True] * len(chosen)
        out["keys"] = [k for _, k in chosen]
        out["indexes"] = [i for i, _ in chosen]
        out["tags"] = [part.tags.get(k) or {} for _, k in chosen]
        return out

    def consumption(self, body, req):
        """``{"indexes", "consumed"}`` of every readable sample of the partition for
        ``task_name`` (None when the partition does not exist)."""
        part = self.meta.partition(body["partition_id"])
        if part is None:
            return None
        done = self.consumed.get((body["partition_id"], body["task_name"]), {})
        rows = self._listed(part)
        return {"indexes": [i for i, _ in rows], "consumed": [done.get(i) == k for i, k in rows]}

    def production(self, body, req):
        """``{"indexes", "produced"}``: per readable sample, whether it has each field of
        ``data_fields`` (None when the partition does not exist, no field is named, or a
        field was never put in the partition)."""
        part = self.meta.partition(body["partition_id"])
        fields = list(body.get("data_fields") or [])
        if part is None or not fields or any(f not in part.schema for f in fields):
            return None
        rows = self._listed(part)
        return {"indexes": [i for i, _ in rows],
                "produced": [[f in part.fields.get(i, EMPTY) for f in fields] for i, _ in rows]}

    def reset_consumption(self, body, req):
        pid, task = body["partition_id"], body.get("task_name")
        for key in [k for k in self.consumed if k[0] == pid and (task is None or k[1] == task)]:
            del self.consumed[key]
        return {"success": True}

    def partitions(self, body, req):
        return {"partition_ids": sorted(p.pid for p in self.meta.visible())}

    def dataplane_options(self, body, req):
        """Options of the deployment's creating process (``polling_mode``)."""
        if "polling_mode" in body:
            self.polling_mode = bool(body["polling_mode"])
        return {"polling_mode": self.polling_mode}

    # ---------------------------------------------------------------- forgetting
    def clear_forgetting(self, body, req):
        """CLEAR, and the cleared keys' consumption goes with them."""
        out = self.kv.clear(body, req)
        freed = set(out.get("freed") or ())
        if freed:
            for (pid, _task), done in self.consumed.items():
                if pid == body["partition_id"]:
                    for i in freed & done.keys():
                        del done[i]
        return out

    def replace_forgetting(self, body, req):
        """CHECKPOINT_REPLACE: the checkpoint's samples start unconsumed."""
        out = self.kv.checkpoint_replace(body, req)
        self.consumed.clear()
        return out

    def end_forgetting(self, body, req):
        out = self.kv.end_buffer(body, req)
        self.consumed.clear()
        return out
