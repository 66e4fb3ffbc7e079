"""Crash-safe dump publication: commit, abort and recovery after a crash at every phase."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from filelock import Timeout

from tqtx import faults
from tqtx.journal.publish import Publication, dump_lock, publish_dir_size, recover_publications
from tqtx.layout.fsutil import fsync_dir, fsync_file
from tqtx.journal.dump import DumpJournal
from tqtx.states import IllegalTransition
from tqtx.layout.paths import dump_journal_path

PHASES = ["staging", "written", "synced", "old_moved", "published", "cleaned"]
JOURNAL_PHASE = {"old_moved": "old-moved"}


@pytest.fixture(autouse=True)
def _no_faults():
    faults.configure("")
    yield
    faults.configure("")


def tree(path: Path) -> dict[str, str]:
    """{relative path: content} of every file below ``path``."""
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


# The smallest manifest tqtx.layout.paths.manifest_kind takes for a dump: only a tqtx dump (or an
# empty directory) may be replaced by a publication.
DUMP_MANIFEST = ('{"format_version": 1, "dump_id": "d", "partition_id": "p", '
                 '"row_index": {}, "shards": []}')
CKPT_MANIFEST = '{"format_version": 1, "kind": "tqtx-checkpoint"}'
OLD = {"dump_info.json": DUMP_MANIFEST, "meta.json": "old", "shards/0.bin": "old-0"}
NEW = {"dump_info.json": DUMP_MANIFEST, "meta.json": "new", "shards/0.bin": "new-0",
       "shards/1.bin": "new-1"}


def write(root: Path, files: dict[str, str]) -> None:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)


def siblings(dump: Path) -> list[str]:
    """Names next to the dump other than the journal, its lock files and the dump lock."""
    skip = (".journal.sqlite", ".lock", ".migrate.lock", "-journal")
    return sorted(p.name for p in dump.parent.iterdir()
                  if p.name != dump.name and not p.name.endswith(skip))


def publish(dump: Path, files: dict[str, str], fault: str = "", kind: str = "dump"
            ) -> Publication | None:
    """Publish ``files`` as ``dump``; with ``fault`` the given point raises (a simulated crash)."""
    faults.configure(f"publish.after_{fault}:raise" if fault else "")
    pub = None
    with dump_lock(dump), DumpJournal(dump) as j:
        try:
            pub = Publication(dump, kind=kind, dump_id="d1", journal=j)
            write(pub.staging_dir, files)
            pub.mark_written()
            pub.commit()
        except faults.InjectedFault:
            pass
    faults.configure("")
    return pub


def phases(dump: Path) -> list[str]:
    with DumpJournal(dump) as j:
        return [p["phase"] for p in j.publications()]


def test_commit_publishes_and_replaces(tmp_path):
    dump = tmp_path / "ckpt" / "buf"
    old = {"checkpoint_info.json": CKPT_MANIFEST, "meta.json": "old"}
    new = {"checkpoint_info.json": CKPT_MANIFEST, "meta.json": "new", "units/0.bin": "new-0"}
    publish(dump, old, kind="checkpoint")
    assert tree(dump) == old
    with dump_lock(dump), DumpJournal(dump) as j:
        pub = Publication(dump, kind="checkpoint", dump_id="d2", journal=j)
        assert pub.staging_dir == dump.parent / f"buf.tmp-{pub.attempt_id}"
        assert len(pub.attempt_id) == 12
        write(pub.staging_dir, new)
        pub.mark_written()
        size = pub.commit()
        assert size == sum(len(v) for v in new.values()) == publish_dir_size(dump)
        row = j.get_publication(pub.attempt_id)
        assert row["phase"] == "cleaned" and row["kind"] == "checkpoint"
    assert tree(dump) == new
    assert siblings(dump) == []
    assert dump_journal_path(dump) == dump.parent / "buf.journal.sqlite"
    assert dump_journal_path(dump).exists() and (dump.parent / "buf.lock").exists()
    with dump_lock(dump):
        assert recover_publications(dump) == []


@pytest.mark.parametrize("fault", PHASES[:3])
def test_abort_before_swap_keeps_old(tmp_path, fault):
    dump = tmp_path / "buf"
    publish(dump, OLD)
    faults.configure(f"publish.after_{fault}:raise")
    with dump_lock(dump), DumpJournal(dump) as j:
        pub = Publication.__new__(Publication)
        try:
            pub = Publication(dump, dump_id="d2", journal=j)
            write(pub.staging_dir, NEW)
            pub.mark_written()
            pub.commit()
        except faults.InjectedFault:
            if not hasattr(pub, "attempt_id"):  # raised inside the constructor
                pub = None
        faults.configure("")
        if pub is not None:
            pub.abort("writer failed")
            assert j.get_publication(pub.attempt_id)["phase"] == "failed"
            assert j.get_publication(pub.attempt_id)["error"] == "writer failed"
    assert tree(dump) == OLD
    if pub is not None:
        assert siblings(dump) == []


def test_abort_after_old_moved_rolls_back(tmp_path):
    dump = tmp_path / "buf"
    publish(dump, OLD)
    faults.configure("publish.after_old_moved:raise")
    with dump_lock(dump), DumpJournal(dump) as j:
        pub = Publication(dump, dump_id="d2", journal=j)
        write(pub.staging_dir, NEW)
        with pytest.raises(faults.InjectedFault):
            pub.commit()
        assert not dump.exists()
        pub.abort("controller gave up")
        assert j.get_publication(pub.attempt_id)["phase"] == "rolled-back"
    assert tree(dump) == OLD and siblings(dump) == []


def test_abort_after_published_rolls_forward(tmp_path):
    dump = tmp_path / "buf"
    publish(dump, OLD)
    faults.configure("publish.after_published:raise")
    with dump_lock(dump), DumpJournal(dump) as j:
        pub = Publication(dump, dump_id="d2", journal=j)
        write(pub.staging_dir, NEW)
        with pytest.raises(faults.InjectedFault):
            pub.commit()
        pub.abort("late failure")
        assert j.get_publication(pub.attempt_id)["phase"] == "cleaned"
    assert tree(dump) == NEW and siblings(dump) == []


# Phase a crash left the journal in -> (expected dump contents, final phase, action)
EXPECTED = {
    "staging": (OLD, "rolled-back", "rolled-back"),
    "written": (OLD, "rolled-back", "rolled-back"),
    "synced": (OLD, "rolled-back", "rolled-back"),
    "old_moved": (NEW, "cleaned", "rolled-forward"),
    "published": (NEW, "cleaned", "cleaned"),
    "cleaned": (NEW, "cleaned", None),
}


@pytest.mark.parametrize("fault", PHASES)
def test_recover_after_crash_at_each_phase(tmp_path, fault):
    dump = tmp_path / "buf"
    publish(dump, OLD)
    publish(dump, NEW, fault=fault)
    assert phases(dump)[0] == JOURNAL_PHASE.get(fault, fault)
    want, final, action = EXPECTED[fault]
    with dump_lock(dump):
        actions = recover_publications(dump)
        assert [a["action"] for a in actions] == ([action] if action else [])
        assert all(a["kind"] == "publication" and a["target"] == str(dump) for a in actions)
        assert recover_publications(dump) == []  # idempotent
    assert tree(dump) == want
    assert siblings(dump) == []
    assert phases(dump) == [final, "cleaned"]
    with DumpJournal(dump) as j:
        assert j.unfinished_publications() == []


@pytest.mark.parametrize("fault", ["synced", "old_moved"])
def test_recover_first_publication(tmp_path, fault):
    dump = tmp_path / "buf"
    publish(dump, NEW, fault=fault)
    with dump_lock(dump):
        recover_publications(dump)
    if fault == "synced":
        assert not dump.exists()
    else:
        assert tree(dump) == NEW
    assert siblings(dump) == []


def test_recover_crash_between_rename_and_journal(tmp_path):
    # Old dump renamed to .old but phase still "synced": roll back and restore it.
    dump = tmp_path / "buf"
    publish(dump, OLD)
    publish(dump, NEW, fault="synced")
    os.rename(dump, tmp_path / "buf.old")
    with dump_lock(dump):
        assert [a["action"] for a in recover_publications(dump)] == ["rolled-back"]
    assert tree(dump) == OLD and siblings(dump) == []

    # Staging renamed into place but phase still "old-moved": roll forward.
    publish(dump, NEW, fault="old_moved")
    staging = next(p for p in tmp_path.iterdir() if ".tmp-" in p.name)
    os.rename(staging, dump)
    with dump_lock(dump):
        assert [a["action"] for a in recover_publications(dump)] == ["rolled-forward"]
    assert tree(dump) == NEW and siblings(dump) == []


def test_recover_leaves_what_no_journal_row_accounts_for(tmp_path):
    """A ``.old`` or ``.tmp-*`` beside a dump that no publication row names is not tqtx's:
    recovery never renames or deletes it (with or without a journal)."""
    dump = tmp_path / "buf"
    write(tmp_path / "buf.old", OLD)
    write(tmp_path / "buf.tmp-abc", NEW)
    with dump_lock(dump):
        assert recover_publications(dump) == []
    assert not dump.exists()
    assert tree(tmp_path / "buf.old") == OLD and tree(tmp_path / "buf.tmp-abc") == NEW
    assert not dump_journal_path(dump).exists()  # recovery never creates a journal

    other = tmp_path / "other"
    publish(other, OLD)  # a journal with a finished row only
    write(tmp_path / "other.old", OLD)
    write(tmp_path / "other.tmp-abc", NEW)
    with dump_lock(other):
        assert recover_publications(other) == []
    assert tree(other) == OLD
    assert tree(tmp_path / "other.old") == OLD and tree(tmp_path / "other.tmp-abc") == NEW


def test_commit_refuses_a_target_that_is_not_a_dump(tmp_path):
    """The target changed under a running publication (a user's file appeared in the empty
    directory, or a ``.old`` appeared): commit refuses and abort leaves all of it alone."""
    from tqtx.errors import TargetNotADumpError
    dump = tmp_path / "buf"
    dump.mkdir()
    for intruder in (dump / "model.pt", tmp_path / "buf.old"):
        with dump_lock(dump), DumpJournal(dump) as j:
            pub = Publication(dump, dump_id="d2", journal=j)
            write(pub.staging_dir, NEW)
            pub.mark_written()
            intruder.write_text("user data")
            with pytest.raises(TargetNotADumpError, match=str(intruder)
                               if intruder.name == "buf.old" else str(dump)):
                pub.commit()
            pub.abort("refused")
            assert j.get_publication(pub.attempt_id)["phase"] == "failed"
        assert intruder.read_text() == "user data"
        assert not pub.staging_dir.exists()
        with dump_lock(dump):
            assert recover_publications(dump) == []
        assert intruder.read_text() == "user data"
        intruder.unlink()


def test_recover_ignores_a_row_whose_staging_is_not_beside_the_dump(tmp_path):
    """A journal row naming a staging dir elsewhere (a damaged or hostile journal) never
    makes recovery delete that directory."""
    dump = tmp_path / "buf"
    victim = tmp_path / "elsewhere"
    write(victim, {"keep.txt": "mine"})
    with DumpJournal(dump) as j:
        j.begin_publication(attempt_id="a1", kind="dump", dump_id=None, staging_dir=str(victim))
    with dump_lock(dump):
        assert [a["action"] for a in recover_publications(dump)] == ["ignored"]
    assert tree(victim) == {"keep.txt": "mine"}


def test_phase_rules(tmp_path):
    with DumpJournal(tmp_path / "buf") as j:
        j.begin_publication(attempt_id="a", kind="dump", dump_id=None, staging_dir="s")
        assert j.begin_publication(attempt_id="a", kind="dump", dump_id="x",
                                   staging_dir="t")["staging_dir"] == "s"
        j.set_phase("a", "written")
        j.set_phase("a", "written")  # same phase: no-op
        with pytest.raises(IllegalTransition, match="'a'.*written -> staging"):
            j.set_phase("a", "staging")
        j.set_phase("a", "old-moved")
        with pytest.raises(IllegalTransition, match="old-moved -> failed"):
            j.set_phase("a", "failed")
        j.set_phase("a", "published")
        with pytest.raises(IllegalTransition, match="published -> rolled-back"):
            j.set_phase("a", "rolled-back")
        j.set_phase("a", "cleaned")
        with pytest.raises(IllegalTransition):
            j.set_phase("a", "published")
        j.begin_publication(attempt_id="b", kind="dump", dump_id=None, staging_dir="s")
        j.set_phase("b", "failed", "boom")
        with pytest.raises(IllegalTransition, match="failed -> rolled-back"):
            j.set_phase("b", "rolled-back")
        j.begin_publication(attempt_id="c", kind="checkpoint", dump_id=None, staging_dir="s")
        assert [p["attempt_id"] for p in j.unfinished_publications()] == ["c"]
        with pytest.raises(ValueError):
            j.begin_publication(attempt_id="d", kind="bogus", dump_id=None, staging_dir="s")


def test_dump_lock_serializes(tmp_path):
    dump = tmp_path / "buf"
    with dump_lock(dump):
        with pytest.raises(Timeout):
            dump_lock(dump, timeout=0.05).acquire()
    with dump_lock(dump, timeout=0.05):
        pass


def test_fsync_helpers(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    fsync_file(f)
    fsync_dir(tmp_path)
    assert publish_dir_size(tmp_path) == 10


def test_fsync_tree_files_false_fsyncs_only_directories(tmp_path, monkeypatch):
    from tqtx.layout import fsutil
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 7)
    (tmp_path / "b").write_bytes(b"y" * 3)
    (tmp_path / "link").symlink_to(tmp_path / "b")  # not counted, as before
    synced = {"file": [], "dir": []}
    monkeypatch.setattr(fsutil, "fsync_file", lambda p: synced["file"].append(os.path.basename(p)))
    real_dir = fsutil.fsync_dir
    monkeypatch.setattr(fsutil, "fsync_dir", lambda p: (synced["dir"].append(p), real_dir(p)))
    assert fsutil.fsync_tree(tmp_path) == 10
    assert sorted(synced["file"]) == ["a", "b"] and len(synced["dir"]) == 2
    synced["file"].clear()
    synced["dir"].clear()
    assert fsutil.fsync_tree(tmp_path, files=False) == 10
    assert synced["file"] == [] and len(synced["dir"]) == 2  # the directories still are


def test_commit_files_synced_publishes_the_same(tmp_path, monkeypatch):
    from tqtx.journal import publish as pubmod
    calls = []
    real = pubmod.fsync_tree
    monkeypatch.setattr(pubmod, "fsync_tree", lambda root, files=True: (calls.append(files),
                                                                        real(root, files=files))[1])
    dump = tmp_path / "buf"
    new = {"checkpoint_info.json": CKPT_MANIFEST, "units/0.bin": "new-0"}
    with dump_lock(dump), DumpJournal(dump) as j:
        pub = Publication(dump, kind="checkpoint", dump_id="d1", journal=j)
        write(pub.staging_dir, new)
        pub.mark_written()
        assert pub.commit(files_synced=True) == sum(len(v) for v in new.values())
        assert j.get_publication(pub.attempt_id)["phase"] == "cleaned"
    assert calls == [False] and tree(dump) == new and siblings(dump) == []


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tqtx.journal.publish import Publication, dump_lock
    from tqtx.journal.dump import DumpJournal
    dump = Path(sys.argv[1])
    with dump_lock(dump), DumpJournal(dump) as j:
        pub = Publication(dump, dump_id="d2", journal=j)
        for i in range(3):
            (pub.staging_dir / f"new-{i}").write_text("new" * 100)
        pub.mark_written()
        pub.commit()
    print("done")
""")


@pytest.mark.parametrize("point,expect", [("old_moved", "new"), ("synced", "old"),
                                          ("published", "new")])
def test_killed_child_recovers_to_old_or_new(tmp_path, point, expect):
    dump = tmp_path / "buf"
    write(dump, {"dump_info.json": DUMP_MANIFEST, "old-0": "old"})
    env = dict(os.environ, TQTX_FAULTS=f"publish.after_{point}:kill")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(dump)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    with dump_lock(dump):
        recover_publications(dump)
    contents = tree(dump)
    old = {"dump_info.json": DUMP_MANIFEST, "old-0": "old"}
    new = {f"new-{i}": "new" * 100 for i in range(3)}
    assert contents == (new if expect == "new" else old)
    assert siblings(dump) == []
