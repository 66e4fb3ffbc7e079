"""``BatchMeta``: the metadata of a batch of samples that TransferQueue's low-level client
(``get_meta``, ``put``, ``get_data``, ``kv_retrieve_meta``; :mod:`tqtx.compat.dataplane`) hands
around, with the attributes and methods of TransferQueue 0.1.11's class of that name.

Columnar, one entry per sample: ``global_indexes``, ``partition_ids``, ``custom_meta`` (the
tags), ``production_status`` (int8, 1 = the batch's fields are produced); batch-level
``field_schema`` (``{field: {"dtype", "shape", "is_nested", "is_non_tensor"[,
"per_sample_shapes"]}}``) and ``extra_info``. A batch made by tqtx also remembers each
sample's key, so reading or writing it needs no index-to-key lookup; a batch built by hand
from indexes has no keys and the client looks them up. Picklable (Ray ships it to workers).
"""
from __future__ import annotations

import copy
import logging
from collections import defaultdict
from types import MappingProxyType

import numpy as np

from .kvmeta import chunk_bounds

log = logging.getLogger("tqtx.batchmeta")


def _same(a, b) -> bool:
    """Equality for extra_info values (tensors and arrays compared by value)."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "equal") and callable(a.equal) and hasattr(a, "dtype"):
        return bool(a.equal(b))  # torch.Tensor
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


def field_schema_of(data) -> dict:
    """TransferQueue's field schema of a batch (TensorDict): per field its dtype, one
    sample's shape, nestedness, whether it is a non-tensor, and per-sample shapes of a
    nested field."""
    import torch
    n = data.batch_size[0] if len(data.batch_size) else 0
    out: dict = {}
    if n == 0:
        return out
    for name, value in data.items():
        if isinstance(value, torch.Tensor):
            nested = value.is_nested
            rows = value.unbind() if nested else None
            count = len(rows) if nested else value.shape[0]
            if count != n:
                raise ValueError(f"Inconsistent batch dimension for field {name!r}: expected "
                                 f"{n} samples, got {count}")
            first = rows[0] if nested else (value.unsqueeze(-1)[0] if value.dim() == 1
                                            else value[0])
            meta = {"dtype": first.dtype, "shape": first.shape, "is_nested": nested,
                    "is_non_tensor": False}
            if nested:
                meta["per_sample_shapes"] = [tuple(r.shape) for r in rows]
        else:
            if len(value) != n:
                raise ValueError(f"Inconsistent batch dimension for field {name!r}: expected "
                                 f"{n} samples, got {len(value)}")
            meta = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
        out[name] = meta
    return out


class SampleView:
    """A read-only view of one sample of a :class:`BatchMeta` (``batch.samples[i]``)."""

    __slots__ = ("_batch", "_i")

    def __init__(self, batch: "BatchMeta", i: int):
        self._batch, self._i = batch, i

    @property
    def global_index(self) -> int:
        return self._batch.global_indexes[self._i]

    @property
    def partition_id(self) -> str:
        return self._batch.partition_ids[self._i]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._i])

    @property
    def custom_meta(self):
        return MappingProxyType(self._batch.custom_meta[self._i])

    @property
    def fields(self):
        """Per-field schema of this sample (a nested field's own ``shape``)."""
        out = {}
        for name, meta in self._batch.field_schema.items():
            one = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            if meta.get("per_sample_shapes") is not None:
                one["shape"] = meta["per_sample_shapes"][self._i]
            out[name] = MappingProxyType(one)
        return MappingProxyType(out)


class SampleViews:
    """``batch.samples``: indexable, sized, iterable views of the samples."""

    __slots__ = ("_batch",)

    def __init__(self, batch: "BatchMeta"):
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, i: int) -> SampleView:
        return SampleView(self._batch, i)

    def __iter__(self):
        return (SampleView(self._batch, i) for i in range(len(self)))


