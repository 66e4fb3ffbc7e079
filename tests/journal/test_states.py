"""The state-machine tables, ``check`` and the one restore commit rule (tqtx.states)."""
from __future__ import annotations

import pytest

from tqtx import states as st
from tqtx.states import IllegalTransition


def test_illegal_transition_is_the_journal_one():
    assert IllegalTransition is st.IllegalTransition and issubclass(IllegalTransition, ValueError)


@pytest.mark.parametrize("machine", [st.RESTORE, st.UNIT, st.DUMP_RESTORE, st.PUBLICATION,
                                     st.UNIT_CHECKPOINT])
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


def test_roll_forward_checkpoint_load_and_dump_job_machines():
    # roll-forward: apply, or redo from the dump then apply; nothing comes back from final
    assert st.check(st.ROLL_FORWARD, st.APPLYING, st.REDOING, subject="u")
    assert st.check(st.ROLL_FORWARD, st.REDOING, st.APPLYING, subject="u")
    for frm, to in [(st.APPLIED, st.APPLYING), (st.REDO_FAILED, st.REDOING),
                    (st.APPLYING, st.REDO_FAILED)]:
        with pytest.raises(IllegalTransition):
            st.check(st.ROLL_FORWARD, frm, to, subject="u")
    # a checkpoint load only moves forward once its metadata is journaled
    assert st.check(st.CHECKPOINT_LOAD, st.STAGING, st.DECIDED, subject="c")
    with pytest.raises(IllegalTransition):
        st.check(st.CHECKPOINT_LOAD, st.DECIDED, st.DROPPED, subject="c")
    assert st.check(st.DUMP_JOB, st.WRITING, st.CANCELLING, subject="d")
    with pytest.raises(IllegalTransition):
        st.check(st.DUMP_JOB, st.DONE, st.CANCELLING, subject="d")


def _words() -> set[str]:
    words = {v for k, v in vars(st).items() if k.isupper() and isinstance(v, str)}
    return words | set(st.PENDING_REASONS) | set(st.RESTORE_UNIT_ACTIONS)


def _stray_words(paths) -> list[str]:
    """String literals equal to a state, action or reason word in ``paths``, except as a
    dict key, an index, the key of a get/pop/setdefault, a docstring or a __slots__ entry
    (wire and journal field names that happen to be the same word, e.g. a reply's
    ``"staged"`` count)."""
    import ast
    words, found = _words(), []
    for path in paths:
        tree = ast.parse(path.read_text())
        parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and node.value in words):
                continue
            p = parent.get(node)
            if isinstance(p, ast.Dict) and node in p.keys or \
                    isinstance(p, ast.Subscript) and p.slice is node or \
                    isinstance(p, ast.Expr) or \
                    isinstance(p, ast.Call) and isinstance(p.func, ast.Attribute) and \
                    p.func.attr in ("get", "pop", "setdefault") and p.args[:1] == [node]:
                continue
            grand = parent.get(p)
            if isinstance(grand, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in grand.targets):
                continue
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_state_and_reason_words_are_written_only_in_states_py():
    """Every state, action and reason word is a name of tqtx.states elsewhere."""
    from pathlib import Path
    paths = [p for p in sorted(Path(st.__file__).parent.rglob("*.py")) if p.name != "states.py"]
    assert not _stray_words(paths), "state or reason words outside tqtx/states.py"


def test_the_word_check_catches_a_literal(tmp_path):
    """The check above is not vacuous: a comparison with "committing" and a reason word
    passed to a constructor are found; a reply key of the same word is not."""
    bad = tmp_path / "bad.py"
    bad.write_text('def f(rec, E):\n    if rec["state"] == "committing":\n'
                   '        raise E(reason="redo_failed")\n    return {"staged": 1}\n')
    assert _stray_words([bad]) == ["bad.py:2: 'committing'", "bad.py:3: 'redo_failed'"]
