"""The rule by which a unit's rows change, shared by the live rows, a replayed row log and a
checkpoint loaded from row logs: a row is merged into a row of its generation, replaces a
row of an older one, and is refused where the index holds a newer one."""
from __future__ import annotations

from ..wire.values import row_nbytes, value_nbytes


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
