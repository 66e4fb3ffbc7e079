"""A dump on read-only storage loads (issue 12, item 6).

Loading, ``read_row_index``, ``tqtx verify`` and ``tqtx inspect`` work on a dump whose
directory cannot be written; its lock and dump-journal records are kept in the controller's
state dir instead (``<state_dir>/dumps/<sha256>.*``), with a WARNING in the log. Publishing
into read-only storage is refused before anything is written.

The storage is made read-only with a read-only bind mount (the tests run as root, which
ignores permission bits; the files are chmod 0444/0555 as well).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

import tqtx as tq
from buffers import assert_same_rows, rollout_batch
from tqtx import ReadOnlyDumpError
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.dump import DumpJournal
from tqtx.layout.paths import JOURNAL_SUFFIX, LOCK_SUFFIX, relocated_path
from treehash import assert_unchanged, snapshot


def _chmod_read_only(root) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o444)
        os.chmod(dirpath, 0o555)


@pytest.fixture
def read_only(tmp_path):
    """``make(src) -> mount point``: a read-only bind mount of ``src``, unmounted at teardown."""
    mounts = []

    def make(src):
        dst = tmp_path / f"ro{len(mounts)}"
        dst.mkdir()
        _chmod_read_only(src)
        r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot bind-mount (needs root and mount rights): {r.stderr.strip()}")
        mounts.append(dst)
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        assert not os.access(dst, os.W_OK)
        return dst

    yield make
    for dst in reversed(mounts):
        if subprocess.run(["umount", str(dst)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(dst)], capture_output=True)
    for dirpath, _dirs, _files in os.walk(tmp_path):
        os.chmod(dirpath, 0o755)  # let pytest clean the source tree up


def test_load_inspect_verify_a_read_only_dump(tq_start, tmp_path, read_only, caplog):
    cfg = tq_start(num_units=2)
    state = cfg["state_dir"]
    keys, td, tags = rollout_batch(12, seed=5)
    tq.kv_batch_put(keys, "src", td, tags=tags)
    src = tmp_path / "src"
    tq.dump_data_by_key(src / "with-siblings" / "d", keys, "src")  # .lock and journal beside it
    (src / "bare").mkdir()
    tq.save_checkpoint(src / "ckpt-ro", metadata={"step": 7})
    shutil.copytree(src / "with-siblings" / "d", src / "bare" / "d")  # the dump alone
    mnt = read_only(src)
    before = snapshot(mnt)

    for dump in (mnt / "with-siblings" / "d", mnt / "bare" / "d"):
        pid = f"ro-{dump.parent.name}"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tqtx.layout.paths"):
            rep = tq.load_data_by_key(dump, partition_id=pid)
        assert rep["keys"] == len(keys)
        assert_same_rows(tq.kv_batch_get(keys, pid), td)
        assert any("read-only" in r.getMessage() and str(dump) in r.getMessage()
                   for r in caplog.records), caplog.text
        journal = relocated_path(state, dump, JOURNAL_SUFFIX)
        assert journal.is_file() and relocated_path(state, dump, LOCK_SUFFIX).is_file()
        with DumpJournal(dump, path=journal) as dj:
            assert [r["state"] for r in dj.list_restores()] == ["committed"]
        assert tq.recover_data_load(dump) is True

        idx = tq.read_row_index(dump)
        assert list(idx["rows"]) == keys and idx["partition_id"] == "src"

        from tqtx.cli import main
        res = CliRunner().invoke(main, ["verify", str(dump), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["ok"] is True
        res = CliRunner().invoke(main, ["inspect", str(dump), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["keys"] == len(keys)
        res = CliRunner().invoke(main, ["journal", "show", str(dump), "--state-dir", state,
                                        "--json"])
        assert res.exit_code == 0, res.output
        shown = json.loads(res.output)
        assert shown["journal"] == str(journal)
        assert [r["state"] for r in shown["restores"]] == ["committed"]
        res = CliRunner().invoke(main, ["journal", "recover", str(dump)])
        assert res.exit_code == 0 and "nothing to recover" in res.output, res.output

    # The journal written beside the dump before the storage became read-only still shows.
    res = CliRunner().invoke(main, ["journal", "show", str(mnt / "with-siblings" / "d"),
                                    "--state-dir", str(tmp_path / "elsewhere"), "--json"])
    assert res.exit_code == 0, res.output
    assert [p["phase"] for p in json.loads(res.output)["publications"]] == ["cleaned"]
    assert not (tmp_path / "elsewhere").exists()

    # Publishing into read-only storage is refused before anything is written anywhere.
    state_before = snapshot(state)
    for target in (mnt / "with-siblings" / "d", mnt / "new"):
        with pytest.raises(ReadOnlyDumpError, match=str(target)):
            tq.dump_data_by_key(target, keys, "src")
    with pytest.raises(ReadOnlyDumpError, match=str(mnt / "ckpt")):
        tq.save_checkpoint(mnt / "ckpt")
    assert_unchanged(state_before, snapshot(state),
                     lambda rel: rel.startswith("journal.sqlite"))  # the controller's own
    assert_unchanged(before, snapshot(mnt))

    # A read-only checkpoint loads too (its lock is kept in the state dir).
    tq.kv_clear(keys, "src")
    tq.load_checkpoint(mnt / "ckpt-ro")
    assert_same_rows(tq.kv_batch_get(keys, "src"), td)
    assert relocated_path(state, mnt / "ckpt-ro", LOCK_SUFFIX).is_file()
    assert_unchanged(before, snapshot(mnt))


def test_startup_replay_finds_a_relocated_dump_journal(tmp_path, read_only):
    """The controller's startup replay marks a read-only dump's 'reading' row aborted in
    the journal kept in its state dir (no processes needed: journals only)."""
    from tqtx.controller.startup import recover_controller_journal
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "dump_info.json").write_text("{}")
    mnt = read_only(src)
    dump, state = mnt / "d", tmp_path / "state"
    with ControllerJournal(state) as j:
        old = j.start_incarnation(pid=1, host="h", address="tcp://127.0.0.1:1", version="t")
        j.begin_restore(restore_id="r1", partition_id="p", dump_dir=str(dump), dump_id="x",
                        incarnation_id=old, units=[0], keys=1, rows=1, bytes=1)
        with DumpJournal(dump, state_dir=state) as dj:
            dj.begin_restore(restore_id="r1", controller_address="tcp://127.0.0.1:1",
                             incarnation_id=old, controller_state_dir=str(state),
                             partition_id="p")
        new = j.start_incarnation(pid=2, host="h", address="tcp://127.0.0.1:2", version="t")
        actions = recover_controller_journal(j, incarnation_id=new)
    assert [a["action"] for a in actions] == ["dump-journal-aborted", "aborted"]
    with DumpJournal(dump, path=relocated_path(state, dump, JOURNAL_SUFFIX)) as dj:
        assert dj.get_restore("r1")["state"] == "aborted"
