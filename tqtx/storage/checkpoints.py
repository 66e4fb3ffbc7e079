"""A unit's side of a whole-system checkpoint, top to bottom (the client's side is
:mod:`tqtx.dump.checkpoint`, the controller's decision ``checkpoint_load`` in
:mod:`tqtx.controller.kv`).

Saving is one step: SAVE_CHECKPOINT (:meth:`UnitCheckpoints.save`) writes the rows the
checkpoint's metadata names to this unit's file, each only if it still holds the generation
named.

Loading is a two-phase switch, each load moving through :data:`tqtx.states.UNIT_CHECKPOINT`
(``reading -> staged -> applied``; ``failed`` if the file cannot be read, ``dropped`` if
abandoned or pushed out by newer staged loads):

1. LOAD_CHECKPOINT (:meth:`UnitCheckpoints.load`): read this unit's file in a worker thread
   and stage its rows, invisible (every unit must have read its file before any switches).
2. APPLY_CHECKPOINT (:meth:`UnitCheckpoints.apply`): after the controller journaled the
   checkpoint's metadata (the decision), switch to the staged rows: the row at index ``i``
   takes generation ``gen_base + i``, as on the controller. Idempotent for the load last
   applied; a controller restarted in between rolls the switch forward as the units
   re-register (:mod:`tqtx.storage.attach` applies the :class:`CheckpointSwitch` its
   REGISTER_UNIT reply names).
3. DROP_CHECKPOINT (:meth:`UnitCheckpoints.drop`): an abandoned load's staged rows go.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .. import format as fmt
from .. import states as st
from ..errors import CheckpointBusyError, DumpFormatError
from ..layout import fsutil
from ..wire.codec import packb
from ..wire.columns import unpack_int64
from ..wire.values import row_nbytes
from .logdir import read_rows
from .rows import own_sparse_views

# Staged loads kept at once: concurrent load_checkpoint calls each stage their own (the
# controller then switches the units to one after the other). Each holds a copy of the
# rows, so the count is bounded: a further load is refused (it changed nothing; the caller
# tries again) while the staged ones are younger than STALE_AFTER, because dropping one
# its caller is about to switch to would leave the controller's decision without rows. A
# load staged longer ago was left by a client that died between staging and switching,
# and makes room.
STAGED_LOADS = 2
STALE_AFTER = 60.0

BATCH = 128  # records per read batch

log = logging.getLogger("tqtx.unit")


@dataclass(frozen=True)
class SaveRequest:
    """SAVE_CHECKPOINT: write to ``path`` the rows at ``indexes``, each of the generation
    ``gens`` names, with its key and its partition (``partitions[part_of[i]]``), and their
    index (records ``[index, offset, length, crc]``) to ``index_path``; a unit with a row
    log links the log's files into ``log_dir`` instead."""

    path: str
    indexes: array
    gens: array
    keys: list[str]
    part_of: array
    partitions: list[str]
    index_path: str
    log_dir: str | None = None  # a unit with a row log links its files here instead

    @classmethod
    def from_wire(cls, body: dict) -> "SaveRequest":
        req = cls(body["path"], unpack_int64(body["indexes"]), unpack_int64(body["gens"]),
                  body["keys"], unpack_int64(body["part_of"]), body["partitions"],
                  body["index_path"], body.get("log_dir"))
        if not len(req.indexes) == len(req.gens) == len(req.keys) == len(req.part_of):
            raise ValueError(f"SAVE_CHECKPOINT: {len(req.indexes)} indexes, {len(req.gens)} "
                             f"generations, {len(req.keys)} keys, {len(req.part_of)} "
                             f"partitions")
        return req


@dataclass(frozen=True)
class LoadRequest:
    """LOAD_CHECKPOINT: stage as load ``load_id`` the records ``entries`` (``[index, offset,
    length, crc]``) of this unit's checkpoint file ``path`` (each checked against its CRC
    and, with ``expect``, against the partition, key and generation the metadata gives it),
    or the rows a checkpoint saved as row log files (``log_files``, replayed in order, every
    entry checked) holds at ``keep_indexes`` of the generations ``keep_gens``."""

    load_id: str
    path: str | None
    entries: list
    log_files: list[str] | None = None  # or: replay these row log files ...
    keep_indexes: array | None = None   # ... and keep the rows at these indexes,
    keep_gens: array | None = None      # each of the generation named here
    expect: dict | None = None          # {index: (partition, key, generation)} per record

    @classmethod
    def from_wire(cls, body: dict) -> "LoadRequest":
        if body.get("log_files") is not None:
            return cls(body["load_id"], None, [], list(body["log_files"]),
                       unpack_int64(body["keep_indexes"]), unpack_int64(body["keep_gens"]))
        expect = body.get("expect")
        if expect is not None:
            expect = {e[0]: tuple(x) for e, x in zip(body["entries"], expect)}
        return cls(body["load_id"], body["path"], body["entries"], expect=expect)


