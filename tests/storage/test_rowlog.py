"""The row log of a unit (durability buffer / sync): what a unit stored, dropped or replaced
is what a unit opened on the same directory holds again, bit for bit; a torn tail is cut
off; compaction keeps the rows and frees the disk; a clean close removes only the log's
own files."""
from __future__ import annotations

import os
import threading

import pytest

from tqtx.storage import rowlog as rl
from tqtx.storage.unit import StorageUnit
from tqtx.wire.values import RawTensor


def _tensor(seed: int, n: int = 64) -> RawTensor:
    return RawTensor("int32", (n,), bytes((seed + i) % 251 for i in range(4 * n)))


def _unit(tmp_path, **kw) -> StorageUnit:
    unit = StorageUnit(0, "tcp://127.0.0.1:9", log_dir=str(tmp_path / "log"), **kw)
    # the request loop does not run here: what the log asks of it runs after each request
    unit.loop_calls = []
    unit.rowlog._call_soon = unit.loop_calls.append
    return unit


def _loop_turn(unit) -> None:
    while unit.loop_calls:
        unit.loop_calls.pop(0)()
    for hook in unit.server.turn_hooks:  # the end of the turn (sync: the loop writes)
        hook()


def _close(unit: StorageUnit, remove: bool = False) -> None:
    unit.server.stop()
    unit.pool.shutdown(wait=True)
    unit.rowlog.close(remove=remove)
    unit.server.socket.close(linger=0)
    unit.server._wake.close(linger=0)


def _put(unit, rows, gens):
    reply = unit.server.handlers["PUT_ROWS"][0]({"rows": rows, "gens": gens}, None)
    _loop_turn(unit)
    return reply


def _drop(unit, indexes, gens):
    unit.server.handlers["DROP_ROWS"][0]({"indexes": indexes, "gens": gens}, None)
    _loop_turn(unit)


def _settle(unit, what) -> None:
    """Wait (bounded) until ``what()`` holds, running the loop's share meanwhile."""
    for _ in range(500):
        _loop_turn(unit)
        if what():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the row log did not settle")


def _state(unit) -> dict:
    return {i: (unit.gens[i], {f: (v.dtype, tuple(v.shape), bytes(v.data))
                               if isinstance(v, RawTensor) else v for f, v in row.items()})
            for i, row in unit.rows.items()}


def test_puts_merges_drops_and_replacements_come_back_after_a_reopen(tmp_path):
    unit = _unit(tmp_path)
    _put(unit, [[0, {"a": _tensor(1), "n": 7}], [1, {"a": _tensor(2)}],
                [2, {"a": _tensor(3), "s": "x"}]], [5, 6, 7])
    _put(unit, [[0, {"b": _tensor(4, 3)}]], [5])          # merged into generation 5
    _put(unit, [[1, {"a": _tensor(9)}]], [8])             # a newer key at index 1
    _put(unit, [[2, {"a": _tensor(10)}]], [6])            # older generation: refused
    _drop(unit, [0, 2], [4, 7])  # 0 kept
    want = _state(unit)
    assert set(want) == {0, 1} and set(want[0][1]) == {"a", "n", "b"}
    _close(unit)
    again = _unit(tmp_path)
    try:
        assert _state(again) == want
        assert again.bytes_held == unit.bytes_held
        assert again.replayed["torn"] == [] and again.replayed["entries"] == 6
    finally:
        _close(again)


def test_a_checkpoint_switch_replays_as_exactly_its_rows(tmp_path):
    unit = _unit(tmp_path)
    _put(unit, [[i, {"a": _tensor(i)}] for i in range(4)], [1] * 4)
    unit.replace_rows({7: {"c": _tensor(70)}, 9: {"c": _tensor(90)}}, {7: 107, 9: 109}, 512)
    unit.write_log()
    _loop_turn(unit)
    want = _state(unit)
    _close(unit)
    again = _unit(tmp_path)
    try:
        assert _state(again) == want and set(want) == {7, 9}
    finally:
        _close(again)


