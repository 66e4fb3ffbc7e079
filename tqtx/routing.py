"""Routing: which storage unit holds a global index (a pure function of the index and the
unit count, so a full checkpoint needs the same unit count; see docs/architecture.md,
"Routing"). Torch-free; used by the client, the controller and the dump and checkpoint
paths alike."""
from __future__ import annotations


def owner(index: int, num_units: int) -> int:
    """The unit that holds global index ``index`` among ``num_units``."""
    return index % num_units


def by_owner(indexes, num_units: int) -> dict[int, list[int]]:
    """``{unit: [position, ...]}``: the positions in ``indexes`` of each unit's rows, in
    order (units without rows left out)."""
    out: dict[int, list[int]] = {}
    for pos, idx in enumerate(indexes):
        u = idx % num_units
        got = out.get(u)
        if got is None:
            out[u] = [pos]
        else:
            got.append(pos)
    return out
