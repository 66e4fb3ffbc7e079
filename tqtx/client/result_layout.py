"""Where each row of a same-host get goes in the client's result memory (torch-free).

The units' ``GET_ROWS`` replies give every row's shape (a layout, or the rows themselves);
:func:`plan` lays a tensor column's rows out back to back in request order, as a dense
``(n, *shape)`` tensor or as the values buffer of a jagged nested tensor, in one fresh
buffer of exactly that size (made by the caller's ``alloc``). The units then copy their
rows to the planned offsets (``GET_INTO``); rows that came in a message are copied in by
:meth:`ColumnPlan.fill`. See :mod:`tqtx.wire.shm`.
"""
from __future__ import annotations

import logging
from math import prod

import numpy as np

from ..errors import StaleRowsError
from ..wire import vmcopy
from ..wire.columns import NUMPY_DTYPE, unpack_column
from ..wire.values import DTYPE_SIZES, RawTensor

log = logging.getLogger("tqtx.client")


class ColumnPlan:
    """One tensor column's place in its result buffer: per row (request order) ``starts``
    and ``nbytes``; ``shape`` for a dense column, else ``lengths`` and ``rest`` (the
    trailing dimensions every row shares) for a jagged one."""

    def __init__(self, dtype: str, table: np.ndarray):
        self.dtype = dtype
        size = DTYPE_SIZES[dtype]
        first = tuple(table[0].tolist())
        if bool((table == table[0]).all()):
            self.shape, self.lengths, self.rest = first, None, None
            rs = prod(first) * size
            self.nbytes = np.full(len(table), rs, dtype=np.int64)
        else:
            self.shape, self.lengths, self.rest = None, table[:, 0].copy(), first[1:]
            self.nbytes = self.lengths * (prod(self.rest) * size)
        self.starts = np.cumsum(self.nbytes) - self.nbytes
        self.total = int(self.nbytes.sum())
        self.memory = None  # the result buffer (see open)
        self.view = None  # a writable numpy byte view of it

    def open(self, alloc) -> None:
        """Allocate the result: ``alloc(nbytes)`` returns ``(buffer, address, writable
        byte view)``; nothing is written into it here (its pages stay untouched)."""
        self.memory, self.address, self.view = alloc(self.total)

    def target(self, positions) -> list:
        """The ``GET_INTO`` target for the rows at ``positions`` (one unit's rows)."""
        idx = np.asarray(positions, dtype=np.int64)
        return [self.address, self.total, self.starts[idx].astype(NUMPY_DTYPE).tobytes()]

    def fill(self, positions, values) -> None:
        """Copy rows that came in a message (``values``, RawTensors) to their places."""
        arr = np.asarray(self.view)
        for p, v in zip(positions, values):
            n = int(self.nbytes[p])
            if n:
                a = int(self.starts[p])
                arr[a:a + n] = np.frombuffer(v.data, dtype=np.uint8)

    def close(self) -> None:
        """Let go of the memory (a get that failed before its result was built)."""
        self.memory = self.view = None


def _tensor_rows(values, dtype):
    """The shapes of ``values`` if every one is a RawTensor of ``dtype``, else None."""
    if any(type(v) is not RawTensor or v.dtype != dtype for v in values):
        return None
    return [v.shape for v in values]


def plan(n_fields: int, n: int, positions: dict, replies: dict, unpacked: dict) -> list:
    """Per field, a :class:`ColumnPlan` (its buffer not allocated yet) or None (the column
    travels in messages). ``replies``: the units' GET_ROWS replies, some with a
    ``layout``; ``unpacked[u][j]``: the rows of unit u's in-message column j."""
    out = []
    for j in range(n_fields):
        dtype, parts = None, []
        for u, r in replies.items():
            if "layout" in r:
                lay = r["layout"][j]
                if lay is None:
                    break
                d, shapes = lay
            else:
                d = dtype or _first_dtype(unpacked[u][j])
                shapes = _tensor_rows(unpacked[u][j], d) if d else None
                if shapes is None:
                    break
            if dtype is None:
                dtype = d
            elif d != dtype:
                break
            parts.append((positions[u], shapes))
        else:
            table = shape_table(parts, n) if dtype in DTYPE_SIZES else None
            if table is not None:
                col = ColumnPlan(dtype, table)
                if col.total:
                    out.append(col)
                    continue
        out.append(None)
    return out


