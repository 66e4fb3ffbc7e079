"""Linearizability checker for tqtx histories: every key is a register, proven per key.

Pure Python (no tqtx, no torch), so it can be fed hand-written histories.

**History.** A list of :class:`Op`: process, kind, invocation and completion time
(``complete=None``: indeterminate — crashed or timed out; it may take effect at any moment
after its invocation, or never), outcome (``ok``; ``fail`` = definitely no effect; ``info`` =
indeterminate) and per ``(partition, key)`` the value written or observed, separately for the
row (``values``) and the tag (``tags``).

**Model.** Each ``(family, partition, key)`` is a register (family ``value`` for the row,
``tag`` for the tag: a put's row is stored on the units before its tag is committed on the
controller, so the two change at different moments). Its state is :data:`ABSENT`,
:data:`LOST` or a unique value id; initially ABSENT.

Writes: ``put`` (its value ids), ``clear`` (ABSENT), ``load`` (a dump's captured value of every
key in the dump), ``ckpt_load`` (every key captured by the checkpoint, and ABSENT for every
other key of the key space: the workload lists them all), ``unit_loss`` (LOST on the row of
every key, *optional*: only keys on the killed unit lose their row, so it may take effect or
not, within [kill, unit back]).

A ``restart`` (of the whole job: every server killed at its invocation and started again
by its completion) is neither: it bounds the indeterminate ``put`` and ``clear`` ops that
returned before it. Once such an op has returned, its client sends nothing more, and every
process that could still hold it dies at the kill, so it took effect by the restart's
completion or never: an optional write placed before that completion. (Restores are not bounded: a journaled restore is rolled forward
later.) Without the bound, a run with many kills carries every such op to the end of the
history and the search outgrows its budget.

Reads: ``get`` (the value, ABSENT for a KeysNotFoundError, LOST for a RowsLostError), ``list``
(row: :data:`LISTED` = any state but ABSENT, :data:`UNLISTED` = ABSENT, LOST allowed either way;
tag: the exact tag or ABSENT), ``dump`` and ``ckpt_save`` (per key a read of the captured
value, each key at its own instant within the call).

A read returns the value of a write that was invoked before the read returned and was not
superseded by a write that completed before the read was invoked: the history of each
register must have a linearization (Wing & Gong's search with Lowe's just-in-time
linearization and memoization, as in porcupine) — P-compositionality makes that per register
exact for single-key linearizability.

What the per-key decomposition does not prove: that a multi-key op acted at *one* instant on
all its keys. A dump or checkpoint read is only required to see, per key, a value current at
some instant of its interval (which is all tqtx promises). A restore or checkpoint load that
completed (ok) or failed is still checked all-or-nothing in effect, because each key must show
the new value after an ok load and none may show it after a failed one; for an *indeterminate*
load each key independently may or may not have been written, so a half-applied indeterminate
restore is not detected.

Before the search, a timing-free check: every value a read returns must have been written
(by any write, failed ones included) to that same key; a value written only to another key is
reported with both keys (the index-reuse bug of issue 32), and a value no write produced
(a torn row, a row-less capture) too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from lin_explain import describe_op, explain_read
from lin_search import ABSENT, LISTED, LOST, UNLISTED, Event, search

SENTINELS = frozenset({ABSENT, LOST, LISTED, UNLISTED})

WRITE_KINDS = frozenset({"put", "clear", "load", "ckpt_load", "unit_loss"})
READ_KINDS = frozenset({"get", "list", "dump", "ckpt_save"})
RESTART = "restart"
BOUNDED_BY_RESTART = frozenset({"put", "clear"})
OUTCOMES = ("ok", "fail", "info")
FAMILIES = ("value", "tag")
DEFAULT_BUDGET = 2_000_000  # search steps per register

Key = tuple[str, str]              # (partition, key)
Register = tuple[str, str, str]    # (family, partition, key)


@dataclass
class Op:
    """One operation of the history (see the module docstring for the kinds)."""

    process: str
    kind: str
    invoke: float
    complete: float | None
    outcome: str
    values: dict[Key, str] = field(default_factory=dict)
    tags: dict[Key, str] = field(default_factory=dict)
    error: str = ""
    optional: bool = False  # a write that may not take effect even when it completed
    index: int = -1         # position in the history (set by check)

    def __post_init__(self):
        if self.kind not in WRITE_KINDS | READ_KINDS | {RESTART}:
            raise ValueError(f"unknown op kind {self.kind!r}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r}")
        if self.complete is not None and self.complete < self.invoke:
            raise ValueError(f"{self.kind} completes before it is invoked")

    @property
    def is_write(self) -> bool:
        return self.kind in WRITE_KINDS

    def to_json(self) -> dict:
        return {"process": self.process, "kind": self.kind, "invoke": self.invoke,
                "complete": self.complete, "outcome": self.outcome, "error": self.error,
                "optional": self.optional,
                "values": [[p, k, v] for (p, k), v in self.values.items()],
                "tags": [[p, k, v] for (p, k), v in self.tags.items()]}

    @classmethod
    def from_json(cls, d: dict) -> "Op":
        return cls(process=str(d["process"]), kind=d["kind"], invoke=d["invoke"],
                   complete=d["complete"], outcome=d["outcome"], error=d.get("error", ""),
                   optional=bool(d.get("optional")),
                   values={(p, k): v for p, k, v in d.get("values", [])},
                   tags={(p, k): v for p, k, v in d.get("tags", [])})


@dataclass
class Violation:
    kind: str           # foreign-value, unwritten-value, future-value, not-linearizable
    register: Register
    op: Op | None
    message: str

    def __str__(self):
        return f"[{self.kind}] {'/'.join(self.register)}: {self.message}"


@dataclass
class Verdict:
    violations: list[Violation]
    unknown: list[Register]   # registers whose search hit the step budget
    registers: int
    events: int
    steps: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.violations and not self.unknown

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.violations:
            out[v.kind] = out.get(v.kind, 0) + 1
        return out

    def breakdown(self) -> dict[str, int]:
        """Violations by kind and by the kind of op that made the observation."""
        out: dict[str, int] = {}
        for v in self.violations:
            name = f"{v.kind} in {v.op.kind if v.op is not None else '?'}"
            out[name] = out.get(name, 0) + 1
        return dict(sorted(out.items()))

    def summary(self, limit: int = 5) -> str:
        head = (f"{'linearizable' if self.ok else 'NOT linearizable'}: {self.registers} "
                f"registers, {self.events} events, {self.steps} search steps, "
                f"{self.seconds:.2f}s; violations {self.breakdown() or 0}")
        if self.unknown:
            head += f"; search bound hit on {len(self.unknown)}: {self.unknown[:5]}"
        shown = [str(v) for v in self.violations[:limit]]
        more = len(self.violations) - len(shown)
        return "\n".join([head, *shown] + ([f"... and {more} more"] if more > 0 else []))


def _effect_bound(op: Op, restarts: list[tuple[float, float]]) -> float:
    """When an indeterminate write took effect at the latest: the completion of the first
    whole-job restart that began after it returned, else never bounded."""
    if op.kind in BOUNDED_BY_RESTART and op.complete is not None:
        for kill, back in restarts:
            if kill >= op.complete:
                return back
    return float("inf")


def _register_events(history: list[Op]) -> dict[Register, list[Event]]:
    """Each op's effect on each register it touches (failed writes have none)."""
    out: dict[Register, list[Event]] = {}
    restarts = sorted((op.invoke, op.complete) for op in history
                      if op.kind == RESTART and op.complete is not None)
    for op in history:
        for family, per_key in (("value", op.values), ("tag", op.tags)):
            for (pid, key), value in per_key.items():
                reg = (family, pid, key)
                if op.is_write:
                    if op.outcome == "fail":
                        continue
                    definite = op.outcome == "ok" and op.complete is not None
                    end = op.complete if definite else _effect_bound(op, restarts)
                    # bounded by a restart, an indeterminate write took effect by then or
                    # never: optional (the search must place every event of finite end)
                    optional = op.optional or (not definite and end != float("inf"))
                    out.setdefault(reg, []).append(Event(
                        op=op, write=value, read=None, optional=optional,
                        start=op.invoke, end=end))
                elif op.complete is not None:
                    out.setdefault(reg, []).append(Event(
                        op=op, write=None, read=value, optional=False, start=op.invoke,
                        end=op.complete))
    return out


