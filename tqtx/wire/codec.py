"""Message codec: a msgpack header frame followed by raw tensor frames.

A message is any msgpack-able object in which :class:`RawTensor` values may appear
anywhere. Each tensor larger than ``INLINE_LIMIT`` bytes travels as its own frame
(sent without copying); smaller ones are inlined in the header. A :class:`TensorColumn`
(the rows of one field) carries its rows' headers once, as columns, and decodes to the list
of its rows. No pickle, ever: an unknown msgpack extension type is refused.
"""
from __future__ import annotations

import gc
from math import prod

import msgpack

from .values import DTYPE_SIZES, RawTensor, TensorColumn

EXT_TENSOR_FRAME = 1   # payload: [dtype, shape, frame_number]
EXT_TENSOR_INLINE = 2  # payload: [dtype, shape, bytes]
# payload: [dtype, [shape of each row], [frame number of each row, or 0: in the blob], blob]
# (the inline rows' bytes joined, in row order)
EXT_TENSOR_COLUMN = 3
# libzmq (4.3) receives into shared buffers of ZMQ_IN_BATCH_SIZE and hands out a frame that
# fits one as a view into it: a receiver keeping such a frame keeps the whole buffer, and
# the freed buffers leave holes between the frames it keeps (a unit's RSS:
# docs/performance.md, *Unit memory*).
ZMQ_RECV_BATCH = 8192
# Tensors up to that size travel in the header, so every frame a unit stores is an
# allocation of its own.
INLINE_LIMIT = ZMQ_RECV_BATCH
MAX_HEADER_BYTES = 1 << 30
GC_PAUSE_BYTES = 1 << 18
# The first buffer of a Packer for an extension's payload (it grows as needed).
_EXT_BUFFER = 4096


def _ext_packer():
    """A Packer's ``pack`` for extension payloads, made while the message's own Packer is
    alive. A Packer starts with a 1 MiB buffer unless told otherwise, and two such buffers
    freed together would leave glibc's heap top past its trim threshold: every message would
    cost three brk calls and the page faults of touching the buffer again (~28 us)."""
    return msgpack.Packer(use_bin_type=True, buf_size=_EXT_BUFFER).pack


class CodecError(ValueError):
    """A message that cannot be decoded (malformed, truncated or hostile)."""


def encode(obj) -> list:
    """Encode ``obj`` into ``[header, *frames]``; frames are the tensors' own buffers."""
    frames: list = []
    pack = _ext_packer()  # one per message: packb makes one per call
    ext = msgpack.ExtType

    def default(value):
        if isinstance(value, RawTensor):
            view = memoryview(value.data)
            if view.nbytes <= INLINE_LIMIT:
                return ext(EXT_TENSOR_INLINE, pack([value.dtype, value.shape, view]))
            frames.append(view)
            return ext(EXT_TENSOR_FRAME, pack([value.dtype, value.shape, len(frames)]))
        if isinstance(value, TensorColumn):
            return ext(EXT_TENSOR_COLUMN, pack(_column_payload(value, frames)))
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        raise TypeError(f"cannot encode value of type {type(value).__name__}")

    header = msgpack.packb(obj, default=default, use_bin_type=True)
    return [header, *frames]


def _column_payload(column: TensorColumn, frames: list) -> list:
    """EXT_TENSOR_COLUMN's payload; rows over INLINE_LIMIT bytes appended to ``frames``."""
    shapes, where, small = [], [], []
    for t in column.rows:
        view = t.data if type(t.data) is memoryview else memoryview(t.data)
        shapes.append(t.shape)
        if view.nbytes <= INLINE_LIMIT:
            where.append(0)
            small.append(view)
        else:
            frames.append(view)
            where.append(len(frames))
    return [column.dtype, shapes, where, b"".join(small)]


def _decode_column(payload, buffers: list) -> list:
    """The rows of an EXT_TENSOR_COLUMN, checked: every row's bytes match its shape; blob
    rows are copies of their own (a stored row pins no shared buffer), frame rows views."""
    try:
        dtype, shapes, where, blob = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise CodecError(f"malformed tensor column: {exc}") from None
    size = DTYPE_SIZES.get(dtype) if isinstance(dtype, str) else None
    if size is None:
        raise CodecError(f"tensor column of unknown dtype {dtype!r}")
    if (not isinstance(shapes, list) or not isinstance(where, list)
            or len(shapes) != len(where) or not isinstance(blob, bytes)):
        raise CodecError("malformed tensor column header")
    out, at, new, nframes = [], 0, RawTensor.of, len(buffers)
    for shape, ref in zip(shapes, where):
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise CodecError(f"tensor column: malformed shape {shape!r}")
        shape = tuple(shape)
        n = prod(shape) * size
        if ref == 0:
            if at + n > len(blob):
                raise CodecError("tensor column: its rows need more bytes than it has")
            out.append(new(dtype, shape, blob[at:at + n]))
            at += n
        elif _is_int(ref) and 1 <= ref < nframes and buffers[ref].nbytes == n:
            out.append(new(dtype, shape, buffers[ref]))
        else:
            raise CodecError(f"tensor column: row refers to frame {ref!r}, missing or not "
                             f"of its {n} bytes")
    if at != len(blob):
        raise CodecError(f"tensor column: {len(blob) - at} bytes left over")
    return out


