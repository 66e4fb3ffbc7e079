"""The typed plans of a restore, shared by client, controller and unit (torch-free).

A restore moves rows of a dump into the running system (docs/data_dump.md, "Restore"):

* :class:`BeginRow` -- one key as the client names it in BEGIN_RESTORE: its fields and tag in
  the dump and where its record is (``src``).
* :class:`RestoreRow` -- one key of the controller's plan (BEGIN_RESTORE): where its row goes
  (``index``, with the ``gen`` the row will hold there), whether the key is new, and where its
  record is in the dump (``src``, the row's global index in the dump, and ``src_gen``).
* :class:`LoadItem` -- one record a unit reads and stages (LOAD_ROWS), with the record's
  location in its shard and the key and generation the record must name.
* :class:`RedoItem` -- one row a unit re-reads from the dump after the commit decision
  (REDO_RESTORE), located through the dump's own index.
* :class:`RestorePlan` -- the controller's whole plan of one restore; stored (encoded) with
  the commit decision, so a restarted controller rolls the restore forward from it.

A checkpoint's save is planned by :func:`checkpoint_save_requests`: per unit, the rows of
the controller's metadata snapshot that unit writes (the controller sends them with the
snapshot; a load of a row-log checkpoint reads them from the checkpoint's metadata).

On the wire and in the journal each is a short msgpack array (``to_wire`` / ``from_wire``):
one restore carries them per row, so a map per row would cost the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .routing import owner
from .wire import codec
from .wire.columns import pack_int64


@dataclass(slots=True)
class BeginRow:
    """One key of a BEGIN_RESTORE request, as the client read it from the dump's index."""

    key: str
    fields: list          # the fields the dump holds for it
    tag: dict | None
    src: int | None       # the row's global index in the dump (None: not sent)

    def to_wire(self) -> list:
        return [self.key, self.fields, self.tag, self.src]

    @classmethod
    def from_wire(cls, row: list) -> "BeginRow":
        # a client may send three elements: without src, the dump cannot be re-read
        src = row[3] if len(row) > 3 else None
        return cls(row[0], row[1], row[2], None if src is None else int(src))


@dataclass(slots=True)
class RestoreRow:
    """One key of a restore's plan."""

    key: str
    index: int            # the key's global index in this deployment (new or existing)
    fields: list          # the fields the dump holds for it
    tag: dict | None
    is_new: bool          # the key did not exist: its index is reserved until the commit
    gen: int              # the generation the row holds at ``index`` (see tqtx.controller.metadata)
    src: int | None       # the row's global index in the dump (None: a client that sent none)

    def to_wire(self) -> list:
        return [self.key, self.index, self.fields, self.tag, self.is_new, self.gen, self.src]

    @classmethod
    def from_wire(cls, row: list) -> "RestoreRow":
        return cls(*row)


@dataclass(slots=True)
class LoadItem:
    """One record a unit reads from a shard and stages at ``dest`` (LOAD_ROWS)."""

    dest: int             # global index the row goes to
    gen: int              # the generation it holds there
    path: str             # the shard file
    offset: int
    length: int
    crc: int              # CRC-32C of the record
    src: int              # the record's global index in the dump
    key: str              # the key the record must name (format version 2 records)
    src_gen: int | None   # the generation the record must name (None: not checked)

    def to_wire(self) -> list:
        return [self.dest, self.gen, self.path, self.offset, self.length, self.crc, self.src,
                self.key, self.src_gen]

    @classmethod
    def from_wire(cls, item: list) -> "LoadItem":
        if len(item) != 9:
            raise ValueError(f"malformed LOAD_ROWS item of {len(item)} elements")
        return cls(*item)


@dataclass(slots=True)
class RedoItem:
    """One row a unit re-reads from the dump at roll-forward (REDO_RESTORE)."""

    dest: int
    gen: int
    src: int

    def to_wire(self) -> list:
        return [self.dest, self.gen, self.src]

    @classmethod
    def from_wire(cls, item: list) -> "RedoItem":
        return cls(*item)


@dataclass
class RestorePlan:
    """The controller's plan of one unresolved restore (its state is in the journal).

    The fields up to ``dump_id`` never change after BEGIN_RESTORE and are what
    :meth:`encode` stores with the commit decision; the others are the roll-forward's
    memory of each unit (see :meth:`tqtx.controller.restores.RestoreCoordinator._apply_everywhere`).
    """

    restore_id: str
    partition_id: str
    dump_dir: str
    rows: list[RestoreRow]
    field_schema: dict[str, dict]
    units: list[int]              # the units that stage rows (sorted)
    new_indexes: list[int]        # reserved for the new keys until the commit or the end
    dump_id: str | None = None
    apply_rids: dict[int, str] = field(default_factory=dict, compare=False)
    roll: dict[int, str] = field(default_factory=dict, compare=False)  # st.ROLL_FORWARD state
    redo_failed: dict[int, str] = field(default_factory=dict, compare=False)  # why not
    last_error: dict[int, BaseException] = field(default_factory=dict, compare=False)
    _packed: bytes | None = field(default=None, repr=False, compare=False)

    # the stored map's keys, in its order (the bytes in existing journals)
    _STORED = ("restore_id", "partition_id", "dump_dir", "field_schema", "units",
               "new_indexes", "dump_id")

    def encode(self) -> bytes:
        """The plan as stored with the commit decision (a msgpack map; encoded once)."""
        if self._packed is None:
            d = {name: getattr(self, name) for name in self._STORED}
            d["rows"] = [r.to_wire() for r in self.rows]
            self._packed = codec.packb(d)
        return self._packed

    @classmethod
    def decode(cls, data: bytes) -> "RestorePlan":
        d = codec.unpackb(data)
        return cls(d["restore_id"], d["partition_id"], d["dump_dir"],
                   [RestoreRow.from_wire(r) for r in d["rows"]], d["field_schema"], d["units"],
                   d["new_indexes"], d["dump_id"])

    def redo_items(self, uid: int, num_units: int) -> list[RedoItem] | None:
        """The rows unit ``uid`` re-reads at roll-forward (REDO_RESTORE); None if the
        source of one is unknown."""
        items = []
        for r in self.rows:
            if r.fields and owner(r.index, num_units) == uid:
                if r.src is None:
                    return None
                items.append(RedoItem(r.index, r.gen, r.src))
        return items


def checkpoint_save_requests(meta: dict, num_units: int) -> dict[int, dict]:
    """Per unit, the SAVE_CHECKPOINT request naming the rows of ``meta`` (the controller's
    metadata snapshot) it holds: index, generation, key and partition of every row with
    fields that is not lost, as columns (``indexes``, ``gens``, ``part_of`` packed int64,
    ``keys``, ``partitions``)."""
    partitions = list(meta["partitions"])
    cols = {u: ([], [], [], []) for u in range(num_units)}
    for p, pid in enumerate(partitions):
        for key, idx, fields, _tag, lost, gen in meta["partitions"][pid]["rows"]:
            if fields and lost is None:
                c = cols[owner(idx, num_units)]
                c[0].append(idx)
                c[1].append(gen)
                c[2].append(key)
                c[3].append(p)
    return {u: {"indexes": pack_int64(c[0]), "gens": pack_int64(c[1]), "keys": c[2],
                "part_of": pack_int64(c[3]), "partitions": partitions}
            for u, c in cols.items()}
