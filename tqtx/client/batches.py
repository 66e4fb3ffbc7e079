"""The TensorDict a get returns, made without the checks its columns do not need.

A get's result is a TensorDict of ``n`` rows whose columns the client built itself, each
``n`` rows long: dense tensors, jagged nested tensors, NonTensorStacks. ``TensorDict.set``
checks every column's batch dimensions against the TensorDict's, and for a nested tensor
that means reading its symbolic sizes: about 15 µs a column, a sixth of what a one-row get
spends building its result. ``TensorDict._new_unsafe`` makes the same object from the
columns without those checks. It is tensordict's internal API, so it is used only after a
check at first use that it gives what ``set`` gives on this tensordict (same class, batch
size, device, names, lock state and the very column objects, in order); otherwise, or on
any error, the public calls are used (:class:`~tqtx.client.shortcut.Shortcut`).
"""
from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict

from .shortcut import Shortcut

_STATE = ("_device", "_batch_size", "_td_dim_names", "_is_shared", "_is_memmap", "_is_locked")


def public(columns: dict, n: int) -> TensorDict:
    """:func:`batch` through ``TensorDict.set``."""
    td = TensorDict({}, batch_size=[n])
    for field, col in columns.items():
        td.set(field, col)
    return td


def _direct(columns: dict, n: int) -> TensorDict:
    # a column of another length is the public call's to name
    if not all(c.size(0) == n for c in columns.values()):
        raise ValueError("a column of another length")
    return TensorDict._new_unsafe(columns, batch_size=torch.Size([n]), nested=False)


def _same(a: TensorDict, b: TensorDict, columns: dict) -> bool:
    return (type(a) is type(b) is TensorDict and list(a.keys()) == list(b.keys())
            and all(getattr(a, s, None) == getattr(b, s, None) for s in _STATE)
            and all(a._tensordict[k] is v and b._tensordict[k] is v
                    for k, v in columns.items()))


def _agree(direct, public_call) -> bool:
    """Whether ``direct`` gives, on this tensordict, what ``set`` gives."""
    columns = {"dense": torch.zeros(3, 2), "scalars": torch.zeros(3),
               "jagged": torch.nested.nested_tensor(
                   [torch.zeros(1), torch.zeros(4), torch.zeros(2)], layout=torch.jagged),
               "objects": NonTensorStack("a", {"b": 1}, None)}
    return _same(direct(dict(columns), 3), public_call(columns, 3), columns)


# A TensorDict of ``n`` rows holding ``columns`` (field -> a column of ``n`` rows that the
# caller built: a tensor, nested tensor or NonTensorStack), in their order.
batch = Shortcut(_direct, public, _agree)