def decode(frames: list):
    """Decode ``[header, *frames]`` produced by :func:`encode`.

    Tensor data refers to the received frame buffers (no copy). Raises CodecError
    on anything malformed, including tensor headers that do not match their bytes.
    """
    if not frames:
        raise CodecError("empty message")
    buffers = [memoryview(f) for f in frames]

    def ext_hook(code, data):
        if code == EXT_TENSOR_COLUMN:
            return _decode_column(data, buffers)
        if code not in (EXT_TENSOR_FRAME, EXT_TENSOR_INLINE):
            raise CodecError(f"unknown extension type {code}")
        try:
            dtype, shape, ref = msgpack.unpackb(data, raw=False)
        except Exception as exc:
            raise CodecError(f"malformed tensor header: {exc}") from None
        if code == EXT_TENSOR_FRAME:
            if not isinstance(ref, int) or not 1 <= ref < len(buffers):
                raise CodecError(f"tensor refers to missing frame {ref!r}")
            payload = buffers[ref]
        elif code == EXT_TENSOR_INLINE:
            payload = ref
        else:
            raise CodecError(f"unknown extension type {code}")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise CodecError("malformed tensor header")
        tensor = RawTensor(dtype, shape, payload)
        try:
            tensor.validate("tensor frame")
        except (ValueError, TypeError) as exc:
            raise CodecError(str(exc)) from None
        return tensor

    # Decoding a large header creates many containers at once; the cyclic GC would
    # rescan them again and again (cost growing with the batch), and they hold no cycles.
    pause_gc = buffers[0].nbytes > GC_PAUSE_BYTES and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        if buffers[0].nbytes > MAX_HEADER_BYTES:
            raise CodecError(f"header of {buffers[0].nbytes} bytes exceeds {MAX_HEADER_BYTES}")
        return msgpack.unpackb(buffers[0], ext_hook=ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage input
        raise CodecError(f"malformed message: {type(exc).__name__}: {exc}") from None
    finally:
        if pause_gc:
            gc.enable()


def _packb_default(value):
    if isinstance(value, RawTensor):
        return msgpack.ExtType(EXT_TENSOR_INLINE, _ext_packer()(
            [value.dtype, list(value.shape), memoryview(value.data).tobytes()]))
    if isinstance(value, TensorColumn):
        return value.rows
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot encode value of type {type(value).__name__}")


def packb(obj) -> bytes:
    """Encode ``obj`` into one self-contained bytes object (all tensors inline)."""
    return msgpack.packb(obj, default=_packb_default, use_bin_type=True)


def packer():
    """A reusable :func:`packb` for loops: ``packer()(obj) == packb(obj)``, without the
    Packer that every ``packb`` call builds."""
    return msgpack.Packer(default=_packb_default, use_bin_type=True).pack


def unpackb(data):
    """Decode bytes produced by :func:`packb`; refuses any non-tensor extension."""
    return decode([data])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _stored_ext_hook(code, payload):
    if code != EXT_TENSOR_INLINE:
        raise CodecError(f"unexpected extension type {code}")
    try:
        dtype, shape, data = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise CodecError(f"malformed tensor: {exc}") from None
    if not isinstance(dtype, str) or not isinstance(shape, list) \
            or not isinstance(data, bytes) or not all(_is_int(s) for s in shape):
        raise CodecError("malformed tensor")
    tensor = RawTensor(dtype, shape, data)
    try:
        tensor.validate("tensor")
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    return tensor


def unpack_stored(data):
    """Decode :func:`packb` bytes read from a file (the dump format's msgpack).

    Stricter than :func:`unpackb` about tensors (inline only, shape of ints, bytes payload)
    and without its header size limit or GC pause (callers pause GC around big files).
    ``data`` may be bytes or a memoryview; raises CodecError.
    """
    try:
        return msgpack.unpackb(data, ext_hook=_stored_ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage input
        raise CodecError(f"{type(exc).__name__}: {exc}") from None