def test_a_torn_last_entry_is_cut_off_and_the_rest_replayed(tmp_path):
    unit = _unit(tmp_path)
    _put(unit, [[0, {"a": _tensor(1)}]], [1])
    before = _state(unit)
    _put(unit, [[1, {"a": _tensor(2, 4096)}]], [1])
    _close(unit)
    seg = sorted(p for p in os.listdir(tmp_path / "log") if p.startswith("seg-"))[-1]
    path = tmp_path / "log" / seg
    os.truncate(path, os.path.getsize(path) - 100)  # the last write half done
    again = _unit(tmp_path)
    try:
        assert _state(again) == before
        assert again.replayed["torn"] == [str(path)]
    finally:
        _close(again)


def test_a_corrupt_entry_stops_the_replay_of_its_file_there(tmp_path):
    unit = _unit(tmp_path)
    _put(unit, [[0, {"a": _tensor(1)}]], [1])
    first = _state(unit)
    _put(unit, [[1, {"a": _tensor(2)}]], [1])
    _close(unit)
    seg = tmp_path / "log" / "seg-00000001.log"
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0xFF  # a payload byte of the second entry
    seg.write_bytes(bytes(data))
    again = _unit(tmp_path)
    try:
        assert _state(again) == first
    finally:
        _close(again)


def _disk(tmp_path) -> int:
    """The bytes of the log's files (the writer may delete one meanwhile)."""
    total = 0
    with os.scandir(tmp_path / "log") as entries:
        for e in entries:
            try:
                total += e.stat().st_size if e.name != "lock" else 0
            except FileNotFoundError:
                pass
    return total


def _state_after_reopen(unit, tmp_path) -> dict:
    """Close ``unit``, open a unit on its directory (a replay) and return what it holds."""
    _close(unit)
    again = _unit(tmp_path)
    try:
        return _state(again)
    finally:
        _close(again)


def _catch_up(unit) -> None:
    """Let the writer and the compaction finish what the requests so far gave them (a
    unit's loop runs the compaction's share at once; here each turn is run by hand)."""
    log = unit.rowlog
    for _ in range(1000):
        log.flush()
        _loop_turn(unit)
        if not (log._compacting or log._files.dead or log._queue or unit.loop_calls):
            return
    raise AssertionError("the row log did not catch up")


def _compacted(unit) -> bool:
    log = unit.rowlog
    return log.compactions >= 1 and not log._compacting and not log._files.dead and not log._queue


def test_compaction_keeps_the_live_rows_and_frees_the_files_of_dead_ones(
        tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "COMPACT_SLACK", 64 << 10)
    unit = _unit(tmp_path)
    unit.rowlog.segment_bytes = 32 << 10
    for rnd in range(40):  # put and drop: the files grow, the live rows do not
        _put(unit, [[i, {"a": _tensor(rnd + i, 256)}] for i in range(8)], [rnd + 1] * 8)
        if rnd < 39:
            _drop(unit, list(range(8)), [rnd + 1] * 8)
    unit.rowlog.flush()
    _settle(unit, lambda: _compacted(unit))
    files = os.listdir(tmp_path / "log")
    assert _disk(tmp_path) <= (rl.COMPACT_RATIO * unit.bytes_held + rl.COMPACT_SLACK
                               + unit.rowlog.segment_bytes)
    assert "seg-00000001.log" not in files
    want = _state(unit)
    assert _state_after_reopen(unit, tmp_path) == want and len(want) == 8