def _tighten(events: list[Event]) -> None:
    """An indeterminate write of a value no other write of this register produces must
    take effect before the first read of that value returns: bound its end there (sound,
    and it keeps the search from carrying it around to the end of the history)."""
    writers: dict[str, list[Event]] = {}
    first_read: dict[str, float] = {}
    for e in events:
        if e.write is not None:
            writers.setdefault(e.write, []).append(e)
        elif e.read not in SENTINELS:
            first_read[e.read] = min(first_read.get(e.read, e.end), e.end)
    for value, ws in writers.items():
        if len(ws) == 1 and value not in SENTINELS and ws[0].end == float("inf") \
                and value in first_read and first_read[value] >= ws[0].start:
            ws[0].end = first_read[value]


def fast_check(history: list[Op]) -> tuple[list[Violation], set[tuple[int, Register]]]:
    """The timing-free check: every value read from a key was put to that key (by a put
    invoked before the read returned; failed puts count here, the search judges them).
    Only puts originate values: a load writes what a dump read, so a foreign value a dump
    captured stays foreign after a load. Returns the violations and the flagged
    (op index, register) observations (left out of the search, which would only report
    them again)."""
    writers: dict[tuple[str, str], list[tuple[Register, Op]]] = {}
    for op in history:
        if op.kind == "put":
            for family, per_key in (("value", op.values), ("tag", op.tags)):
                for (pid, key), value in per_key.items():
                    writers.setdefault((family, value), []).append(((family, pid, key), op))
    t0 = min((op.invoke for op in history), default=0.0)
    found: list[Violation] = []
    flagged: set[tuple[int, Register]] = set()
    for op in history:
        if op.is_write or op.complete is None:
            continue
        for family, per_key in (("value", op.values), ("tag", op.tags)):
            for (pid, key), value in per_key.items():
                if value in SENTINELS:
                    continue
                reg = (family, pid, key)
                ws = writers.get((family, value), [])
                same = [w for r, w in ws if r == reg]
                if not same and ws:
                    others = sorted({f"{r[1]}/{r[2]}" for r, _ in ws})
                    msg = (f"{describe_op(op, t0)} returned {value!r}, which was put only to "
                           f"key(s) {', '.join(others)}, never to {pid}/{key}: "
                           + "; ".join(describe_op(w, t0) for _, w in ws[:3]))
                    found.append(Violation("foreign-value", reg, op, msg))
                elif not same:
                    found.append(Violation("unwritten-value", reg, op,
                                           f"{describe_op(op, t0)} returned {value!r}, which no "
                                           f"put wrote (to any key)"))
                elif all(w.invoke > op.complete for w in same):
                    found.append(Violation("future-value", reg, op, (
                        f"{describe_op(op, t0)} returned {value!r}, put only by puts "
                        f"invoked after it returned: "
                        + "; ".join(describe_op(w, t0) for w in same[:3]))))
                else:
                    continue
                flagged.add((op.index, reg))
    return found, flagged


