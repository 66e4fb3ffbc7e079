"""A dump or checkpoint never destroys what is not tqtx's (issue 12, item 1).

Every target that is not a tqtx dump -- a directory with files, a regular file, an empty or
blank path, the working directory, the root, a symlink to a directory, a dump of the other
kind -- is refused before anything is touched: the whole tree around the target hashes the
same before and after (not even a ``.lock`` is created). A user's ``<dump>.old`` and
``<dump>.tmp-foo`` beside a real dump survive re-dumps and recovery.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import tqtx as tq
from tqtx import TargetNotADumpError
from tqtx.journal.publish import dump_lock, recover_publications
from treehash import assert_unchanged, snapshot, tqtx_own

pytestmark = pytest.mark.strict  # the tests compare dense columns

KINDS = ["dump", "checkpoint"]


def _put(pid: str, n: int = 4, value: float = 1.0) -> list[str]:
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, pid, {"x": torch.full((n, 3), value)})
    return keys


def _publish(kind: str, target, pid: str, keys):
    if kind == "dump":
        return tq.dump_data_by_key(target, keys, pid)
    return tq.save_checkpoint(target, metadata={"note": "test"})


@pytest.fixture
def area(tmp_path):
    """A directory holding only what the test puts there (the state dir is elsewhere)."""
    a = tmp_path / "area"
    a.mkdir()
    return a


def _user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(os.urandom(4096))
    (path / "sub").mkdir()
    (path / "sub" / "notes.txt").write_text("mine")
    return path


def _refused(kind, target, pid, keys, root: Path, *, exc=TargetNotADumpError, names=None,
             says=None):
    """Publishing at ``target`` raises ``exc`` naming ``names`` (default: the target),
    and nothing below ``root`` changed."""
    before = snapshot(root)
    with pytest.raises(exc) as info:
        _publish(kind, target, pid, keys)
    msg = str(info.value)
    if names is not None:
        assert names in msg, msg
    if says is not None:
        assert re.search(says, msg), msg
    assert_unchanged(before, snapshot(root))
    return info.value


@pytest.mark.parametrize("kind", KINDS)
def test_directory_with_files_is_refused(tq_shared, pid, area, kind):
    keys = _put(pid)
    target = _user_dir(area / "ckpt" / "step_100")
    err = _refused(kind, target, pid, keys, area, names=str(target),
                   says=r"holding 2 entries \('model.pt', 'sub'\).*not a tqtx")
    assert isinstance(err, FileExistsError) and err.path == str(target)
    assert not (area / "ckpt" / "step_100.lock").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_regular_file_is_refused(tq_shared, pid, area, kind):
    keys = _put(pid)
    target = area / "weights.bin"
    target.write_bytes(os.urandom(1000))
    _refused(kind, target, pid, keys, area, names=str(target), says="existing file")
    _refused(kind, target / "inside", pid, keys, area, names=str(target / "inside"),
             says=f"{target} is an existing file")


@pytest.mark.parametrize("kind", KINDS)
def test_symlink_to_directory_is_refused(tq_shared, pid, area, kind):
    keys = _put(pid)
    real = _user_dir(area / "real")
    link = area / "link"
    link.symlink_to(real, target_is_directory=True)
    _refused(kind, link, pid, keys, area, names=str(link), says="symbolic link")
    # a symlink to a real dump is refused too: tqtx would replace the link, not the dump
    if kind == "dump":
        tq.dump_data_by_key(area / "d", keys, pid)
        (area / "dlink").symlink_to(area / "d", target_is_directory=True)
        _refused(kind, area / "dlink", pid, keys, area, names=str(area / "dlink"),
                 says="symbolic link")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("empty_cwd", [False, True])
def test_working_directory_is_refused(tq_shared, pid, area, kind, empty_cwd, monkeypatch):
    keys = _put(pid)
    work = area / "work"
    work.mkdir()
    if not empty_cwd:
        (work / "train.py").write_text("print('hi')")
    monkeypatch.chdir(work)
    _refused(kind, ".", pid, keys, area, names=str(work), says="working directory")
    _refused(kind, str(work), pid, keys, area, names=str(work), says="working directory")
    # a parent of the working directory is refused as well
    _refused(kind, str(area), pid, keys, area, names=str(area),
             says="contains the working directory")


@pytest.mark.parametrize("kind", KINDS)
def test_root_is_refused(tq_shared, pid, kind):
    keys = _put(pid)
    with pytest.raises(TargetNotADumpError, match="filesystem root"):
        _publish(kind, "/", pid, keys)
    assert not os.path.lexists("/.lock")


@pytest.mark.parametrize("path", ["", "   ", "\t\n"])
def test_empty_or_blank_path_is_value_error(tq_shared, pid, area, path, monkeypatch):
    keys = _put(pid)
    monkeypatch.chdir(area)
    (area / "keep.txt").write_text("x")
    before = snapshot(area)
    calls = [lambda: tq.dump_data_by_key(path, keys, pid),
             lambda: tq.dump_data_by_key(path, keys, pid, block=False),
             lambda: tq.load_data_by_key(path),
             lambda: tq.save_checkpoint(path),
             lambda: tq.load_checkpoint(path),
             lambda: tq.read_row_index(path),
             lambda: tq.recover_data_load(path)]
    for call in calls:
        with pytest.raises(ValueError, match="non-empty path"):
            call()
    assert_unchanged(before, snapshot(area))


def test_dump_of_the_other_kind_is_refused(tq_shared, pid, area):
    keys = _put(pid)
    tq.dump_data_by_key(area / "d", keys, pid)
    tq.save_checkpoint(area / "c")
    _refused("checkpoint", area / "d", pid, keys, area, names=str(area / "d"),
             says="is a tqtx dump, not a checkpoint")
    _refused("dump", area / "c", pid, keys, area, names=str(area / "c"),
             says="is a tqtx checkpoint, not a dump")


@pytest.mark.parametrize("kind", KINDS)
def test_replacing_own_dump_and_empty_dir_works(tq_shared, pid, area, kind):
    """An empty directory (nothing to lose) and an earlier tqtx dump of the same kind are
    replaced; nothing but the target and its lock and journal files changes."""
    keys = _put(pid, value=1.0)
    _user_dir(area / "neighbour")
    target = area / "empty"
    target.mkdir()
    before = snapshot(area)
    _publish(kind, target, pid, keys)
    assert_unchanged(before, snapshot(area), tqtx_own(area, target))
    assert (target / ("dump_info.json" if kind == "dump" else "checkpoint_info.json")).is_file()

    _put(pid, value=2.0)  # same keys, new values
    before = snapshot(area)
    _publish(kind, target, pid, keys)
    assert_unchanged(before, snapshot(area), tqtx_own(area, target))
    tq.kv_clear(keys, pid)
    if kind == "dump":
        tq.load_data_by_key(target)
    else:
        tq.load_checkpoint(target)
    got = tq.kv_batch_get(keys, pid)
    assert torch.equal(got["x"], torch.full((len(keys), 3), 2.0))


@pytest.mark.parametrize("kind", KINDS)
def test_users_old_and_tmp_beside_a_dump_survive(tq_shared, pid, area, kind):
    """``<dump>.old`` and ``<dump>.tmp-foo`` that no journal row accounts for are the
    user's: recovery never touches them; ``.tmp-foo`` does not stop a re-dump, ``.old``
    (the name tqtx swaps through) makes it refuse, naming ``.old``."""
    keys = _put(pid)
    target = area / "d"
    _publish(kind, target, pid, keys)
    _user_dir(area / "d.tmp-foo")
    before = snapshot(area)
    _publish(kind, target, pid, keys)  # re-dump with a user's .tmp-foo beside it
    assert_unchanged(before, snapshot(area), tqtx_own(area, target))

    _user_dir(area / "d.old")
    _refused(kind, target, pid, keys, area, names=str(area / "d.old"),
             says="no publication in the dump journal made it")
    before = snapshot(area)
    with dump_lock(target):
        assert recover_publications(target) == []
    if kind == "dump":
        assert tq.recover_data_load(target) is True
        tq.load_data_by_key(target)  # runs recovery under the lock too
    else:
        tq.load_checkpoint(target)
    assert_unchanged(before, snapshot(area), tqtx_own(area, target))