def test_a_row_merged_across_files_is_whole_after_its_first_file_is_compacted(
        tmp_path, monkeypatch):
    """A row whose first entry (field a) is in the oldest file and a later entry of the same
    generation (field b) in a newer one: compacting the oldest file logs the whole row
    again, so nothing of it goes with the file; rows that stay live are logged again."""
    monkeypatch.setattr(rl, "COMPACT_SLACK", 16 << 10)
    unit = _unit(tmp_path)
    unit.rowlog.segment_bytes = 16 << 10
    _put(unit, [[100, {"a": _tensor(7, 512)}], [101, {"a": _tensor(8, 512)}]], [5, 5])
    for rnd in range(6):
        _put(unit, [[i, {"a": _tensor(rnd + i, 512)}] for i in range(4)], [rnd + 1] * 4)
        _drop(unit, list(range(4)), [rnd + 1] * 4)
    _put(unit, [[100, {"b": _tensor(9, 16)}]], [5])   # merged into row 100 of generation 5
    for rnd in range(6, 30):
        _put(unit, [[i, {"a": _tensor(rnd + i, 512)}] for i in range(4)], [rnd + 1] * 4)
        _drop(unit, list(range(4)), [rnd + 1] * 4)
    unit.rowlog.flush()
    _settle(unit, lambda: _compacted(unit))
    assert "seg-00000001.log" not in os.listdir(tmp_path / "log")
    want = _state(unit)
    assert set(want) == {100, 101} and set(want[100][1]) == {"a", "b"}
    assert _state_after_reopen(unit, tmp_path) == want


def test_disk_use_stays_within_its_bound_throughout_a_churn(tmp_path, monkeypatch):
    """Live rows that stay (a buffer) beside rows put and dropped again and again: the files
    never hold more than 1.2x the live bytes, the slack and one file's rows twice; also
    at the peak, when a file's live rows are logged again and the file is not yet gone."""
    monkeypatch.setattr(rl, "COMPACT_SLACK", 32 << 10)
    peaks = []
    hit = rl.faults.hit

    def hit_and_measure(point, *args, **kwargs):
        if point == "unit.rowlog.compact.before_unlink":
            peaks.append(_disk(tmp_path))
        return hit(point, *args, **kwargs)

    monkeypatch.setattr(rl.faults, "hit", hit_and_measure)
    unit = _unit(tmp_path)
    unit.rowlog.segment_bytes = 32 << 10
    _put(unit, [[1000 + i, {"a": _tensor(i, 1024)}] for i in range(64)], [1] * 64)  # 256 KiB
    live = unit.bytes_held
    bound = rl.COMPACT_RATIO * live + rl.COMPACT_SLACK + 2 * unit.rowlog.segment_bytes
    settled = []
    for rnd in range(120):
        _put(unit, [[i, {"a": _tensor(rnd + i, 1024)}] for i in range(4)], [rnd + 2] * 4)
        _drop(unit, list(range(4)), [rnd + 2] * 4)
        _catch_up(unit)
        settled.append(_disk(tmp_path))
    assert unit.bytes_held == live
    assert max(settled) <= bound and max(peaks) <= bound, (max(settled), max(peaks), bound)
    assert unit.rowlog.compactions >= 5 and peaks
    want = _state(unit)
    assert _state_after_reopen(unit, tmp_path) == want and len(want) == 64


@pytest.mark.parametrize("sync", [False, True])
def test_clearing_everything_shrinks_the_directory_to_almost_nothing(tmp_path, monkeypatch,
                                                                     sync):
    """Also with sync, where the loop writes and the writer deletes the compacted files."""
    monkeypatch.setattr(rl, "COMPACT_SLACK", 16 << 10)
    unit = _unit(tmp_path, sync=sync, flush_interval=0.05)
    unit.rowlog.segment_bytes = 64 << 10
    _put(unit, [[i, {"a": _tensor(i, 1024)}] for i in range(64)], [1] * 64)
    _drop(unit, list(range(64)), [1] * 64)
    unit.rowlog.flush()
    _settle(unit, lambda: _compacted(unit))
    assert _disk(tmp_path) < 64 << 10
    _close(unit)


