"""Jagged nested tensors over received bytes, made at a third of the public call's cost.

TransferQueue's layout returns every tensor field of one or more dimensions as a jagged
nested tensor, so a one-row get makes one per field. ``torch.nested.nested_tensor_from_jagged``
reaches the constructor through the dispatcher (a ``__torch_function__`` hop, the op's
argument normalisation, an autograd view of the values): about 90 µs, 60 of which buy
nothing here -- the values are buffers of received bytes that never require grad, and
TransferQueue's own results, copies, are no views. :func:`jagged` calls the constructor
that op ends in, with the same metadata. It is torch's internal API, so it is
used only after a check at first use that it gives what the public call gives on this torch
(type, shape, rows, bounds, padding, shared memory); otherwise, or on any error, the public
call is used (:class:`~tqtx.client.shortcut.Shortcut`).
"""
from __future__ import annotations

import inspect

import torch

from .shortcut import Shortcut


def _seqlen_args() -> set:
    return set(inspect.signature(torch.nested.nested_tensor_from_jagged).parameters) & \
        {"min_seqlen", "max_seqlen"}


_SEQLEN_ARGS = _seqlen_args()


def public(values: torch.Tensor, offsets: torch.Tensor, lengths) -> torch.Tensor:
    """:func:`jagged` through ``torch.nested.nested_tensor_from_jagged``."""
    extra = {}
    if len(lengths) and _SEQLEN_ARGS:
        extra = {"min_seqlen": int(min(lengths)), "max_seqlen": int(max(lengths))}
    return torch.nested.nested_tensor_from_jagged(values, offsets, **extra)


def _direct(values: torch.Tensor, offsets: torch.Tensor, lengths) -> torch.Tensor:
    from torch.nested._internal.nested_tensor import NestedTensor, _store_val_in_tensor
    cache = {}
    if len(lengths):
        cache = {"min_seqlen": _store_val_in_tensor(int(min(lengths))),
                 "max_seqlen": _store_val_in_tensor(int(max(lengths)))}
    return NestedTensor(values, offsets, _ragged_idx=1, _metadata_cache=cache)


def _same(a: torch.Tensor, b: torch.Tensor, values: torch.Tensor) -> bool:
    return (type(a) is type(b) and a.layout == b.layout == torch.jagged
            and a.shape == b.shape and a.dtype == b.dtype and not a.requires_grad
            and a._min_seqlen == b._min_seqlen and a._max_seqlen == b._max_seqlen
            and a.values().data_ptr() == values.data_ptr()
            and all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
            and torch.equal(torch.nested.to_padded_tensor(a, 0.0),
                            torch.nested.to_padded_tensor(b, 0.0)))


def _agree(direct, public_call) -> bool:
    """Whether ``direct`` gives, on this torch, what the public call gives."""
    values = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    offsets = torch.tensor([0, 1, 1, 4, 6])
    lengths = [1, 0, 3, 2]
    return bool(_SEQLEN_ARGS) and _same(direct(values, offsets, lengths),
                                        public_call(values, offsets, lengths), values)


# A jagged nested tensor over ``values`` (no copy; rows split at ``offsets``) that knows
# its shortest and longest row (``lengths``), as ``torch.nested.as_nested_tensor`` makes
# them: without them ``to_padded_tensor`` pads every row to the length of all values.
jagged = Shortcut(_direct, public, _agree)
