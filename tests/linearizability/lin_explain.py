"""Readable explanations of a violation: the read, the writes that could explain it, and
what rules them out (times in seconds from the start of the history)."""
from __future__ import annotations

from lin_search import ABSENT, LISTED, LOST, UNLISTED, Event

_READ_TEXT = {ABSENT: "the key absent (KeysNotFoundError)", LOST: "the row lost (RowsLostError)",
              LISTED: "the key listed", UNLISTED: "the key not listed"}


def describe_op(op, t0: float = 0.0) -> str:
    """``put by w3 [1.204s, 1.209s] ok``, with the error of a failed or indeterminate op."""
    end = "?" if op.complete is None else f"{op.complete - t0:.4f}s"
    text = f"{op.kind} by {op.process} [{op.invoke - t0:.4f}s, {end}] {op.outcome}"
    if op.error:
        text += f" ({op.error[:160]})"
    if op.optional:
        text += " (optional)"
    return text


def _candidates(read: str, events: list[Event]) -> list[Event]:
    if read == LISTED:
        return [e for e in events if e.write is not None and e.write != ABSENT]
    if read == UNLISTED:
        return [e for e in events if e.write in (ABSENT, LOST)]
    return [e for e in events if e.write == read]


def _failed_writers(register, read: str, history) -> list:
    family, pid, key = register
    out = []
    for op in history:
        if op.is_write and op.outcome == "fail":
            per_key = op.values if family == "value" else op.tags
            if per_key.get((pid, key)) == read:
                out.append(op)
    return out


def _write_text(e: Event, t0: float) -> str:
    return f"{describe_op(e.op, t0)} wrote {e.write!r}"


def explain_read(culprit: Event, events: list[Event], history, register) -> str:
    """Why ``culprit`` (a read of ``register``) cannot be linearized after the reads that
    returned before it."""
    t0 = min((op.invoke for op in history), default=0.0)
    r = culprit.read
    seen = _READ_TEXT.get(r, repr(r))
    lines = [f"{describe_op(culprit.op, t0)} saw {seen}; with the reads that returned "
             f"before it the key's history is linearizable, with it not."]
    cands = _candidates(r, events)
    if r in (ABSENT, UNLISTED):
        lines.append("  could be explained by: the initial state (absent)")
    for e in cands[-4:]:
        lines.append(f"  could be explained by: {_write_text(e, t0)}")
    for op in _failed_writers(register, r, history)[:2]:
        lines.append(f"  written only by a FAILED op (no effect allowed): {describe_op(op, t0)}")
    before = sorted((e for e in events if e.write is not None and e.end < culprit.start
                     and e not in cands), key=lambda e: e.end)
    for e in before[-3:]:
        lines.append(f"  superseded by (completed before the read began): {_write_text(e, t0)}")
    during = [e for e in events if e.write is not None and e.start <= culprit.end
              and e.end >= culprit.start and e not in cands]
    for e in [e for e in during if e.end != float("inf")][:3]:
        lines.append(f"  concurrent with the read: {_write_text(e, t0)}")
    endless = sum(1 for e in during if e.end == float("inf"))
    if endless:
        lines.append(f"  (and {endless} indeterminate write(s) of other values, invoked "
                     f"before the read returned)")
    reads = sorted((e for e in events if e.write is None and e is not culprit
                    and e.end < culprit.start), key=lambda e: e.end)
    for e in reads[-2:]:
        lines.append(f"  earlier read: {describe_op(e.op, t0)} saw "
                     f"{_READ_TEXT.get(e.read, repr(e.read))}")
    return "\n".join(lines)