def test_sync_replies_after_an_fsync_that_concurrent_puts_share(tmp_path):
    unit = _unit(tmp_path, sync=True)
    replies: list = []

    class Deferred:
        def __init__(self):
            self.done = threading.Event()

        def reply(self, result=None, error=None):
            replies.append((result, error))
            self.done.set()

    rowlog = unit.rowlog
    waiters = []
    for i in range(20):  # what 20 requests wrote before the flusher's turn
        rowlog.row(i, 1, {"a": _tensor(i)})
        rowlog.write()
        d = Deferred()
        waiters.append(d)
        rowlog.when_durable(d, {"rows": 1})
    for d in waiters:
        assert d.done.wait(10)
    assert len(replies) == 20 and all(e is None for _r, e in replies)
    assert 1 <= rowlog.fsyncs < 20
    _close(unit)


def test_sync_a_loop_turn_writes_and_answers_its_requests_after_one_shared_fsync(tmp_path):
    """With sync the loop's turn hook writes and fsyncs what the turn's requests queued
    and answers them from the loop, one fsync for all; while the writer thread holds the
    log (a compaction's batch, a cut), the turn leaves them to it."""
    unit = _unit(tmp_path, sync=True)
    rowlog = unit.rowlog
    assert rowlog.sync_on_loop in unit.server.turn_hooks
    answered: list = []

    class Deferred:  # a request's deferred reply (tqtx.wire.rpc.Deferred)
        def reply_on_loop(self, result=None, error=None):
            answered.append(("loop", threading.current_thread().name, result, error))

        def reply(self, result=None, error=None):
            answered.append(("posted", threading.current_thread().name, result, error))

    def request(i):
        rowlog.row(i, 1, {"a": _tensor(i)})
        rowlog.write()
        rowlog.reply_when_durable(Deferred(), {"i": i})

    fsyncs = rowlog.fsyncs
    for i in range(5):  # five requests read in one turn
        request(i)
    threading.Event().wait(0.2)
    assert answered == [] and rowlog.fsyncs == fsyncs  # the writer was not woken for them
    rowlog.sync_on_loop()  # the end of the turn
    me = threading.current_thread().name
    assert answered == [("loop", me, {"i": i}, None) for i in range(5)]
    assert rowlog.fsyncs == fsyncs + 1
    answered.clear()
    with rowlog._io:  # the writer is busy
        request(9)
        rowlog.sync_on_loop()
        assert answered == []
    for _ in range(500):
        if answered:
            break
        threading.Event().wait(0.01)
    assert answered == [("posted", "tqtx-rowlog", {"i": 9}, None)]
    _close(unit)
    again = _unit(tmp_path, sync=True)
    try:
        assert sorted(again.rows) == [0, 1, 2, 3, 4, 9]
    finally:
        _close(again)


def test_sync_a_read_while_changes_are_not_durable_is_answered_after_their_fsync(tmp_path):
    """A row overwritten in place is read from its put on: with sync a GET_ROWS answered
    while the log holds changes no fsync covers waits for that fsync (a reader shown the
    new row must not find the old one after a power loss); with everything durable it is
    answered at once."""
    from tqtx.wire.codec import decode
    unit = _unit(tmp_path, sync=True)
    sent: list = []
    unit.server._send = lambda ident, frames: sent.append(decode(frames)["result"])
    unit.server.current_ident = b"reader"
    get = unit.server.handlers["GET_ROWS"][0]
    body = {"indexes": [0], "gens": [5], "fields": ["a"]}
    request = {"op": "GET_ROWS", "rid": "r1", "body": body}
    try:
        _put(unit, [[0, {"a": _tensor(1)}]], [5])
        assert not unit.rowlog.undurable
        assert isinstance(get(body, request), dict)  # durable: answered at once
        fsyncs = unit.rowlog.fsyncs
        unit.server.handlers["PUT_ROWS"][0]({"rows": [[0, {"a": _tensor(2)}]], "gens": [5]},
                                            None)  # overwritten in place, not yet fsynced
        assert unit.rowlog.undurable
        assert type(get(body, request)).__name__ == "Deferred" and sent == []
        _loop_turn(unit)  # the end of the turn: one fsync, then the reply
        assert unit.rowlog.fsyncs == fsyncs + 1 and len(sent) == 1
        assert not unit.rowlog.undurable
    finally:
        _close(unit)


