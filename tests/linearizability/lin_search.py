"""The linearizability search for one register's history (Wing & Gong, with Lowe's
just-in-time linearization and memoization of (linearized ops, state), as porcupine does).

A register's state is tracked as a *set* of possible values (a nondeterministic model): an
optional write (a unit loss, which takes effect only on the keys of the lost unit) turns
``S`` into ``S | {v}``; a read narrows ``S`` to what it saw.

An event whose end is infinite (an indeterminate write) may take effect at any point after
its start, or never: it is linearized only if that helps, and the search succeeds once every
event with a finite end is linearized. A configuration that linearized a superset of another
configuration's indeterminate events, with the same definite events and the same state, can
do nothing the other cannot, so it is pruned (without this, k unobserved indeterminate
writes would multiply the memo by up to 2^k).
"""
from __future__ import annotations

from dataclasses import dataclass

ABSENT = "<absent>"
LOST = "<lost>"
LISTED = "<listed>"      # a kv_list read: the key is listed (any state but ABSENT)
UNLISTED = "<unlisted>"  # a kv_list read: not listed (ABSENT, or LOST)
_NOT_LISTED = frozenset({ABSENT, LOST})


@dataclass
class Event:
    """One operation's effect on one register: a write of ``write`` or a read of ``read``."""

    op: object
    write: str | None
    read: str | None
    optional: bool
    start: float
    end: float  # float("inf") for an indeterminate write


@dataclass
class SearchResult:
    linearizable: bool | None  # None: the step budget ran out
    steps: int


def apply(states: frozenset, e: Event) -> frozenset | None:
    """The states after ``e`` from ``states``, or None if ``e`` is impossible there."""
    if e.write is not None:
        return states | {e.write} if e.optional else frozenset((e.write,))
    r = e.read
    if r == LISTED:
        out = states - {ABSENT}
    elif r == UNLISTED:
        out = states & _NOT_LISTED
    else:
        return frozenset((r,)) if r in states else None
    return out or None


def search(events: list[Event], *, initial: str, budget: int) -> SearchResult:
    """Is there a linearization of ``events`` from state ``initial``?"""
    n = len(events)
    if n == 0:
        return SearchResult(True, 0)
    inf = float("inf")
    # Calls before returns at equal times: ops that touch at an instant count as concurrent.
    order = sorted([(e.start, 0, i) for i, e in enumerate(events)]
                   + [(e.end, 1, i) for i, e in enumerate(events)])
    size = 2 * n
    # a doubly linked list of nodes 1..size (0 is the head; -1 ends it)
    nxt = list(range(1, size + 2))
    nxt[size] = -1
    prv = list(range(-1, size))
    is_call = [False] * (size + 1)
    op_of = [0] * (size + 1)
    match = [0] * (size + 1)
    call_node = [0] * n
    for pos, (_, kind, i) in enumerate(order, start=1):
        op_of[pos] = i
        if kind == 0:
            is_call[pos] = True
            call_node[i] = pos
        else:
            match[call_node[i]] = pos
    endless = [e.end == inf for e in events]
    ind_mask = sum(1 << i for i in range(n) if endless[i])
    def_mask = ((1 << n) - 1) ^ ind_mask

    def lift(p: int) -> None:
        for node in (p, match[p]):
            nxt[prv[node]] = nxt[node]
            if nxt[node] != -1:
                prv[nxt[node]] = prv[node]

    def unlift(p: int) -> None:
        for node in (match[p], p):
            nxt[prv[node]] = node
            if nxt[node] != -1:
                prv[nxt[node]] = node

    memo: dict[tuple[int, frozenset], list[int]] = {}
    stack: list[tuple[int, frozenset, int]] = []
    states = frozenset((initial,))
    lin = 0
    entry = nxt[0]
    steps = 0
    while True:
        if entry == -1 or (not is_call[entry] and endless[op_of[entry]]):
            return SearchResult(True, steps)
        steps += 1
        if steps > budget:
            return SearchResult(None, steps)
        if is_call[entry]:
            i = op_of[entry]
            new = apply(states, events[i])
            if new is not None:
                new_lin = lin | (1 << i)
                key = (new_lin & def_mask, new)
                ind = new_lin & ind_mask
                seen = memo.get(key)
                if seen is None or not any(s & ~ind == 0 for s in seen):
                    if seen is None:
                        memo[key] = [ind]
                    else:
                        seen.append(ind)
                    stack.append((entry, states, lin))
                    states, lin = new, new_lin
                    lift(entry)
                    entry = nxt[0]
                    continue
            entry = nxt[entry]
        else:
            # the return of an op not linearized yet: the last choice was wrong
            if not stack:
                return SearchResult(False, steps)
            entry, states, lin = stack.pop()
            unlift(entry)
            entry = nxt[entry]
