"""The controller's metadata journal under each durability setting (tqtx.journal.meta)."""
from __future__ import annotations

import sqlite3
import warnings

import pytest

from tqtx import durability as dur
from tqtx.journal import meta
from tqtx.journal.meta import DURABLE_CUT, MetaChange, MetaJournal, check_durability
from tqtx.journal.controller import ControllerJournal


def _change(i: int = 0) -> MetaChange:
    return MetaChange(rows=[("p", f"k{i}", i, frozenset({"x"}), {}, None, (1 << 40) + i)])


def _synchronous(mj: MetaJournal) -> int:
    return mj._db.execute("PRAGMA synchronous").fetchone()[0]


@pytest.fixture
def journal(tmp_path):
    with ControllerJournal(tmp_path / "state") as cj:
        opened = []

        def open_(durability, interval=dur.FLUSH_INTERVAL_S):
            mj = MetaJournal(cj.engine, durability, interval)
            opened.append(mj)
            return mj
        try:
            yield cj, open_
        finally:
            for mj in opened:
                mj.close()


def _stored_keys(cj) -> int:
    con = sqlite3.connect(cj.path)
    try:
        return con.execute("SELECT count(*) FROM meta_keys").fetchone()[0]
    finally:
        con.close()


@pytest.mark.parametrize("durability", ["controller", "buffer", "sync"])
def test_each_setting_commits_without_an_fsync_and_cuts_as_it_says(journal, durability):
    """Every commit is NORMAL (no fsync); buffer makes a durable cut per interval, sync one
    per controller loop turn before it answers (tqtx.controller.group_commit)."""
    cj, open_ = journal
    mj = open_(durability)
    assert mj.enabled and _synchronous(mj) == 1  # NORMAL
    mj.write(_change())
    assert _stored_keys(cj) == 1 and mj.dirty
    assert mj.cuts_wanted == (durability == "buffer")
    assert mj.group_commits == (durability == "sync")


def test_memory_writes_nothing(journal):
    cj, open_ = journal
    sync = open_("sync")
    sync.write(_change(0))
    assert _stored_keys(cj) == 1
    mj = open_("memory")
    assert not mj.enabled
    assert _stored_keys(cj) == 0  # an earlier durable run's keys never come back
    opened_with = mj.transactions
    for i in range(5):
        mj.write(_change(i))
    assert mj.transactions == opened_with
    assert _stored_keys(cj) == 0
    assert not mj.cut() and mj.cuts == 0
    assert mj.load()["partitions"] == {}


def test_buffer_cuts_only_what_was_committed_since_the_last_cut(journal):
    """A cut is due once something was committed and the interval passed; it is one FULL
    transaction recording its number, after which the connection is NORMAL again."""
    cj, open_ = journal
    mj = open_("buffer", 0.5)
    t0 = mj._last_cut
    assert not mj.cut_due(t0 + 10)  # nothing committed yet
    assert not mj.cut()
    mj.write(_change(0))
    assert not mj.cut_due(t0 + 0.1)  # within the interval
    assert mj.cut_due(t0 + 0.5)
    assert mj.cut() and mj.cuts == 1
    assert _synchronous(mj) == 1
    assert mj.load()["markers"][DURABLE_CUT].split()[0] == "1"
    assert not mj.cut_due(mj._last_cut + 10)  # the cut's own write does not call for another
    assert not mj.cut()
    mj.write(_change(1))
    mj.write(_change(2))
    assert mj.cut() and mj.cuts == 2  # one cut for every commit since the last one
    assert mj.load()["markers"][DURABLE_CUT].split()[0] == "2"


def test_a_cut_runs_one_full_synchronous_commit(journal, monkeypatch):
    """The cut's commit is the one that runs under synchronous FULL (SQLite fsyncs the WAL
    after such a commit): the statements on the connection say so, in order."""
    cj, open_ = journal
    mj = open_("buffer")
    mj.write(_change())
    seen = []
    mj._db.set_trace_callback(seen.append)
    try:
        assert mj.cut()
    finally:
        mj._db.set_trace_callback(None)
    full = seen.index("PRAGMA synchronous=FULL")
    commit = seen.index("COMMIT")
    normal = seen.index("PRAGMA synchronous=NORMAL")
    assert full < commit < normal


@pytest.mark.parametrize("durability", ["memory", "controller", "sync"])
def test_only_buffer_makes_cuts(journal, durability):
    _cj, open_ = journal
    mj = open_(durability)
    mj.write(_change())
    assert not mj.cut_due(mj._last_cut + 3600)


@pytest.mark.parametrize("old, new", [("full", "controller"), ("normal", "controller"),
                                      ("off", "memory")])
def test_earlier_values_still_work_with_a_deprecation_warning(journal, old, new):
    _cj, open_ = journal
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated; use '{new}'"):
        mj = open_(old)
    assert mj.durability == new
    with pytest.warns(DeprecationWarning):
        assert check_durability(old) == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_durability("buffer") == "buffer"


@pytest.mark.parametrize("bad", ["", "fsync", "FULL", None])
def test_unknown_settings_are_refused_naming_the_choices(journal, bad):
    _cj, open_ = journal
    with pytest.raises(ValueError, match="memory, controller, buffer, sync"):
        open_(bad)


@pytest.mark.parametrize("bad", [0, -1, "x", float("nan"), float("inf")])
def test_bad_flush_intervals_are_refused(journal, bad):
    _cj, open_ = journal
    with pytest.raises(ValueError, match="flush_interval_s"):
        open_("buffer", bad)


def test_check_durability_is_the_shared_check():
    assert meta.DURABILITY == dur.DURABILITY
    assert check_durability("sync") == dur.check("sync")
