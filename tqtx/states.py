"""Every tqtx state machine, each as one table: state -> the states it may move to.

* :data:`RESTORE` -- a restore in the controller journal (``restores.state``).
* :data:`UNIT` -- one unit's claim on a restore (``restore_units.state``).
* :data:`DUMP_RESTORE` -- a restore reading a dump, in the dump journal (``restores.state``).
* :data:`PUBLICATION` -- one attempt at publishing a dump (``publications.phase``).
* :data:`ROLL_FORWARD` -- one unit of a committing restore, while the controller rolls it
  forward (in memory: the journal's claim is ``staged`` until it is ``applied``).
* :data:`CHECKPOINT_LOAD` -- a ``load_checkpoint`` (the controller's ``checkpoint_load``
  marker in its journal is the decision).
* :data:`UNIT_CHECKPOINT` -- one unit's side of a checkpoint load (in the unit's memory).
* :data:`DUMP_JOB` -- one unit's shard of a dump (in the unit's memory).

The strings are what the journals store and what goes on the wire; they never change.
:func:`check` is the one place a move is judged legal. :func:`restore_decision` is the one
commit rule of a restore, :func:`pending_reason` the one way to say why it is still open.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

# ----------------------------------------------------------------- state names

# restore (controller journal) and dump-journal restore
ACTIVE = "active"
COMMITTING = "committing"
COMMITTED = "committed"
ABORTED = "aborted"
CANCELLED = "cancelled"
FAILED = "failed"           # also a unit state and a publication phase
READING = "reading"         # dump journal: a restore is reading the dump

# unit claims (and the actions of RESTORE_UNIT: a unit claims, reports staged or failed)
CLAIM = "claim"
PENDING = "pending"
CLAIMED = "claimed"
STAGED = "staged"
APPLIED = "applied"
DROPPED = "dropped"
# recovery event actions: a unit came back with the rows of its row log (tqtx.storage.rowlog),
# or without a log and without rows the metadata names (named lost)
REPLAYED = "replayed"
ROWS_LOST = "rows_lost"
RESTORE_UNIT_ACTIONS = (CLAIM, STAGED, FAILED)

# publication phases
STAGING = "staging"
WRITTEN = "written"
SYNCED = "synced"
OLD_MOVED = "old-moved"
PUBLISHED = "published"
CLEANED = "cleaned"
ROLLED_BACK = "rolled-back"

# roll-forward of one unit of a committing restore (and APPLIED, FAILED above)
APPLYING = "applying"         # APPLY_STAGED to send
REDOING = "redoing"           # the unit lost its staged rows: REDO_RESTORE from the dump
REDO_FAILED = "redo_failed"   # the dump cannot provide them (also a pending reason)
UNREACHABLE = "unanswered"    # the unit does not answer (or is not registered): later

# checkpoint load
DECIDED = "decided"           # metadata journaled with the load's marker: units switching
SWITCHED = "switched"         # every unit switched; the marker is gone

# a unit's dump shard
SNAPSHOTTED = "snapshotted"   # rows held by reference; the writer waits for its target
WRITING = "writing"
CANCELLING = "cancelling"
DONE = "done"


class IllegalTransition(ValueError):
    """A journal row was asked to move to a state its state machine does not allow."""


@dataclass(frozen=True)
class Machine:
    """A state machine: ``moves[s]`` are the states ``s`` may move to (any not listed is
    illegal, a state without an entry is final). ``restart_only`` moves are legal only when
    the caller says it is the controller's startup replay."""

    name: str
    states: tuple[str, ...]  # every state, in the order the journal's CHECK constraint lists
    final: tuple[str, ...]
    moves: Mapping[str, frozenset[str]]
    restart_only: frozenset[tuple[str, str]] = field(default_factory=frozenset)


