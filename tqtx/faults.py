"""Named fault points for crash and failure testing.

``TQTX_FAULTS="point:action[,point:action...]"`` is read once per process. Actions:
``kill`` (SIGKILL this process), ``raise`` (raise InjectedFault), ``drop-reply``
(the server handling the current request sends no reply), ``delay:S`` (sleep S seconds).
A point may carry ``@N`` to fire only on its N-th hit (1-based), e.g.
``unit.load.after_stage@2:kill``. A point listed more than once runs its actions in
order, e.g. ``P:delay:0.5,P:kill`` (wait, then die: lets the other units go past P first).
With the variable unset, :func:`hit` is a dict lookup on an empty dict.
"""
from __future__ import annotations

import os
import signal
import time

_ENV = "TQTX_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a fault point whose action is ``raise``."""


class DropReply(Exception):
    """Raised by a fault point whose action is ``drop-reply``; servers swallow the reply."""


def _parse(spec: str) -> dict[str, list[tuple[str, int]]]:
    table: dict[str, list[tuple[str, int]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, action = item.partition(":")
        nth = 0
        if "@" in point:
            point, _, n = point.partition("@")
            nth = int(n)
        table.setdefault(point, []).append((action, nth))
    return table


_TABLE = _parse(os.environ.get(_ENV, ""))
_HITS: dict[str, int] = {}


def configure(spec: str) -> None:
    """Replace the fault table (tests running in-process)."""
    global _TABLE
    _TABLE = _parse(spec)
    _HITS.clear()


def hit(point: str) -> None:
    """Trigger the action configured for ``point``, if any."""
    if not _TABLE:
        return
    entries = _TABLE.get(point)
    if entries is None:
        return
    count = _HITS[point] = _HITS.get(point, 0) + 1
    for action, nth in entries:
        if not nth or count == nth:
            _act(point, action)


def _act(point: str, action: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # SIGKILL is asynchronous on some systems
    elif action == "raise":
        raise InjectedFault(f"fault injected at {point}")
    elif action == "drop-reply":
        raise DropReply(point)
    elif action.startswith("delay:"):
        time.sleep(float(action.split(":", 1)[1]))
    else:
        raise ValueError(f"unknown fault action {action!r} for point {point!r}")
