"""The rule by which a unit's rows change, shared by the live rows, a replayed row log and a
checkpoint loaded from row logs: a row is merged into a row of its generation, replaces a
row of an older one, and is refused where the index holds a newer one."""
from __future__ import annotations

from ..wire.values import RawTensor, row_nbytes, value_nbytes

# a replayed file's buffer stays while its live values fill at least this share of it
MIN_LIVE_SHARE = 0.9  # the unit-memory rule: at most 1.1x the live bytes


def store_into(rows: dict[int, dict], gens: dict[int, int], idx: int, gen: int,
               values: dict) -> tuple[int, int] | None:
    """Store ``values`` at ``idx`` as generation ``gen`` in ``rows``/``gens``: merged into
    a row of that generation (copy-on-write: snapshots of the old row stay intact),
    replacing a row of an older one (another key left it). None, and nothing stored, where
    the row is newer; else ``(bytes of values, bytes of the values replaced)``."""
    held = gens.get(idx)
    if held is not None and held > gen:
        return None
    nbytes, freed = row_nbytes(values), 0
    old = rows.get(idx)
    if held != gen or old is None:
        if old:
            freed = row_nbytes(old)
        rows[idx] = values
        gens[idx] = gen
    else:
        row = dict(old)
        for f in values:
            if f in old:
                freed += value_nbytes(old[f])
        row.update(values)
        rows[idx] = row
    return nbytes, freed


def drop_from(rows: dict[int, dict], gens: dict[int, int], idx: int,
              gen: int) -> int | None:
    """Forget the row at ``idx`` if it holds generation ``gen``: the bytes it held; None
    if it holds another (or none)."""
    if gens.get(idx) != gen:
        return None
    del gens[idx]
    return row_nbytes(rows.pop(idx))


def own_sparse_views(rows: dict[int, dict],
                     min_share: float = MIN_LIVE_SHARE) -> tuple[int, int]:
    """Replayed rows' tensor values are views of their log file's buffer, which stays in
    memory as long as one of them lives. Where the live values fill less than
    ``min_share`` of a buffer (the rest: rows dropped or replaced later in the log, or
    since), copy them out so the buffer goes; a unit then holds little more than its live
    bytes. A value is replaced by an equal copy in its row (a reader holding the row reads
    the same bytes either way). Returns ``(bytes copied, buffers still shared)``."""
    buffers: dict[int, list] = {}   # id(buffer) -> [its size, live bytes, (row, field)s]
    for row in rows.values():
        for field, value in row.items():
            if type(value) is RawTensor and type(value.data) is memoryview:
                base = value.data.obj
                entry = buffers.get(id(base))
                if entry is None:
                    entry = buffers[id(base)] = [len(base), 0, []]
                entry[1] += value.data.nbytes
                entry[2].append((row, field))
    copied = kept = 0
    for size, live, places in buffers.values():
        if live >= min_share * size:
            if len(places) > 1 or live < size:  # a value that is its whole buffer is no share
                kept += 1
            continue
        for row, field in places:
            row[field] = row[field].compact()
        copied += live
    return copied, kept


class SharedViews:
    """A unit's watch over its rows while some are views of a buffer they share (a batch's
    read region, a replayed row log file): once the values dropped or replaced since the
    last look add up to a tenth of the bytes held then, look again (:func:`own_sparse_views`),
    so a buffer that drops left mostly dead goes. ``checked_at``: the bytes held at the
    last look, None while no buffer is shared."""

    def __init__(self, rows):
        self._rows = rows  # () -> the unit's rows dict (a checkpoint switch replaces it)
        self.checked_at: int | None = None
        self.freed = 0

    def watch(self, held: int) -> None:
        """Rows now share buffers: start watching (if not already)."""
        if self.checked_at is None:
            self.checked_at, self.freed = max(held, 1), 0

    def look(self, held: int) -> int:
        """Copy live values out of mostly dead buffers now; the bytes copied."""
        copied, shared = own_sparse_views(self._rows())
        self.checked_at, self.freed = (held if shared else None), 0
        return copied

    def went(self, nbytes: int, held: int) -> None:
        """``nbytes`` of values were dropped or replaced; ``held``: the bytes held now."""
        if self.checked_at is not None and nbytes:
            self.freed += nbytes
            if self.freed >= 0.1 * self.checked_at:
                self.look(held)

    def stop(self) -> None:
        """No row is left."""
        self.checked_at = None