def _first_dtype(values):
    return values[0].dtype if values and type(values[0]) is RawTensor else None


def shape_table(parts, n: int):
    """Every row's shape as one (n, rank) int64 array in request order, from ``parts``
    (``[(positions, shapes)]``), or None if ranks differ, some row is missing or given
    twice, or the rows make neither a dense nor a jagged tensor (see :class:`ColumnPlan`)."""
    table, seen = None, np.zeros(n, dtype=np.int64)
    for pos, shapes in parts:
        if not len(pos):
            continue
        try:
            arr = np.asarray(shapes, dtype=np.int64).reshape(len(pos), -1)
        except ValueError:  # rows of different ranks
            return None
        if table is None:
            table = np.empty((n, arr.shape[1]), dtype=np.int64)
        elif arr.shape[1] != table.shape[1]:
            return None
        idx = np.asarray(pos, dtype=np.int64)
        table[idx] = arr
        seen[idx] += 1
    if table is None or not bool((seen == 1).all()):
        return None
    if table.shape[1] == 0 or bool((table == table[0]).all()):
        return table  # dense (or scalars)
    if bool((table[:, 1:] == table[0, 1:]).all()):
        return table  # jagged along the first dimension
    return None


def into_usable(client) -> bool:
    """Whether ``client``'s same-host gets may ask units to copy into this process
    (``TQTX_GET_INTO=off`` turns it off; so does a unit the kernel refused once)."""
    if client.into_off is None and not client.into_checked:
        client.into_checked = True  # once per client: a tiny get cannot afford a file read
        client.into_off = vmcopy.refusal("TQTX_GET_INTO", "writing into")
    return client.into_off is None


def get_into(client, per_unit: dict, positions: dict, replies: dict, n: int, alloc):
    """The second step of a same-host get: ``(replies, plans)`` with every unit's reply
    carrying ``columns`` (``{"i": 1}`` for a column it copied into a plan's memory) and
    per field a :class:`ColumnPlan` or None; None if some unit's rows changed in between
    (the caller asks again). ``replies``: the GET_ROWS replies; ``alloc``: see
    :meth:`ColumnPlan.open`."""
    n_fields = len(next(iter(per_unit.values()))["fields"])
    if not any("layout" in r for r in replies.values()):
        return replies, [None] * n_fields
    unpacked = {u: [unpack_column(c) for c in r["columns"]]
                for u, r in replies.items() if "layout" not in r}
    plans = plan(n_fields, n, positions, replies, unpacked)
    try:
        for p in plans:
            if p is not None:
                p.open(alloc)
        bodies = {}
        for u, r in replies.items():
            if "layout" in r:
                body = dict(per_unit[u])
                body["into"] = [None if p is None else p.target(positions[u]) for p in plans]
                body["digest"] = r["digest"]
                bodies[u] = body
        second = client.fan_out("GET_INTO", bodies)
        if any(r.get("changed") for r in second.values()):
            for p in plans:
                if p is not None:
                    p.close()
            return None
    except StaleRowsError:
        # Raised only once every unit answered (Client.fan_out): none is still copying.
        for p in plans:
            if p is not None:
                p.close()
        raise
    except BaseException:
        # A unit that timed out may still be copying: its buffers are kept, never reused.
        client.unsettled_results.extend(p.memory for p in plans
                                        if p is not None and p.memory is not None)
        raise
    failed = [r["into_failed"] for r in second.values() if "into_failed" in r]
    if failed and client.into_off is None:
        client.into_off = failed[0]
        log.warning("same-host gets go back to reply files: %s", failed[0])
    return {**replies, **second}, plans
