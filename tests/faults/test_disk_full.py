"""Full disks and failing journals, on a real small tmpfs (issue 33, item 3).

A controller whose journal write fails answers with an OSError (``JournalWriteError``)
carrying the errno and the journal's path, logs one line for the failures (rate-limited),
not a traceback each; once space comes back everything works without a restart. The same
for a dump journal, a dump target and a log file (which drops its records rather than
printing "--- Logging error ---"). The tmpfs is mounted per test (the tests run as root);
where mounting is impossible they are skipped, saying why.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import api
from tqtx.errors import JournalWriteError

# dense columns compared: strict mode (docs/compatibility.md)
pytestmark = [pytest.mark.timeout(300), pytest.mark.strict]


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size) -> path``: a tmpfs of ``size`` mounted under tmp_path, unmounted after."""
    mounted = []

    def mount(size: str = "4m"):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): "
                        f"{r.stderr.strip() or r.returncode}")
        mounted.append(where)
        return where

    tq.close()  # each test starts its own deployment
    yield mount
    tq.close()
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(where) -> str:
    """Fill the file system of ``where`` to the last byte; returns the filler's path."""
    path = os.path.join(where, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            block = b"\0" * chunk
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return path


def _put(key: str, value: float):
    tq.kv_put(key, "p", {"x": torch.full((4,), value)}, tag={"note": "n" * 100})


def test_controller_journal_on_a_full_disk(tmpfs, tmp_path, capfd):
    mnt = tmpfs("4m")
    state = mnt / "state"
    logs = tmp_path / "logs"  # readable while the disk is full: the logs dir lives elsewhere
    logs.mkdir()
    state.mkdir()
    (state / "logs").symlink_to(logs)
    cfg = tq.init({"state_dir": str(state)})
    _put("before", 1.0)
    filler = fill(mnt)
    failures = []
    for i in range(60):  # SQLite may first fill pages it already has: a bounded run of puts
        try:
            _put(f"k{i}", float(i))
        except OSError as exc:
            failures.append(exc)
    assert len(failures) >= 50, len(failures)
    for exc in failures:
        assert isinstance(exc, JournalWriteError) and exc.errno == errno.ENOSPC, repr(exc)
        assert exc.filename == str(state / "journal.sqlite"), exc.filename
        assert "No space left on device" in str(exc)
    stored = set(tq.kv_list("p")["p"])
    assert "before" in stored and len(stored) == 61 - len(failures)
    # the failed puts' rows went with them: the units hold the stored keys' rows only
    assert sum(u["rows"] for u in tq.get_client().stats()["units"]) == len(stored)
    # a key that existed: its new value is read from the put's PUT_ROWS on; the failed
    # commit leaves its earlier tag, and the error says so
    with pytest.raises(JournalWriteError, match="not committed: no new key of it was stored; "
                       "a key that existed already reads the values this put wrote") as info:
        tq.kv_put("before", "p", {"x": torch.full((4,), 7.0)}, tag={"note": "changed"})
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(
        state / "journal.sqlite") and "No space left on device" in str(info.value)
    assert tq.kv_list("p")["p"]["before"] == {"note": "n" * 100}
    assert tq.kv_batch_get(["before"], "p")["x"][0].tolist() == [7.0] * 4
    log = (logs / "controller.log").read_text()
    lines = [ln for ln in log.splitlines() if "COMMIT_PUT failed" in ln]
    assert len(lines) == 1, lines  # one line for the run of failures, no traceback
    assert "JournalWriteError: [Errno 28]" in lines[0] and "Traceback" not in log

    os.unlink(filler)  # space is back: no restart needed
    for i in range(60):
        _put(f"k{i}", float(i))
    _put("before", 1.0)
    got = tq.kv_batch_get([f"k{i}" for i in range(60)] + ["before"], "p")["x"][:, 0]
    assert got.tolist() == [float(i) for i in range(60)] + [1.0]
    assert api._deployment_handle().procs["controller"].pid == cfg["pids"]["controller"]
    tq.close()
    assert "--- Logging error ---" not in capfd.readouterr().err


def test_a_whole_state_dir_on_a_full_disk_logs_no_flood(tmpfs, tmp_path, capfd):
    """The logs on the full disk too, and every failure logged (no rate limit here): the
    controller's log file drops its records (said once, on stderr), no "--- Logging error
    ---"; the units keep serving; with space back the log says how many were dropped."""
    mnt = tmpfs("4m")
    state = mnt / "state"
    tq.init({"state_dir": str(state), "env": {"TQTX_IO_ERROR_LOG_EVERY": "0"}})
    _put("before", 1.0)
    filler = fill(mnt)
    failed = 0
    for i in range(300):
        try:
            _put(f"k{i}", float(i))
        except JournalWriteError:
            failed += 1
    assert failed >= 250, failed
    assert tq.kv_batch_get(["before"], "p")["x"].tolist() == [[1.0] * 4]
    err = capfd.readouterr().err
    assert "--- Logging error ---" not in err and "Traceback" not in err, err[-3000:]
    said = [ln for ln in err.splitlines() if "cannot write log file" in ln]
    assert len(said) == 1 and "controller.log" in said[0], err[-3000:]
    os.unlink(filler)
    _put("after", 2.0)
    assert tq.kv_batch_get(["after"], "p")["x"].tolist() == [[2.0] * 4]
    tq.dump_data_by_key(tmp_path / "dump", ["after"], "p")  # the controller logs it
    log = (state / "logs" / "controller.log").read_text()
    assert "records were dropped while it could not" in log
    assert "Traceback" not in log
    tq.close()
    assert "--- Logging error ---" not in capfd.readouterr().err


def test_dump_target_and_its_journal_on_a_full_disk(tmpfs, tmp_path):
    mnt = tmpfs("4m")
    tq.init({"state_dir": str(tmp_path / "state")})
    tq.kv_batch_put(["a", "b"], "p", TensorDict({"x": torch.ones(2, 4)}, batch_size=[2]))
    dump = mnt / "dump"
    first = tq.dump_data_by_key(dump, ["a"], "p")
    filler = fill(mnt)
    with pytest.raises(OSError) as ei:
        tq.dump_data_by_key(dump, ["a", "b"], "p")
    assert ei.value.errno == errno.ENOSPC and str(mnt) in str(ei.value.filename), ei.value
    assert tq.read_row_index(dump)["dump_id"] == first["dump_id"]  # the old dump stands
    os.unlink(filler)
    again = tq.dump_data_by_key(dump, ["a", "b"], "p")  # no restart
    assert sorted(tq.read_row_index(dump)["rows"]) == ["a", "b"]
    assert again["dump_id"] != first["dump_id"]


def test_dump_journal_write_on_a_full_disk_is_an_oserror_naming_it(tmpfs):
    from tqtx.journal.dump import DumpJournal
    mnt = tmpfs("1m")
    with DumpJournal(mnt / "d") as j:
        j.begin_publication(attempt_id="first", kind="dump", dump_id="x",
                            staging_dir=mnt / "d.tmp-first")
        filler = fill(mnt)
        with pytest.raises(JournalWriteError) as ei:
            for i in range(2000):  # until the journal needs a page the disk does not have
                j.begin_publication(attempt_id=f"a{i}" + "x" * 200, kind="dump", dump_id="x",
                                    staging_dir=mnt / f"d.tmp-{i}")
        assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
        assert ei.value.filename == str(mnt / "d.journal.sqlite")
        os.unlink(filler)
        j.begin_publication(attempt_id="after", kind="dump", dump_id="x",
                            staging_dir=mnt / "d.tmp-after")
        assert j.get_publication("after")["phase"] == "staging"


def test_a_log_file_on_a_full_disk_drops_records_and_says_so_once(tmpfs):
    mnt = tmpfs("1m")
    script = f"""
import logging, os, sys
sys.path.insert(0, {os.getcwd()!r})
from tqtx.process.logutil import DiskSafeFileHandler
h = DiskSafeFileHandler({str(mnt / 'unit.log')!r})
log = logging.getLogger('t'); log.addHandler(h); log.setLevel(logging.INFO); log.propagate = False
log.info('before')
fd = os.open({str(mnt / 'filler')!r}, os.O_WRONLY | os.O_CREAT)
for chunk in (1 << 16, 1 << 12, 1):
    while True:
        try: os.write(fd, b'\\0' * chunk)
        except OSError: break
os.close(fd)
for i in range(500):
    log.info('record %d of a burst written while the disk is full', i)
print('DROPPED', h.dropped, flush=True)
os.unlink({str(mnt / 'filler')!r})
log.info('after')
h.close()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--- Logging error ---" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "cannot write log file" in ln]
    assert len(said) == 1 and "No space left on device" in said[0], r.stderr
    dropped = int(r.stdout.split("DROPPED")[1])
    assert dropped > 400
    text = (mnt / "unit.log").read_text()
    assert "before" in text and "after" in text
    assert f"{dropped} records were dropped" in text.split("after", 1)[1]
