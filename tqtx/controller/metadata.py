"""The controller's in-memory metadata: partitions, keys, global indexes, fields, schemas, tags."""
from __future__ import annotations

import heapq

from ..errors import KeysNotFoundError, SchemaConflictError


def check_schema_compatible(field: str, old: dict, new: dict) -> None:
    """Raise SchemaConflictError (a ValueError and a RuntimeError) if ``new`` rows of
    ``field`` cannot join rows described by ``old``."""
    if old["kind"] != new["kind"]:
        raise SchemaConflictError(
            f"field {field!r}: dtype mismatch: it holds {old['kind']} values; cannot store "
            f"{new['kind']} values in it")
    if old["kind"] == "tensor":
        if old["dtype"] != new["dtype"]:
            raise SchemaConflictError(
                f"field {field!r}: dtype mismatch: it has dtype {old['dtype']}; got "
                f"{new['dtype']} (a field's dtype cannot change)")
        if old.get("ndim") != new.get("ndim"):
            raise SchemaConflictError(
                f"field {field!r}: schema conflict: it has {old.get('ndim')}-d rows; got "
                f"{new.get('ndim')}-d rows")


def merge_schema(old: dict | None, new: dict) -> dict:
    """The schema describing rows of both ``old`` and ``new``."""
    if old is None:
        return dict(new)
    if old["kind"] != "tensor":
        return old
    if old.get("shape") is not None and old.get("shape") == new.get("shape"):
        return old
    return {**old, "shape": None, "jagged": True}


class Partition:
    __slots__ = ("pid", "keys", "fields", "tags", "schema")

    def __init__(self, pid: str):
        self.pid = pid
        self.keys: dict[str, int] = {}
        self.fields: dict[int, set[str]] = {}
        self.tags: dict[str, dict] = {}
        self.schema: dict[str, dict] = {}

    def indexes_of(self, keys: list[str]) -> list[int]:
        try:
            return [self.keys[k] for k in keys]
        except KeyError:
            missing = [k for k in keys if k not in self.keys]
            raise KeysNotFoundError(missing, self.pid) from None


class Metadata:
    """All partitions plus the global index namespace (shared, freed indexes reused)."""

    def __init__(self):
        self.partitions: dict[str, Partition] = {}
        self.next_index = 0
        self.free: list[int] = []          # min-heap of freed indexes
        self.reserved: dict[int, str] = {}  # index -> restore_id holding it

    def partition(self, pid: str, *, create: bool = False) -> Partition | None:
        part = self.partitions.get(pid)
        if part is None and create:
            part = self.partitions[pid] = Partition(pid)
        return part

    def require(self, pid: str) -> Partition:
        part = self.partitions.get(pid)
        if part is None:
            raise KeyError(f"partition {pid!r} not found")
        return part

    def allocate(self, n: int) -> list[int]:
        out = []
        while self.free and len(out) < n:
            out.append(heapq.heappop(self.free))
        if len(out) < n:
            start = self.next_index
            self.next_index += n - len(out)
            out.extend(range(start, self.next_index))
        return out

    def release(self, indexes) -> None:
        for i in indexes:
            heapq.heappush(self.free, i)

    def validate_schemas(self, part: Partition | None, schemas: dict) -> None:
        if part is None:
            return
        for field, schema in schemas.items():
            old = part.schema.get(field)
            if old is not None:
                check_schema_compatible(field, old, schema)

    def clear(self, part: Partition, keys: list[str]) -> list[int]:
        freed = []
        for key in dict.fromkeys(keys):
            idx = part.keys.pop(key, None)
            if idx is None:
                continue
            part.fields.pop(idx, None)
            part.tags.pop(key, None)
            freed.append(idx)
        self.release(freed)
        if not part.keys:
            del self.partitions[part.pid]
        return freed

    # ---------------------------------------------------------------- checkpoint
    def snapshot(self) -> dict:
        return {
            "next_index": self.next_index,
            "free": sorted(self.free),
            "partitions": {
                pid: {"schema": p.schema,
                      "rows": [[k, i, sorted(p.fields.get(i, ())), p.tags.get(k)]
                               for k, i in p.keys.items()]}
                for pid, p in self.partitions.items()},
        }

    def replace(self, snap: dict) -> None:
        self.partitions.clear()
        self.reserved.clear()
        self.next_index = int(snap["next_index"])
        self.free = list(snap["free"])
        heapq.heapify(self.free)
        for pid, data in snap["partitions"].items():
            part = self.partition(pid, create=True)
            part.schema = dict(data["schema"])
            for key, idx, fields, tag in data["rows"]:
                part.keys[key] = idx
                part.fields[idx] = set(fields)
                if tag is not None:
                    part.tags[key] = tag
