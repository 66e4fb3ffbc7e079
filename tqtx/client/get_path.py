"""The get path: LOOKUP (controller), GET_ROWS to the owning units (and, for a same-host
client, GET_INTO: the units copy straight into the result), columns in request order.

Every row is read at the generation LOOKUP named: a unit holding another generation at an
index refuses, and the get asks the controller again (:mod:`tqtx.client.fence`).
"""
from __future__ import annotations

from .. import faults, routing
from . import result_layout
from ..errors import StaleRowsError, TqtxError
from .fence import FENCE_ATTEMPTS, fence_pause, stale_keys_error
from ..wire import shm
from ..wire.columns import unpack_column
from ..wire.rpc import new_id

# Same-host gets whose rows changed between their two steps are asked again this often,
# then once more with every column in messages.
INTO_ATTEMPTS = 3


class Column(list):
    """Per-row values of one field, plus the packed buffers they view (``chunks``:
    ``[(positions, RawTensor of bytes)]`` or reply files) so a dense column can be built in
    one copy, or the ``plan`` whose buffer holds every row (a same-host get copied into
    this process; the values are None)."""

    def __init__(self, values):
        super().__init__(values)
        self.chunks: list = []
        self.plan = None


def get_rows(client, keys: list[str], pid: str, select_fields=None, *, lenient=False,
             direct=False, alloc=None):
    """(keys found, columns, schemas) in request order. ``lenient`` (TransferQueue's
    results): unknown keys, and fields not produced for every key, are left out.
    ``direct``: units on this host may hand tensor columns over outside the messages
    (see :mod:`tqtx.wire.shm`), such a column's rows are then ``None``: with ``alloc``
    (see :meth:`tqtx.client.result_layout.ColumnPlan.open`) and where the kernel allows it,
    they copy them into buffers it makes (the column's ``plan`` holds them), else they
    write reply files (its ``chunks`` hold :class:`shm.FileRows`; see
    :func:`reply_files`). For :func:`tqtx.client.tensors.tensordict_from_columns`."""
    body = {"partition_id": pid, "keys": keys, "select_fields": select_fields}
    if lenient:
        body["lenient"] = True
    what = f"looking up {len(keys)} key(s) in partition {pid!r}"
    for attempt in range(FENCE_ATTEMPTS):
        # Every row is read at the generation LOOKUP named: one that moved since (its
        # key cleared, or cleared and put again) is asked again, as if read after that.
        meta = client.call_controller("LOOKUP", body, what=what)
        faults.hit("client.get.after_lookup")
        try:
            return read_rows(client, meta, keys, direct, alloc)
        except StaleRowsError as exc:
            stale = set(exc.indexes)
            moved = [k for k, i in zip(meta.get("keys", keys), meta["indexes"])
                     if i in stale]
        if attempt + 1 < FENCE_ATTEMPTS:
            fence_pause(attempt + 1)
    raise stale_keys_error("kv_batch_get", moved, pid)

def read_rows(client, meta: dict, keys: list[str], direct: bool, alloc):
    """The unit side of :func:`get_rows` for one LOOKUP reply (or DESCRIBE's rows, for a
    client-side dump) ``meta``: ``keys``, ``fields``, ``indexes``, ``gens``, ``schemas``.
    Raises StaleRowsError if a row moved since (only once every unit answered)."""
    keys = meta.get("keys", keys)
    fields, indexes, gens = meta["fields"], meta["indexes"], meta["gens"]
    columns = {f: Column([None] * len(keys)) for f in fields}
    if not fields:
        return keys, columns, meta["schemas"]
    positions = routing.by_owner(indexes, client.num_units)
    per_unit = {u: {"indexes": [indexes[p] for p in pos], "gens": [gens[p] for p in pos],
                    "fields": fields} for u, pos in positions.items()}
    inbox = client.reply_inbox() if direct else None
    peers = [client.unit(u) for u in per_unit]
    before = sum(p.bytes_received + p.header_bytes_received for p in peers)
    for attempt in range(INTO_ATTEMPTS + 1):
        into = inbox is not None and alloc is not None and attempt < INTO_ATTEMPTS \
            and result_layout.into_usable(client)
        hint = inbox.hint_for(new_id(), into=into) if inbox is not None else None
        if hint is not None:
            for req in per_unit.values():
                req["shm"] = hint
        generation = client.unit_generation
        try:
            replies = client.fan_out("GET_ROWS", per_unit)
        except BaseException:
            if hint is not None:  # units that answered may have written their files
                inbox.discard_get(hint["get"])
            raise
        got = result_layout.get_into(client, per_unit, positions, replies, len(keys),
                                     alloc) if into else (replies, [None] * len(fields))
        if got is not None:
            replies, plans = got
            break
    client.count("gets", len(keys), sum(p.bytes_received + p.header_bytes_received
                                      for p in peers) - before)
    files = [r["file"] for r in replies.values() if "file" in r]
    opened = []
    try:
        for name in files:
            opened.append(shm.ReplyFile(inbox.open_reply(name)))
    except (OSError, ValueError) as exc:
        for f in opened:
            f.close()
        inbox.discard_get(hint["get"])  # the files not opened
        raise TqtxError(f"could not open a reply file of this get: {exc}") from exc
    # A unit asked again at its new address (fan_out) may have left a file before it died;
    # otherwise every file of the get was in a reply, and is unlinked by now.
    if hint is not None and client.unit_generation != generation:
        inbox.discard_get(hint["get"])
    opened = dict(zip(files, opened))
    for f, plan in zip(fields, plans):
        columns[f].plan = plan
    for u, reply in replies.items():
        pos = positions[u]
        for f, col, plan in zip(fields, reply["columns"], plans):
            if "i" in col:  # the unit copied these rows into the plan's buffer
                continue
            out = columns[f]
            if "s" in col:
                dtype, shapes, offset = col["s"]
                out.chunks.append((pos, shm.FileRows(dtype, shapes,
                                                     opened[reply["file"]], offset)))
                continue
            values = unpack_column(col)
            if plan is not None:
                plan.fill(pos, values)
                continue
            for p, v in zip(pos, values):
                out[p] = v
            if "p" in col:
                out.chunks.append((pos, col["p"][2]))
    return keys, columns, meta["schemas"]


def reply_files(columns: dict) -> list:
    """The reply files a ``direct`` get's columns read from (close them when done)."""
    found = {}
    for col in columns.values():
        for _, src in getattr(col, "chunks", ()):
            if isinstance(src, shm.FileRows):
                found[id(src.file)] = src.file
    return list(found.values())
