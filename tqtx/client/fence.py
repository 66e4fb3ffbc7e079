"""The client's side of the row fence: how often a fenced request is tried again.

A read, put or dump names the generations the controller gave its rows (see
:mod:`tqtx.controller.metadata`); a unit that holds another generation at an index refuses
(:class:`~tqtx.errors.StaleRowsError`): the key there was cleared, or cleared and put again,
since the controller answered. The client then asks the controller again and retries, as
if the request had come after that change.
"""
from __future__ import annotations

import time

from ..errors import StaleRowsError

# A read, put or dump that met a row of another generation (its key was cleared, or cleared
# and put again, since the controller answered) asks the controller again: at most this
# many tries, the pauses between them growing (FENCE_PAUSES seconds; a unit that restarted
# re-registers within them, and the controller then names its rows lost).
FENCE_PAUSES = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
FENCE_ATTEMPTS = len(FENCE_PAUSES)


def fence_pause(attempt: int) -> None:
    """The pause before try ``attempt`` + 1 of a fenced request (see FENCE_PAUSES)."""
    if FENCE_PAUSES[attempt]:
        time.sleep(FENCE_PAUSES[attempt])


def stale_keys_error(what: str, keys, pid: str) -> StaleRowsError:
    shown = ", ".join(repr(k) for k in list(keys)[:10])
    return StaleRowsError(
        f"{what}: the rows of key(s) {shown} in partition {pid!r} were cleared or put again "
        f"at every one of {FENCE_ATTEMPTS} tries (other clients keep clearing and putting "
        f"them); nothing of another key was read or written. Try again")