def check(history: list[Op], *, budget: int = DEFAULT_BUDGET) -> Verdict:
    """Check ``history`` (the fast check, then a search per register)."""
    t0 = time.perf_counter()
    for i, op in enumerate(history):
        op.index = i
    violations, flagged = fast_check(history)
    per_register = _register_events(history)
    unknown: list[Register] = []
    steps = events = 0
    for reg in sorted(per_register):
        evs = [e for e in per_register[reg]
               if e.write is not None or (e.op.index, reg) not in flagged]
        events += len(evs)
        _tighten(evs)
        result = search(evs, initial=ABSENT, budget=budget)
        steps += result.steps
        if result.linearizable is None:
            unknown.append(reg)
        elif not result.linearizable:
            culprit, more = _first_bad_read(evs, budget)
            steps += more
            if culprit is None:
                unknown.append(reg)
                continue
            violations.append(Violation("not-linearizable", reg, culprit.op,
                                        explain_read(culprit, evs, history, reg)))
    return Verdict(violations=violations, unknown=unknown, registers=len(per_register),
                   events=events, steps=steps, seconds=time.perf_counter() - t0)


def _first_bad_read(events: list[Event], budget: int) -> tuple[Event | None, int]:
    """The read that makes the register's history non-linearizable: with all writes and
    the reads that returned before it, the history is linearizable; adding it is not.
    (Dropping reads never breaks a linearization, so a binary search finds it.)"""
    writes = [e for e in events if e.write is not None]
    reads = sorted((e for e in events if e.write is None), key=lambda e: (e.end, e.start))
    lo, hi, steps = 1, len(reads), 0   # invariant: the first hi reads fail
    while lo < hi:
        mid = (lo + hi) // 2
        res = search(writes + reads[:mid], initial=ABSENT, budget=budget)
        steps += res.steps
        if res.linearizable is None:
            return None, steps
        if res.linearizable:
            lo = mid + 1
        else:
            hi = mid
    return (reads[hi - 1] if reads else None), steps