def test_a_clean_close_removes_only_the_logs_files(tmp_path):
    unit = _unit(tmp_path)
    _put(unit, [[0, {"a": _tensor(1)}]], [1])
    (tmp_path / "log" / "notes.txt").write_text("not the unit's")
    _close(unit, remove=True)
    assert os.listdir(tmp_path / "log") == ["notes.txt"]


def test_a_second_unit_on_the_same_directory_is_refused(tmp_path):
    unit = _unit(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="another unit process holds this row log"):
            rl.RowLog(str(tmp_path / "log"), sync=False, interval=1.0,
                      live_bytes=lambda: 0, rows=lambda: ({}, {}))
    finally:
        _close(unit)


def test_a_power_loss_keeps_exactly_what_was_fsynced(tmp_path, monkeypatch):
    """Every fsync of the log is recorded (file -> size); the power loss cuts each file
    back to its last fsynced size and removes files no fsync of their directory covered.
    The unit opened on what is left holds the rows of the last fsync, nothing half."""
    synced: dict[str, int] = {}
    dir_synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            dir_synced.update(os.listdir(path))
        else:
            synced[path] = os.fstat(fd).st_size

    monkeypatch.setattr(rl.os, "fsync", fsync)
    monkeypatch.setattr(rl.fsutil.os, "fsync", fsync)
    unit = _unit(tmp_path, flush_interval=3600.0)  # no fsync but the ones asked for
    _put(unit, [[i, {"a": _tensor(i)}] for i in range(6)], [1] * 6)
    unit.rowlog.flush()
    durable = _state(unit)
    _put(unit, [[i, {"a": _tensor(100 + i)}] for i in range(3, 9)], [1] * 6)  # not fsynced
    _drop(unit, [0], [1])
    assert _state(unit) != durable  # queued or written since the fsync, not fsynced
    # the power goes: the process never closes its log
    unit.server.stop()
    unit.pool.shutdown(wait=True)
    unit.rowlog.files._lock.release()
    unit.server.socket.close(linger=0)
    unit.server._wake.close(linger=0)
    log_dir = tmp_path / "log"
    for name in os.listdir(log_dir):
        path = str(log_dir / name)
        if name == "lock":
            continue
        if name not in dir_synced:
            os.unlink(path)
        else:
            os.truncate(path, synced.get(path, 0))
    again = _unit(tmp_path)
    try:
        assert _state(again) == durable
    finally:
        _close(again)


def _full_disk(monkeypatch) -> threading.Event:
    """While the event is set, every write of the row log fails with ENOSPC."""
    import errno

    full = threading.Event()
    real_writev = rl.fsutil.writev_all

    def writev_all(fd, bufs):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, bufs)

    monkeypatch.setattr(rl.fsutil, "writev_all", writev_all)
    return full


def test_a_full_disk_refuses_new_rows_and_the_log_catches_up_once_it_has_room(
        tmp_path, monkeypatch):
    full = _full_disk(monkeypatch)
    unit = _unit(tmp_path, flush_interval=0.05)
    _put(unit, [[0, {"a": _tensor(1)}]], [1])
    unit.rowlog.flush()
    full.set()
    _put(unit, [[1, {"a": _tensor(2)}]], [1])  # stored; its write fails and waits
    _settle(unit, lambda: unit.rowlog.error is not None)
    with pytest.raises(OSError, match="row log .* cannot be written .*No space left"):
        _put(unit, [[2, {"a": _tensor(3)}]], [1])
    assert 2 not in unit.rows  # refused before anything was stored
    full.clear()
    _settle(unit, lambda: unit.rowlog.error is None and not unit.rowlog._queue)
    _put(unit, [[2, {"a": _tensor(3)}]], [1])
    want = _state(unit)
    _close(unit)
    again = _unit(tmp_path)
    try:
        assert _state(again) == want and set(want) == {0, 1, 2}
    finally:
        _close(again)


