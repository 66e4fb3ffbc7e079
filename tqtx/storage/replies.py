"""How a unit sends the rows of a get: joined frames, own frames, a file, or into the client.

* Tensor columns whose rows are all under 64 KiB travel as one joined frame
  (``{"p": [dtype, shapes, bytes]}``): one copy here saves a frame, an allocation and a
  header per row at both ends.
* Larger rows, and anything that is not a tensor column of one dtype, go as a list of
  values (``{"v": [...]}``), each larger tensor as its own frame, sent without a copy.
* When the client named a reply inbox this unit can see (same host, see
  :mod:`tqtx.wire.shm`) and this unit's rows hold at least ``shm.MIN_BYTES`` of tensor
  columns: if the hint says ``into``, ``GET_ROWS`` answers with the layout only and the
  client's ``GET_INTO`` has the tensor columns copied into its result memory
  (:func:`into_reply`; the other columns travel in that second reply, so every field of a
  row is read at the same moment); otherwise the tensor columns are written into one
  reply file there (``{"s": [dtype, shapes, offset]}``, the file named by ``"file"``).
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


def _layout(columns: list[list], count: bool = True) -> tuple[list, int, int]:
    """Per column ``[dtype, shapes]`` (None for a column that is not one dtype of tensors),
    the tensor bytes (0 unless ``count``), and a digest of the whole layout (to tell a
    changed row later)."""
    out, nbytes = [], 0
    for c in columns:
        dtype = _tensor_column(c)
        if dtype is None:
            out.append(None)
            continue
        shapes = [v.shape for v in c]
        out.append([dtype, shapes])
        if count:
            nbytes += sum(memoryview(v.data).nbytes for v in c)
    return out, nbytes, hash(tuple(None if o is None else (o[0], tuple(o[1])) for o in out))


def reply_columns(columns: list[list], hint, files: "shm.ReplyFiles | None") -> dict:
    """The GET_ROWS reply for ``columns`` (per field, the rows' values in request order):
    for a same-host client and enough tensor bytes, the layout alone (``{"layout",
    "digest"}``, if the hint says ``into``) or the tensor columns in a reply file; else
    every column in the message."""
    if hint is not None and files is not None:
        if hint.get("into"):
            layout, nbytes, digest = _layout(columns)
            if nbytes and nbytes >= shm.MIN_BYTES and files.usable(hint):
                return {"layout": layout, "digest": digest}
            return {"columns": [pack_column(c) for c in columns]}
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


def into_reply(columns: list[list], body: dict, files: "shm.ReplyFiles") -> dict:
    """The GET_INTO reply: columns with a target (``body["into"]``) copied into the
    client's result memory (``{"i": 1}``), the rest packed as for GET_ROWS. ``{"changed":
    True}`` alone if the rows' layout is no longer the one GET_ROWS reported (a put in
    between: the client asks again). A target this unit cannot write (the kernel refused:
    ptrace restrictions) gets its column in the message, and ``"into_failed"`` says why."""
    if _layout(columns, count=False)[2] != body.get("digest"):
        return {"changed": True}
    out, failed = [], None
    for c, target in zip(columns, body["into"]):
        if target is not None and failed is None:
            try:
                files.write_into(body.get("shm") or {}, target, [_bytes(v) for v in c])
                out.append({"i": 1})
                continue
            except OSError as exc:
                failed = f"unit {files.unit_id}: {exc}"
        out.append(pack_column(c))
    reply = {"columns": out}
    if failed is not None:
        reply["into_failed"] = failed
    return reply