@dataclass(frozen=True)
class CheckpointSwitch:
    """APPLY_CHECKPOINT (or a REGISTER_UNIT reply's roll-forward): switch to staged load
    ``load_id``; the row at index ``i`` takes generation ``gen_base + i``."""

    load_id: str
    gen_base: int

    @classmethod
    def from_wire(cls, body: dict) -> "CheckpointSwitch":
        return cls(body["load_id"], int(body["gen_base"]))


@dataclass
class StagedLoad:
    """One checkpoint load on this unit: its rows by index and their value bytes, and where
    it is in :data:`tqtx.states.UNIT_CHECKPOINT`."""

    load_id: str
    rows: dict[int, dict] = field(default_factory=dict)
    nbytes: int = 0
    shared: bool = False  # some rows are views of a buffer they share (regions, log files)
    state: str = st.READING
    staged_at: float = 0.0  # time.monotonic() when staged

    def move(self, to: str) -> None:
        st.check(st.UNIT_CHECKPOINT, self.state, to, subject=f"checkpoint load {self.load_id}")
        self.state = to


class UnitCheckpoints:
    """The checkpoint handlers of :class:`~tqtx.storage.unit.StorageUnit` ``unit``:
    ``staged`` maps the ID of each staged load (oldest first) to its :class:`StagedLoad`,
    ``applied`` is the load ID it switched to last."""

    def __init__(self, unit):
        self.unit = unit
        self.staged: OrderedDict[str, StagedLoad] = OrderedDict()
        self.applied: str | None = None
        self.failed: str | None = None  # the load a roll-forward could not read again
        self._lock = threading.Lock()  # staging runs in I/O threads, switching in the loop

    # ---------------------------------------------------------------- save
    def save(self, body, req):
        """Write the rows the checkpoint's metadata names (:class:`SaveRequest`), each only
        if it holds that generation: the others (cleared since the controller's snapshot)
        come back as ``missing`` and the client leaves their keys out of the checkpoint."""
        unit = self.unit
        save = SaveRequest.from_wire(body)
        if unit.rowlog is not None and save.log_dir is not None:
            return self._save_log(save, req)
        rows, gens, partitions = unit.rows, unit.gens, save.partitions
        records, missing = [], []  # records: the format's (index, row, gen, partition, key)
        for idx, gen, key, p in zip(save.indexes, save.gens, save.keys, save.part_of):
            if gens.get(idx) == gen:
                records.append((idx, rows[idx], gen, partitions[p], key))
            else:
                missing.append(idx)
        deferred = unit.server.deferred(req, unit.server.current_ident)

        def work():
            try:
                writer = fmt.ShardWriter(save.path)
                writer.write_rows(records)
                entries = writer.close(fsync=True)
                # the index beside the rows, in parallel with the other units
                data = packb(entries)
                fsutil.write_file_synced(save.index_path, data, exclusive=True)
                deferred.reply({"bytes": writer.bytes_written, "rows": len(entries),
                                "missing": missing,
                                "index": {"size": len(data), "crc32": fmt.checksum(data)}})
            except BaseException as exc:
                deferred.reply(error=exc)

        unit.pool.submit(work)
        return deferred

    def _save_log(self, save: SaveRequest, req):
        """A unit with a row log saves by linking the log's files: a cut is queued where
        the rows stand now (the rows it names that no longer hold their generation come
        back as ``missing``), then the files holding everything before it are hard-linked
        into ``log_dir`` (no row is read or written again)."""
        unit = self.unit
        gens = unit.gens
        missing = [idx for idx, gen in zip(save.indexes, save.gens) if gens.get(idx) != gen]
        cut = unit.rowlog.cut()
        deferred = unit.server.deferred(req, unit.server.current_ident)

        def work():
            try:
                files = unit.rowlog.link(cut, save.log_dir)
                deferred.reply({"log": files, "bytes": sum(f["size"] for f in files),
                                "rows": len(save.indexes) - len(missing), "missing": missing})
            except BaseException as exc:
                deferred.reply(error=exc)

        unit.pool.submit(work)
        return deferred

    # ---------------------------------------------------------------- 1. read and stage
    def load(self, body, req):
        """Read this unit's checkpoint file in a worker thread and stage its rows."""
        unit = self.unit
        request = LoadRequest.from_wire(body)
        deferred = unit.server.deferred(req, unit.server.current_ident)

        def work():
            try:
                deferred.reply({"rows": len(self._read_and_stage(request).rows)})
            except BaseException as exc:
                deferred.reply(error=exc)

        unit.pool.submit(work)
        return deferred

    def stage_again(self, body: dict) -> bool:
        """A roll-forward of a decided load this unit holds neither staged nor applied (it
        restarted): read and stage it now, by the decision's plan (``body``, its
        LOAD_CHECKPOINT body; the registering thread waits). False, and the load noted
        ``failed`` (the controller then names its rows lost), if that read fails."""
        request = LoadRequest.from_wire(body)
        t0 = time.monotonic()
        try:
            load = self._read_and_stage(request)
        except Exception as exc:  # noqa: BLE001 - named in the log, reported as failed
            log.error("unit %d: checkpoint load %s cannot be read again: %s",
                      self.unit.unit_id, request.load_id, exc)
            self.failed = request.load_id
            return False
        log.info("unit %d: read checkpoint load %s again (%d rows) in %.3fs",
                 self.unit.unit_id, request.load_id, len(load.rows), time.monotonic() - t0)
        return True

    def _read_and_stage(self, request: LoadRequest) -> StagedLoad:
        """Read the rows ``request`` names and stage them (a failed read moves the load to
        ``failed``)."""
        load = StagedLoad(request.load_id)
        try:
            _read(request, load)
        except BaseException:
            load.move(st.FAILED)
            raise
        self._stage(load)
        return load

    def _stage(self, load: StagedLoad) -> None:
        """Keep ``load`` (replacing an earlier one of its ID) within :data:`STAGED_LOADS`:
        the oldest makes room if it is stale, else ``load`` is refused (see STALE_AFTER)."""
        now = time.monotonic()
        with self._lock:
            staged = self.staged
            if staged.pop(load.load_id, None) is None:
                while len(staged) >= STAGED_LOADS:
                    oldest = next(iter(staged.values()))
                    if now - oldest.staged_at < STALE_AFTER:
                        load.move(st.FAILED)
                        raise CheckpointBusyError(
                            f"unit {self.unit.unit_id} holds {len(staged)} checkpoint loads "
                            f"staged by load_checkpoint calls still in progress; nothing was "
                            f"loaded: try again once they finish")
                    staged.popitem(last=False)[1].move(st.DROPPED)
            load.move(st.STAGED)
            load.staged_at = now
            staged[load.load_id] = load

    # ---------------------------------------------------------------- 2. switch
    def apply(self, body, req):
        return self.switch(CheckpointSwitch.from_wire(body))

    def switch(self, switch: CheckpointSwitch) -> dict:
        """Make the staged load's rows the unit's rows (idempotent for the load last
        applied); every staged restore is dropped, as its rows' indexes no longer hold
        what it planned against."""
        unit = self.unit
        with self._lock:
            load = self.staged.pop(switch.load_id, None)
        if load is None:
            if self.applied == switch.load_id:
                return {"rows": len(unit.rows)}
            raise RuntimeError(f"unit {unit.unit_id} has no staged checkpoint {switch.load_id}")
        load.move(st.APPLIED)
        unit.replace_rows(load.rows, {idx: switch.gen_base + idx for idx in load.rows},
                          load.nbytes, shared=load.shared)
        self.applied = switch.load_id
        if unit.rowlog is not None:  # replayed, the unit still knows it switched
            unit.rowlog.applied_checkpoint(switch.load_id, len(load.rows))
        unit.restore.drop_all()
        return {"rows": len(load.rows)}

    # ---------------------------------------------------------------- 3. drop
    def drop(self, body, req):
        with self._lock:
            load = self.staged.pop(body["load_id"], None)
        if load is not None:
            load.move(st.DROPPED)
        return {"ok": True}


