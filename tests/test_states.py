"""The state-machine tables, ``check`` and the one restore commit rule (tqtx.states)."""
from __future__ import annotations

import pytest

from tqtx import states as st
from tqtx.journal.store import IllegalTransition


def test_illegal_transition_is_the_journal_one():
    assert IllegalTransition is st.IllegalTransition and issubclass(IllegalTransition, ValueError)


@pytest.mark.parametrize("machine", [st.RESTORE, st.UNIT, st.DUMP_RESTORE, st.PUBLICATION])
def test_tables_are_closed_and_final_states_have_no_moves(machine):
    assert set(machine.final) <= set(machine.states)
    for frm, tos in machine.moves.items():
        assert frm in machine.states and frm not in machine.final
        assert tos <= set(machine.states)
    for frm in machine.final:
        for to in machine.states:
            if to != frm:
                with pytest.raises(IllegalTransition, match=f"x: illegal transition {frm} -> {to}"):
                    st.check(machine, frm, to, subject="x")


def test_check_repeat_is_a_no_op_and_restart_only_moves_need_the_flag():
    assert st.check(st.RESTORE, st.ACTIVE, st.ACTIVE, subject="r") is False
    assert st.check(st.RESTORE, st.ACTIVE, st.COMMITTING, subject="r") is True
    with pytest.raises(IllegalTransition, match=r"'r1': illegal transition committing -> aborted \(why\)"):
        st.check(st.RESTORE, st.COMMITTING, st.ABORTED, subject="restore 'r1'", detail=" (why)")
    assert st.check(st.RESTORE, st.COMMITTING, st.ABORTED, subject="r", restart=True) is True


def test_publication_skips_ahead_but_fails_only_before_the_swap():
    assert st.check(st.PUBLICATION, st.STAGING, st.CLEANED, subject="p")
    assert st.check(st.PUBLICATION, st.OLD_MOVED, st.ROLLED_BACK, subject="p")
    for frm, to in [(st.OLD_MOVED, st.FAILED), (st.PUBLISHED, st.ROLLED_BACK),
                    (st.WRITTEN, st.STAGING)]:
        with pytest.raises(IllegalTransition):
            st.check(st.PUBLICATION, frm, to, subject="p")


@pytest.mark.parametrize("units, decision, reason", [
    ([], st.COMMIT, st.IN_PROGRESS),
    ([st.STAGED, st.STAGED], st.COMMIT, st.IN_PROGRESS),
    ([st.STAGED, st.CLAIMED], st.WAIT, st.UNIT_RUNNING),
    ([st.FAILED, st.CLAIMED], st.WAIT, st.UNIT_RUNNING),
    ([st.STAGED, st.PENDING], st.ABORT, st.IN_PROGRESS),
    ([st.STAGED, st.FAILED], st.ABORT, st.IN_PROGRESS),
    ([st.DROPPED], st.ABORT, st.IN_PROGRESS),
])
def test_restore_decision_and_pending_reason(units, decision, reason):
    assert st.restore_decision(units) == decision
    assert st.restore_decision(iter(units)) == decision  # a generator is read once
    assert st.pending_reason(units) == reason
