"""A unit's side of a whole-system checkpoint: SAVE_CHECKPOINT, LOAD_CHECKPOINT (stage),
APPLY_CHECKPOINT (switch), DROP_CHECKPOINT (see :mod:`tqtx.checkpoint`).

A checkpoint load is a two-phase switch: every unit reads and stages its file, then the
controller journals the checkpoint's metadata (the decision) and has every unit switch; a
controller restarted in between rolls the switch forward as the units re-register.
"""
from __future__ import annotations

from collections import OrderedDict

from .. import format as fmt
from ..wire.columns import unpack_int64
from ..wire.values import value_nbytes


# Staged loads kept at once: concurrent load_checkpoint calls each stage their own (the
# controller then switches the units to one after the other); a client that died between
# staging and switching leaves one behind, dropped once newer ones are staged.
STAGED_LOADS = 2


class UnitCheckpoints:
    """The checkpoint handlers of :class:`~tqtx.storage.unit.StorageUnit` ``unit``:
    ``staged`` maps the ID of each staged load to ``(rows, bytes)``, ``applied`` is the
    load ID it switched to last."""

    def __init__(self, unit):
        self.unit = unit
        self.staged: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self.applied: str | None = None

    def save(self, body, req):
        """Write the rows the checkpoint's metadata names (``indexes``, ``gens``, ``keys``,
        and per row its partition: ``part_of`` into ``partitions``), each only if it holds
        that generation: the others (cleared since the controller's snapshot) come back as
        ``missing`` and the client leaves their keys out of the checkpoint."""
        unit = self.unit
        indexes, want = unpack_int64(body["indexes"]), unpack_int64(body["gens"])
        keys, part_of, partitions = body["keys"], unpack_int64(body["part_of"]), body["partitions"]
        if not len(indexes) == len(want) == len(keys) == len(part_of):
            raise ValueError(f"SAVE_CHECKPOINT: {len(indexes)} indexes, {len(want)} "
                             f"generations, {len(keys)} keys, {len(part_of)} partitions")
        rows, gens = unit.rows, unit.gens
        snapshot, missing = [], []
        for idx, gen, key, p in zip(indexes, want, keys, part_of):
            if gens.get(idx) == gen:
                snapshot.append((idx, rows[idx], gen, partitions[p], key))
            else:
                missing.append(idx)
        path = body["path"]
        deferred = unit.server.deferred(req, unit.server.current_ident)

        def work():
            try:
                writer = fmt.ShardWriter(path)
                writer.write_rows(snapshot)
                entries = writer.close(fsync=True)
                deferred.reply({"entries": entries, "bytes": writer.bytes_written,
                                "rows": len(entries), "missing": missing})
            except BaseException as exc:
                deferred.reply(error=exc)

        unit.pool.submit(work)
        return deferred

    def load(self, body, req):
        unit = self.unit
        path, entries = body["path"], body["entries"]
        deferred = unit.server.deferred(req, unit.server.current_ident)

        def work():
            try:
                rows = {}
                total = 0
                if entries:
                    for batch in fmt.read_records(path, entries, batch=128):
                        for idx, row in batch:
                            rows[idx] = row
                            total += _row_nbytes(row)
                # Staged only: every unit must have read its file before any unit switches.
                self._stage(body["load_id"], rows, total)
                deferred.reply({"rows": len(rows)})
            except BaseException as exc:
                deferred.reply(error=exc)

        unit.pool.submit(work)
        return deferred

    def _stage(self, load_id: str, rows: dict, total: int) -> None:
        staged = self.staged
        staged.pop(load_id, None)
        staged[load_id] = (rows, total)
        while len(staged) > STAGED_LOADS:
            staged.popitem(last=False)

    def apply(self, body, req):
        """Switch to the staged checkpoint rows (idempotent for the same load_id); the row
        at index ``i`` takes generation ``gen_base + i``, as on the controller."""
        unit = self.unit
        load_id = body["load_id"]
        staged = self.staged.pop(load_id, None)
        if staged is None:
            if self.applied == load_id:
                return {"rows": len(unit.rows)}
            raise RuntimeError(f"unit {unit.unit_id} has no staged checkpoint {load_id}")
        rows, total = staged
        base = int(body["gen_base"])
        unit.rows = rows
        unit.gens = {idx: base + idx for idx in rows}
        unit.bytes_held = total
        self.applied = load_id
        unit.restore.drop_all()
        return {"rows": len(rows)}

    def drop(self, body, req):
        self.staged.pop(body["load_id"], None)
        return {"ok": True}


def _row_nbytes(row: dict) -> int:
    return sum(value_nbytes(v) for v in row.values())