class BatchMeta:
    """Metadata of a batch of samples (see the module docstring)."""

    __slots__ = ("global_indexes", "partition_ids", "field_schema", "production_status",
                 "extra_info", "custom_meta", "_custom_backend_meta", "_keys")

    def __init__(self, global_indexes=None, partition_ids=None, field_schema=None,
                 production_status=None, extra_info=None, custom_meta=None,
                 _custom_backend_meta=None, *, keys=None):
        self.global_indexes = list(global_indexes or [])
        self.partition_ids = list(partition_ids or [])
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise ValueError(f"Length mismatch: global_indexes has {n}, partition_ids has "
                             f"{len(self.partition_ids)}")
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise ValueError(f"Field {name!r} per_sample_shapes length {len(shapes)} != "
                                 f"batch_size {n}")
        self.extra_info = dict(extra_info or {})
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True)
            if len(self.production_status) != n:
                raise ValueError(f"production_status length {len(self.production_status)} "
                                 f"!= batch_size {n}")
        self.custom_meta = self._per_sample(custom_meta, "custom_meta", n)
        self._custom_backend_meta = self._per_sample(_custom_backend_meta,
                                                     "_custom_backend_meta", n)
        self._keys = list(keys) if keys is not None else None
        if self._keys is not None and len(self._keys) != n:
            raise ValueError(f"keys length {len(self._keys)} != batch_size {n}")

    @staticmethod
    def _per_sample(values, name: str, n: int) -> list[dict]:
        if not values:
            return [{} for _ in range(n)]
        out = [dict(d) for d in values]
        if len(out) != n:
            raise ValueError(f"{name} length {len(out)} != batch_size {n}")
        return out

    def __setstate__(self, state):
        # pickle of __slots__ without __dict__: (None, {slot: value}); Ray's zero-copy
        # deserialization gives read-only arrays, and production_status is updated in place
        slots = state[1] if isinstance(state, tuple) else state
        for name in self.__slots__:
            setattr(self, name, slots.get(name))
        if not self.production_status.flags.writeable:
            self.production_status = self.production_status.copy()

    # ---------------------------------------------------------------- properties
    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    @property
    def samples(self) -> SampleViews:
        return SampleViews(self)

    @property
    def sample_keys(self) -> list[str] | None:
        """Each sample's key when tqtx made this batch (None for a hand-built one; not a
        TransferQueue attribute)."""
        return None if self._keys is None else list(self._keys)

    def get_dtypes(self, field_name: str) -> list:
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        return [self.field_schema[field_name].get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list:
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        meta = self.field_schema[field_name]
        if meta.get("per_sample_shapes") is not None:
            return list(meta["per_sample_shapes"])
        return [meta.get("shape")] * self.size

    # ---------------------------------------------------------------- extra_info
    def get_extra_info(self, key: str, default=None):
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str):
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # ---------------------------------------------------------------- custom_meta
    def get_all_custom_meta(self) -> list[dict]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta) -> None:
        """Merge one dict per sample into each sample's custom_meta."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(f"The length of custom_meta list {len(custom_meta)} must match "
                             f"the batch size: {self.size}")
        for mine, new in zip(self.custom_meta, custom_meta):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # ---------------------------------------------------------------- fields and samples
    def add_fields(self, tensor_dict, set_all_ready: bool = True) -> "BatchMeta":
        """Record ``tensor_dict``'s fields (in place); with ``set_all_ready`` every sample
        is produced."""
        n = tensor_dict.batch_size[0] if len(tensor_dict.batch_size) else 0
        if n == 0:
            log.warning("add_fields: an empty TensorDict; nothing is changed")
            return self
        if n != self.size:
            raise ValueError(f"add_fields batch size mismatch: self.size={self.size} vs "
                             f"tensor_dict={n}")
        self.field_schema.update(field_schema_of(tensor_dict))
        if set_all_ready:
            self.production_status[:] = 1
        return self

    def _taking(self, positions: list[int]) -> "BatchMeta":
        schema = {}
        for name, meta in self.field_schema.items():
            new = copy.deepcopy(meta)
            if meta.get("per_sample_shapes") is not None:
                new["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in positions]
            schema[name] = new
        return BatchMeta(
            [self.global_indexes[i] for i in positions], [self.partition_ids[i] for i in positions],
            schema, self.production_status[positions], self.extra_info,
            [copy.deepcopy(self.custom_meta[i]) for i in positions],
            [copy.deepcopy(self._custom_backend_meta[i]) for i in positions],
            keys=None if self._keys is None else [self._keys[i] for i in positions])

    def select_samples(self, sample_indices: list[int]) -> "BatchMeta":
        if any(i < 0 or i >= self.size for i in sample_indices):
            raise ValueError(f"Sample indices must be in range [0, {self.size})")
        return self._taking(list(sample_indices))

    def select_fields(self, field_names: list[str]) -> "BatchMeta":
        """A new batch with only those of ``field_names`` this batch has (others are
        left out, as in TransferQueue)."""
        schema = {f: copy.deepcopy(self.field_schema[f]) for f in field_names
                  if f in self.field_schema}
        backend = [{f: v for f, v in m.items() if f.startswith("_") or f in field_names}
                   for m in self._custom_backend_meta]
        return BatchMeta(self.global_indexes, self.partition_ids, schema,
                         self.production_status.copy(), copy.deepcopy(self.extra_info),
                         copy.deepcopy(self.custom_meta), backend, keys=self._keys)

    def copy(self) -> "BatchMeta":
        return BatchMeta(list(self.global_indexes), list(self.partition_ids),
                         copy.deepcopy(self.field_schema), self.production_status.copy(),
                         copy.deepcopy(self.extra_info), copy.deepcopy(self.custom_meta),
                         copy.deepcopy(self._custom_backend_meta), keys=self._keys)

    def __getitem__(self, item) -> "BatchMeta":
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.size if item < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError("BatchMeta index out of range")
            return self._taking([i])
        if isinstance(item, slice):
            return self._taking(list(range(*item.indices(self.size))))
        raise TypeError(f"Indexing with {type(item)} is not supported.")

    def chunk(self, chunks: int) -> list["BatchMeta"]:
        """``chunks`` consecutive batches whose sizes differ by at most one (the first ones
        larger); some are empty when there are fewer samples than chunks."""
        return [self._taking(list(range(a, b)))
                for a, b in chunk_bounds(self.size, chunks, "BatchMeta", "samples")]

    def chunk_by_partition(self) -> list["BatchMeta"]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, pid in enumerate(self.partition_ids):
            groups[pid].append(i)
        return [self._taking(pos) for pos in groups.values()]

    def union(self, other: "BatchMeta") -> "BatchMeta":
        """The same samples with both batches' fields (``other``'s win), both ready only
        where both are, tags and extra_info merged (``other``'s win)."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes:
            raise ValueError(f"BatchMeta.union: global_indexes do not match: "
                             f"{self.global_indexes} vs {other.global_indexes}")
        if self.partition_ids != other.partition_ids:
            raise ValueError(f"BatchMeta.union: partition_ids do not match: "
                             f"{self.partition_ids} vs {other.partition_ids}")
        schema = copy.deepcopy(self.field_schema)
        schema.update(copy.deepcopy(other.field_schema))
        return BatchMeta(
            list(self.global_indexes), list(self.partition_ids), schema,
            np.bitwise_and(self.production_status, other.production_status),
            {**self.extra_info, **other.extra_info},
            [{**copy.deepcopy(a), **copy.deepcopy(b)}
             for a, b in zip(self.custom_meta, other.custom_meta)],
            [{**copy.deepcopy(a), **copy.deepcopy(b)}
             for a, b in zip(self._custom_backend_meta, other._custom_backend_meta)],
            keys=self._keys if self._keys is not None else other._keys)

    @classmethod
    def concat(cls, data: list["BatchMeta"], validate: bool = True) -> "BatchMeta":
        """One batch of the non-empty batches of ``data``, in order. With ``validate`` they
        must have the same field names and dtypes; extra_info is merged (a key with two
        different values is a ValueError)."""
        data = [d for d in (data or []) if d and d.size > 0]
        if not data:
            log.warning("BatchMeta.concat: no non-empty batch; returning an empty one")
            return cls.empty()
        first = data[0]
        if validate:
            for i, d in enumerate(data):
                if d.field_names != first.field_names:
                    raise ValueError(
                        f"BatchMeta.concat: field_names mismatch at chunk[{i}]: expected "
                        f"{first.field_names}, got {d.field_names}")
                for f in first.field_names:
                    if d.field_schema[f].get("dtype") != first.field_schema[f].get("dtype"):
                        raise ValueError(
                            f"Field '{f}' dtype mismatch in concat: chunk[0]="
                            f"{first.field_schema[f].get('dtype')}, chunk[{i}]="
                            f"{d.field_schema[f].get('dtype')}")
        schema = {}
        for f, meta in first.field_schema.items():
            metas = [d.field_schema.get(f, {}) for d in data]
            nested = any(m.get("is_nested", False) for m in metas)
            merged = {"dtype": meta.get("dtype"), "shape": None if nested else meta.get("shape"),
                      "is_nested": nested, "is_non_tensor": meta.get("is_non_tensor", False)}
            if nested or any(m.get("per_sample_shapes") for m in metas):
                merged["per_sample_shapes"] = [
                    s for d, m in zip(data, metas)
                    for s in (m.get("per_sample_shapes") or [m.get("shape")] * d.size)]
            schema[f] = merged
        extra: dict = {}
        if any(set(d.extra_info) != set(first.extra_info) for d in data[1:]):
            log.warning("BatchMeta.concat: extra_info key sets differ; taking their union")
        for d in data:
            for k, v in d.extra_info.items():
                if k in extra and not _same(extra[k], v):
                    raise ValueError(f"BatchMeta.concat: extra_info key '{k}' has conflicting "
                                     f"values across chunks and cannot be merged")
                extra.setdefault(k, v)
        keys = None if any(d._keys is None for d in data) else [k for d in data for k in d._keys]
        return cls([i for d in data for i in d.global_indexes],
                   [p for d in data for p in d.partition_ids], schema,
                   np.concatenate([d.production_status for d in data]), extra,
                   [m for d in data for m in d.custom_meta],
                   [m for d in data for m in d._custom_backend_meta], keys=keys)

    def reorder(self, indices: list[int]) -> None:
        """Put the samples in the order ``indices`` gives, in place."""
        if len(indices) != self.size:
            raise ValueError(f"Indices length {len(indices)} mismatch batch size {self.size}")
        if len(set(indices)) != self.size:
            raise ValueError("Indices contain duplicates")
        if any(i < 0 or i >= self.size for i in indices):
            raise ValueError(f"Reorder indices must be in range [0, {self.size})")
        order = list(indices)
        self.global_indexes = [self.global_indexes[i] for i in order]
        self.partition_ids = [self.partition_ids[i] for i in order]
        self.production_status = self.production_status[order]
        for meta in self.field_schema.values():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in order]
        self.custom_meta = [self.custom_meta[i] for i in order]
        self._custom_backend_meta = [self._custom_backend_meta[i] for i in order]
        if self._keys is not None:
            self._keys = [self._keys[i] for i in order]

    @classmethod
    def empty(cls, extra_info: dict | None = None) -> "BatchMeta":
        return cls([], [], {}, None, extra_info or {}, [], [])

    def __str__(self) -> str:
        return (f"BatchMeta(size={self.size}, field_names={self.field_names}, "
                f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
                f"extra_info={self.extra_info})")

    __repr__ = __str__
