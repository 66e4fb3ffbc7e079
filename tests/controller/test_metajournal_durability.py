"""The controller's metadata journal under each durability setting (tqtx.journal.meta)."""
from __future__ import annotations

import errno
import sqlite3
import warnings

import pytest

from tqtx import durability as dur
from tqtx.errors import JournalWriteError
from tqtx.journal import meta
from tqtx.journal.meta import MetaChange, MetaJournal, check_durability
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
    """A cut is due once something was committed and the interval passed; the connection
    stays NORMAL (the cut fsyncs the WAL, see below)."""
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
    assert not mj.cut_due(mj._last_cut + 10)  # nothing committed since
    assert not mj.cut()
    mj.write(_change(1))
    mj.write(_change(2))
    assert mj.cut() and mj.cuts == 2  # one cut for every commit since the last one


def test_a_cut_fsyncs_the_wal_and_writes_nothing(journal, monkeypatch):
    """A cut is one fsync of the WAL (which holds every commit not yet checkpointed into
    the database file): no statement on the connection, the stored state unchanged."""
    cj, open_ = journal
    mj = open_("buffer")
    mj.write(_change())
    before = mj.load()
    synced, seen = [], []
    real = meta.fsutil.fsync_file
    monkeypatch.setattr(meta.fsutil, "fsync_file", lambda p: (synced.append(str(p)), real(p)))
    mj._db.set_trace_callback(seen.append)
    try:
        assert mj.cut()
    finally:
        mj._db.set_trace_callback(None)
    assert synced == [mj.path + "-wal"] and seen == []
    assert mj.load() == before


def test_a_failed_cut_names_the_journal_and_is_tried_again(journal, monkeypatch):
    cj, open_ = journal
    mj = open_("buffer")
    mj.write(_change())

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(meta.fsutil, "fsync_file", full)
    with pytest.raises(JournalWriteError) as info:
        mj.cut()
    assert info.value.errno == errno.ENOSPC and info.value.filename == mj.path
    assert mj.dirty and mj.cuts == 0
    monkeypatch.undo()
    assert mj.cut() and mj.cuts == 1 and not mj.dirty


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