def test_sync_a_failed_write_in_the_loops_turn_answers_with_the_error_and_the_writer_retries(
        tmp_path, monkeypatch):
    """The loop never waits out a failing disk: the turn's requests get the error at once,
    their changes stay queued, and the writer thread writes them once there is room."""
    full = _full_disk(monkeypatch)
    unit = _unit(tmp_path, sync=True, flush_interval=0.05)
    rowlog = unit.rowlog
    answered: list = []

    class Deferred:
        def reply_on_loop(self, result=None, error=None):
            answered.append((result, error))
        reply = reply_on_loop

    full.set()
    rowlog.row(0, 1, {"a": _tensor(1)})
    rowlog.write()
    rowlog.reply_when_durable(Deferred(), {"rows": 1})
    rowlog.sync_on_loop()
    assert len(answered) == 1 and answered[0][0] is None
    assert isinstance(answered[0][1], OSError) and "No space left" in str(answered[0][1])
    assert rowlog.error is not None and rowlog._queue  # kept for the writer to retry
    full.clear()
    _settle(unit, lambda: rowlog.error is None and not rowlog._queue)
    _close(unit)
    again = _unit(tmp_path, sync=True)
    try:
        assert sorted(again.rows) == [0]
    finally:
        _close(again)


def test_a_checkpoint_links_the_files_before_its_cut_and_leaves_a_base_being_written(
        tmp_path):
    unit = _unit(tmp_path)
    _put(unit, [[0, {"a": _tensor(1)}], [1, {"a": _tensor(2)}]], [1, 1])
    _put(unit, [[0, {"b": _tensor(3)}]], [1])
    being_written = tmp_path / "log" / "base-00000099.tmp"
    being_written.write_bytes(b"a compaction's base, half written")
    want = _state(unit)
    cut = unit.rowlog.cut()
    _put(unit, [[1, {"a": _tensor(9)}]], [1])  # after the cut: not in the checkpoint
    files = unit.rowlog.link(cut, str(tmp_path / "ckpt"))
    assert being_written.exists()
    assert [f["file"] for f in files] == ["seg-00000001.log"]
    from tqtx.storage.logdir import read_rows
    rows, gens = read_rows([str(tmp_path / "ckpt" / f["file"]) for f in files])
    got = {i: (gens[i], {f: (v.dtype, tuple(v.shape), bytes(v.data)) for f, v in r.items()})
           for i, r in rows.items()}
    assert got == want
    _close(unit)


def test_replayed_rows_are_views_of_their_file_unless_it_is_mostly_dead(tmp_path):
    """A replay reads each file once and keeps the rows' tensors as views of it (no second
    copy); rows of a file that is mostly dropped rows are copied out, so that file's buffer
    does not stay in memory for them."""
    unit = _unit(tmp_path)
    _put(unit, [[i, {"a": _tensor(i, 1024)}] for i in range(10)], [1] * 10)
    unit.rowlog.flush()
    _close(unit)
    again = _unit(tmp_path)
    assert {type(r["a"].data) for r in again.rows.values()} == {memoryview}
    assert again.replayed["copied_bytes"] == 0
    _drop(again, list(range(9)), [1] * 9)      # 9 of the 10 rows of that file go
    want = _state(again)
    _close(again)
    third = _unit(tmp_path)
    try:
        assert _state(third) == want and type(third.rows[9]["a"].data) is bytes
        assert third.replayed["copied_bytes"] == 4096
    finally:
        _close(third)


def _churn_until_the_first_file_is_compacted(unit, tmp_path, gen: int) -> None:
    """Put and drop rows at other indexes (generations from ``gen``) until the log's first
    file was compacted and deleted."""
    for rnd in range(30):
        _put(unit, [[10 + i, {"a": _tensor(rnd + i, 512)}] for i in range(4)], [gen + rnd] * 4)
        _drop(unit, [10 + i for i in range(4)], [gen + rnd] * 4)
    unit.rowlog.flush()
    _settle(unit, lambda: _compacted(unit))
    assert "seg-00000001.log" not in os.listdir(tmp_path / "log")


