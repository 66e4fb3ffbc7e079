"""The typed plans of a restore, shared by client, controller and unit (torch-free).

A restore moves rows of a dump into the running system (docs/data_dump.md, "Restore"):

* :class:`RestoreRow` -- one key of the controller's plan (BEGIN_RESTORE): where its row goes
  (``index``, with the ``gen`` the row will hold there), whether the key is new, and where its
  record is in the dump (``src``, the row's global index in the dump, and ``src_gen``).
* :class:`LoadItem` -- one record a unit reads and stages (LOAD_ROWS), with the record's
  location in its shard and the key and generation the record must name.
* :class:`RedoItem` -- one row a unit re-reads from the dump after the commit decision
  (REDO_RESTORE), located through the dump's own index.

On the wire and in the journal each is a short msgpack array (``to_wire`` / ``from_wire``):
one restore carries them per row, so a map per row would cost the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass


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
