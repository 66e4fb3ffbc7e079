"""One partition of the controller's metadata (:class:`~tqtx.controller.metadata.Metadata`
holds them): its visible and pending keys, their global indexes, fields and tags, its
field schemas and its lost rows."""
from __future__ import annotations

from ..errors import KeysNotFoundError, RowsLostError
from ..schema import merge_schema


class Partition:
    __slots__ = ("pid", "keys", "fields", "tags", "schema", "pending", "lost", "gens",
                 "journaled")

    def __init__(self, pid: str, gens: dict[int, int]):
        self.pid = pid
        self.gens = gens                      # Metadata.gens (shared): index -> generation
        self.keys: dict[str, int] = {}        # visible keys -> global index
        self.fields: dict[int, frozenset[str]] = {}  # shared objects (Metadata.share)
        self.tags: dict[str, dict] = {}
        self.schema: dict[str, dict] = {}
        self.pending: dict[str, int] = {}     # allocated by ALLOC, not yet committed
        self.lost: dict[int, int] = {}        # global index -> unit that lost the row
        # field -> the schema object the journal holds for it: a commit writes only the
        # schemas that differ (schema dicts are replaced when they change, never edited)
        self.journaled: dict[str, dict] = {}

    def indexes_of(self, keys: list[str]) -> list[int]:
        try:
            return list(map(self.keys.__getitem__, keys))
        except KeyError:
            missing = [k for k in keys if k not in self.keys]
            raise KeysNotFoundError(missing, self.pid) from None

    def check_readable(self, keys: list[str], indexes: list[int]) -> None:
        """RowsLostError naming the keys among ``keys`` whose rows were lost."""
        if not self.lost:
            return
        lost = self.lost
        gone = [(k, i) for k, i in zip(keys, indexes) if i in lost]
        if gone:
            raise RowsLostError([k for k, _ in gone], self.pid,
                                fields={k: sorted(self.fields.get(i, ())) for k, i in gone},
                                units={k: lost[i] for k, i in gone})

    def row(self, key: str, lost=None) -> tuple:
        """The journal row of visible ``key``."""
        idx = self.keys[key]
        return (self.pid, key, idx, self.fields.get(idx, ()), self.tags.get(key),
                self.lost.get(idx) if lost is None else lost, self.gens[idx])

    def merge_schemas(self, schemas: dict) -> None:
        """Register a put's field schemas (checked compatible before) with those held."""
        for field, schema in schemas.items():
            self.schema[field] = merge_schema(self.schema.get(field), schema)

    def gens_of(self, indexes) -> list[int]:
        """The generations of ``indexes`` (allocated ones), in order."""
        return list(map(self.gens.__getitem__, indexes))