def check(machine: Machine, frm: str, to: str, *, subject: str, restart: bool = False,
          detail: str = "") -> bool:
    """Judge the move ``frm -> to`` of ``machine``.

    Returns True for a legal move, False for a repeat (``frm == to``: a no-op, callers retry
    after lost replies); raises :class:`IllegalTransition` naming ``subject`` otherwise.
    ``restart=True`` also allows the machine's restart-only moves.
    """
    if frm == to:
        return False
    if to in machine.moves.get(frm, ()) and (restart or (frm, to) not in machine.restart_only):
        return True
    raise IllegalTransition(f"{subject}: illegal transition {frm} -> {to}{detail}")


# ----------------------------------------------------------------- the machines

RESTORE = Machine(
    "restore",
    states=(ACTIVE, COMMITTING, COMMITTED, ABORTED, CANCELLED, FAILED),
    final=(COMMITTED, ABORTED, CANCELLED, FAILED),
    moves={
        ACTIVE: frozenset({COMMITTING, ABORTED, CANCELLED, FAILED}),
        COMMITTING: frozenset({COMMITTED, ABORTED, FAILED}),
    },
    # A decided commit only moves forward, unless the controller restarted: its plan (the
    # reserved indexes) died with it, so the startup replay can only end it as aborted.
    restart_only=frozenset({(COMMITTING, ABORTED)}),
)

UNIT = Machine(
    "unit",
    states=(PENDING, CLAIMED, STAGED, APPLIED, FAILED, DROPPED),
    final=(APPLIED, FAILED, DROPPED),
    moves={
        PENDING: frozenset({CLAIMED, FAILED, DROPPED}),
        CLAIMED: frozenset({STAGED, FAILED, DROPPED}),
        STAGED: frozenset({APPLIED, FAILED, DROPPED}),
    },
)

# The restore state a unit's claim needs to move into a state (moves not listed: any).
UNIT_NEEDS_RESTORE: dict[str, tuple[str, ...]] = {
    CLAIMED: (ACTIVE,),
    STAGED: (ACTIVE,),
    APPLIED: (COMMITTING, COMMITTED),
}

DUMP_RESTORE = Machine(
    "dump restore",
    states=(READING, COMMITTED, ABORTED, CANCELLED, FAILED),
    final=(COMMITTED, ABORTED, CANCELLED, FAILED),
    moves={READING: frozenset({COMMITTED, ABORTED, CANCELLED, FAILED})},
)

# Forward along staging -> written -> synced -> old-moved -> published -> cleaned (skipping
# ahead is allowed); failed before the swap began, rolled-back until the new dump is in place.
PUBLICATION = Machine(
    "publication",
    states=(STAGING, WRITTEN, SYNCED, OLD_MOVED, PUBLISHED, CLEANED, FAILED, ROLLED_BACK),
    final=(CLEANED, FAILED, ROLLED_BACK),
    moves={
        STAGING: frozenset({WRITTEN, SYNCED, OLD_MOVED, PUBLISHED, CLEANED, FAILED, ROLLED_BACK}),
        WRITTEN: frozenset({SYNCED, OLD_MOVED, PUBLISHED, CLEANED, FAILED, ROLLED_BACK}),
        SYNCED: frozenset({OLD_MOVED, PUBLISHED, CLEANED, FAILED, ROLLED_BACK}),
        OLD_MOVED: frozenset({PUBLISHED, CLEANED, ROLLED_BACK}),
        PUBLISHED: frozenset({CLEANED}),
    },
)

ROLL_FORWARD = Machine(
    "roll-forward",
    states=(APPLYING, REDOING, APPLIED, REDO_FAILED, UNREACHABLE),
    final=(APPLIED, REDO_FAILED, UNREACHABLE),
    moves={
        APPLYING: frozenset({APPLIED, REDOING, UNREACHABLE}),
        REDOING: frozenset({APPLYING, REDO_FAILED, UNREACHABLE}),
    },
)

