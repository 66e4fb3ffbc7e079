"""How a unit sends the rows of a GET_ROWS reply: joined frames, own frames or a file.

* Tensor columns whose rows are all under 64 KiB travel as one joined frame
  (``{"p": [dtype, shapes, bytes]}``): one copy here saves a frame, an allocation and a
  header per row at both ends.
* Larger rows, and anything that is not a tensor column of one dtype, go as a list of
  values (``{"v": [...]}``), each larger tensor as its own frame, sent without a copy.
* When the client named a reply inbox this unit can see (same host, see
  :mod:`tqtx.wire.shm`) and the reply carries at least ``shm.MIN_BYTES`` of tensor
  columns, those columns are written into one file there instead
  (``{"s": [dtype, shapes, offset]}``, the file named by the reply's ``"file"``).
"""
from __future__ import annotations

from ..wire import shm
from ..wire.values import RawTensor

# pyzmq copies a frame under 64 KiB into its message anyway; from 64 KiB on it sends the
# row's own buffer, so joining such rows would only add a copy (for 64 KiB rows the join
# was 250-340 ms of a unit's 64 MiB reply, sending them as frames 5-18 ms).
PACK_ROW_LIMIT = (1 << 16) - 1


def _tensor_column(values: list) -> str | None:
    """The dtype if every value is a RawTensor of one dtype, else None."""
    if not values or any(type(v) is not RawTensor for v in values):
        return None
    dtype = values[0].dtype
    return dtype if all(v.dtype == dtype for v in values) else None


def _bytes(v: RawTensor) -> memoryview:
    mv = memoryview(v.data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def pack_column(values: list) -> dict:
    """One reply column sent in the message (``"p"`` joined or ``"v"`` values)."""
    if len(values) > 1:
        dtype = _tensor_column(values)
        if dtype is not None and max(memoryview(v.data).nbytes for v in values) <= PACK_ROW_LIMIT:
            joined = b"".join([v.data for v in values])
            return {"p": [dtype, [v.shape for v in values],
                          RawTensor("uint8", (len(joined),), joined)]}
    return {"v": values}


def reply_columns(columns: list[list], hint, files: "shm.ReplyFiles | None") -> dict:
    """The GET_ROWS reply for ``columns`` (per field, the rows' values in request order)."""
    if hint is not None and files is not None:
        buffers, out, at = [], [], 0
        for c in columns:
            dtype = _tensor_column(c)
            if dtype is None:
                out.append(None)
                continue
            out.append({"s": [dtype, [v.shape for v in c], at]})
            for v in c:
                mv = _bytes(v)
                buffers.append(mv)
                at += mv.nbytes
        if at >= shm.MIN_BYTES and files.usable(hint):
            name = files.write(hint, buffers, at)
            if name is not None:
                return {"file": name, "file_bytes": at,
                        "columns": [pack_column(c) if o is None else o
                                    for c, o in zip(columns, out)]}
    return {"columns": [pack_column(c) for c in columns]}