def _read(request: LoadRequest, load: StagedLoad) -> None:
    """Read the records ``request`` names (checksums verified) into ``load``."""
    if request.log_files is not None:
        _read_log(request, load)
        return
    if not request.entries:
        return
    for batch in fmt.read_records(request.path, request.entries, batch=BATCH,
                                  expect=request.expect):
        for idx, row in batch:
            load.rows[idx] = row
            load.nbytes += row_nbytes(row)
    load.shared = fmt.shares_regions(request.entries, BATCH)


def _read_log(request: LoadRequest, load: StagedLoad) -> None:
    """Replay a checkpoint's row log files and stage the rows it keeps."""
    rows, gens = read_rows(request.log_files)
    where = os.path.dirname(request.log_files[0]) if request.log_files else "checkpoint"
    for idx, gen in zip(request.keep_indexes, request.keep_gens):
        if gens.get(idx) != gen:
            raise DumpFormatError(f"{where}: the row log holds no row of generation {gen} "
                                  f"at global index {idx}")
        row = rows[idx]
        load.rows[idx] = row
        load.nbytes += row_nbytes(row)
    # the kept rows are views of the files' buffers: copy them out of mostly dead ones here,
    # in the I/O thread, rather than in the loop when the unit switches
    load.shared = own_sparse_views(load.rows)[1] > 0