def test_rows_a_checkpoint_switch_brought_survive_the_compaction_of_their_file(
        tmp_path, monkeypatch):
    """A checkpoint switch gives the unit new row dicts; a later compaction logs the live
    rows of their file again from the dicts the unit holds then (not the ones it held
    before the switch), so a reopen has exactly the switched rows and what came after."""
    monkeypatch.setattr(rl, "COMPACT_SLACK", 16 << 10)
    unit = _unit(tmp_path)
    unit.rowlog.segment_bytes = 16 << 10
    _put(unit, [[i, {"a": _tensor(i, 512)}] for i in range(4)], [1] * 4)   # replaced below
    switched = {i: {"a": _tensor(100 + i, 512)} for i in range(4)}
    unit.replace_rows(switched, {i: 50 + i for i in range(4)},
                      sum(v["a"].nbytes for v in switched.values()))
    unit.write_log()
    _churn_until_the_first_file_is_compacted(unit, tmp_path, gen=100)
    want = _state(unit)
    assert sorted(want) == [0, 1, 2, 3] and want[2][0] == 52
    assert _state_after_reopen(unit, tmp_path) == want


def test_drops_after_a_replay_let_a_mostly_dead_file_buffer_go(tmp_path):
    """Replayed rows share their file's buffer; once drops leave it mostly dead, the rows
    left are copied out (the same bytes) so the buffer can go."""
    unit = _unit(tmp_path)
    _put(unit, [[i, {"a": _tensor(i, 1024)}] for i in range(10)], [1] * 10)
    unit.rowlog.flush()
    _close(unit)
    again = _unit(tmp_path)
    try:
        assert {type(r["a"].data) for r in again.rows.values()} == {memoryview}
        want = {i: bytes(again.rows[i]["a"].data) for i in (8, 9)}
        _drop(again, list(range(8)), [1] * 8)
        assert {i: type(again.rows[i]["a"].data) for i in (8, 9)} == {8: bytes, 9: bytes}
        assert {i: bytes(again.rows[i]["a"].data) for i in (8, 9)} == want
        assert again.views.checked_at is None   # nothing shared any more: no more passes
    finally:
        _close(again)


def test_applied_restores_and_checkpoint_loads_are_remembered_after_a_reopen_and_compaction(
        tmp_path, monkeypatch):
    """A unit that applied a restore or switched to a checkpoint load still knows it once
    replayed, also after the files holding those marks were compacted: a roll-forward
    after a restart (REDO_RESTORE, a controller's checkpoint switch) is answered as done,
    never applied again over later writes."""
    from tqtx.storage.checkpoints import CheckpointSwitch, StagedLoad
    from tqtx import states as st
    monkeypatch.setattr(rl, "COMPACT_SLACK", 16 << 10)
    unit = _unit(tmp_path)
    unit.rowlog.segment_bytes = 16 << 10
    unit.restore.staging["r1"] = {3: (30, {"a": _tensor(3, 512)})}
    assert unit.server.handlers["APPLY_STAGED"][0]({"restore_id": "r1"}, None) == {"rows": 1}
    load = StagedLoad("ck1", rows={5: {"a": _tensor(5, 512)}}, nbytes=2048)
    load.move(st.STAGED)
    unit.checkpoints.staged["ck1"] = load
    unit.checkpoints.switch(CheckpointSwitch("ck1", 100))
    unit.write_log()
    _loop_turn(unit)
    _churn_until_the_first_file_is_compacted(unit, tmp_path, gen=200)
    want = _state(unit)
    _close(unit)
    again = _unit(tmp_path)
    try:
        assert _state(again) == want and sorted(want) == [5]
        assert again.checkpoints.applied == "ck1"
        assert again.checkpoints.switch(CheckpointSwitch("ck1", 100)) == {"rows": 1}
        redo = again.server.handlers["REDO_RESTORE"][0]({"restore_id": "r1"}, None)
        assert redo == {"rows": 1, "applied": True}
    finally:
        _close(again)