CHECKPOINT_LOAD = Machine(
    "checkpoint load",
    states=(STAGING, DECIDED, SWITCHED, DROPPED),
    final=(SWITCHED, DROPPED),
    moves={
        STAGING: frozenset({DECIDED, DROPPED}),   # every unit staged its file / one failed
        DECIDED: frozenset({SWITCHED}),            # only forward once decided
    },
)

# A unit reads its checkpoint file and stages the rows, then switches to them; a staged load
# is dropped when abandoned or pushed out by newer ones (see tqtx.storage.checkpoints).
UNIT_CHECKPOINT = Machine(
    "unit checkpoint load",
    states=(READING, STAGED, APPLIED, FAILED, DROPPED),
    final=(APPLIED, FAILED, DROPPED),
    moves={
        READING: frozenset({STAGED, FAILED}),
        STAGED: frozenset({APPLIED, DROPPED}),
    },
)

DUMP_JOB = Machine(
    "dump job",
    states=(SNAPSHOTTED, WRITING, CANCELLING, DONE, FAILED, CANCELLED),
    final=(DONE, FAILED, CANCELLED),
    moves={
        SNAPSHOTTED: frozenset({WRITING, CANCELLED, FAILED}),
        WRITING: frozenset({DONE, FAILED, CANCELLING}),
        CANCELLING: frozenset({CANCELLED, FAILED, DONE}),
    },
)

RESTORE_STATES, RESTORE_FINAL = RESTORE.states, RESTORE.final
UNIT_STATES, UNIT_FINAL = UNIT.states, UNIT.final
DUMP_RESTORE_STATES, DUMP_RESTORE_FINAL = DUMP_RESTORE.states, DUMP_RESTORE.final
PUBLICATION_PHASES, PUBLICATION_FINAL = PUBLICATION.states, PUBLICATION.final


# ----------------------------------------------------------------- the commit rule

COMMIT = "commit"   # every unit staged its rows
WAIT = "wait"       # a unit is still loading: the restore stays pending until it reports
ABORT = "abort"     # some unit failed, was dropped or never claimed

# RestorePendingError.reason: why an operation is refused while a restore is unresolved
UNIT_RUNNING = "unit_running"        # a unit holds its claim: it is still loading
IN_PROGRESS = "in_progress"          # neither decided nor ended
APPLY_PENDING = "apply_pending"      # commit decided, some unit has not applied yet
UNKNOWN_RESTORE = "unknown_restore"  # a dump journal names a restore no controller knows
OTHER_CONTROLLER = "other_controller"  # ... one another, live, controller runs
LOST_REPLY = "lost_reply"            # FINISH_RESTORE's reply never came: see the journal
PENDING_REASONS = (UNIT_RUNNING, IN_PROGRESS, APPLY_PENDING, REDO_FAILED, UNKNOWN_RESTORE,
                   OTHER_CONTROLLER, LOST_REPLY)


def restore_decision(unit_states: Iterable[str]) -> str:
    """What an undecided restore whose claims are in ``unit_states`` may become:
    :data:`COMMIT` (all staged), :data:`WAIT` (a unit still holds its claim) or :data:`ABORT`."""
    unit_states = list(unit_states)
    if all(s == STAGED for s in unit_states):
        return COMMIT
    if CLAIMED in unit_states:
        return WAIT
    return ABORT


def pending_reason(unit_states: Iterable[str]) -> str:
    """Why an open restore is pending: :data:`UNIT_RUNNING` while a unit holds its claim,
    else :data:`IN_PROGRESS`."""
    return UNIT_RUNNING if CLAIMED in list(unit_states) else IN_PROGRESS


def unit_states(rec: dict) -> dict[int, str]:
    """``{unit: claim state}`` of a restore's journal record (``rec["units"]``, as
    ``ControllerJournal.get_restore`` and ``unresolved_restores`` return it)."""
    return {u["unit_id"]: u["state"] for u in rec.get("units", ())}
