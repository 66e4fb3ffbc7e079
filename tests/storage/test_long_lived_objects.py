"""What a server keeps between requests makes no Python object per request.

A unit's small objects share pymalloc's 1 MiB arenas with the rows' metadata; an object
made while many rows were held and kept after they are cleared keeps its arena mapped
(docs/performance.md, *Unit memory*). The reply cache, a unit's applied restores and the
request metrics therefore keep what they record in preallocated memory; these tests count
the blocks still allocated after many requests, by the file that allocated them."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from tqtx.metrics import Metrics
from tqtx.storage.restore import AppliedRestores
from tqtx.wire.peer import Peer
from tqtx.wire.rpc import Server


def _blocks_from(snapshot_before, snapshot_after, *suffixes: str) -> int:
    grown = 0
    for d in snapshot_after.compare_to(snapshot_before, "traceback"):
        if d.count_diff > 0 and any(f.filename.endswith(suffixes) for f in d.traceback):
            grown += d.count_diff
    return grown


# Blocks a server may still hold after 600 answered requests: far under the ~2,400 that
# one kept object per request would leave
KEPT_BOUND = 100


def _largest(snapshot_before, snapshot_after, n: int = 5) -> list[str]:
    """The sites that grew most, for a failure message."""
    grown = [d for d in snapshot_after.compare_to(snapshot_before, "traceback")
             if d.count_diff > 0]
    grown.sort(key=lambda d: -d.count_diff)
    return [f"{d.count_diff} blocks: {d.traceback.format()[-2:]}" for d in grown[:n]]


@contextlib.contextmanager
def _traced(frames: int = 12):
    tracemalloc.start(frames)
    try:
        yield
    finally:
        tracemalloc.stop()


def test_a_server_keeps_nothing_per_mutating_request_it_answered():
    server = Server("unit-0")
    server.add("SET", lambda body, req: {"rows": body["n"], "bytes": 64 * body["n"]},
               mutating=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    thread.start()
    peer = Peer(server.address, "unit-0", timeout=30)
    try:
        for i in range(50):  # warm-up: the records and caches exist before counting
            peer.call("SET", {"n": i})
        with _traced():
            before = tracemalloc.take_snapshot()
            rids = [f"retry-me-{i:04d}" for i in range(600)]
            for i, rid in enumerate(rids):
                assert peer.call("SET", {"n": i}, rid=rid) == {"rows": i, "bytes": 64 * i}
            # 600 recorded replies, each once a header, a frame list, a cache node and a
            # key, would keep about 2,400 blocks; what stays is the last request's few
            # objects once the server's loop has finished its turn, plus whatever threads
            # other tests left in this process allocate meanwhile through the same files
            # (32-44 blocks seen on a loaded CI worker)
            for _ in range(20):
                time.sleep(0.1)
                after = tracemalloc.take_snapshot()
                kept = _blocks_from(before, after, "wire/rpc.py", "metrics.py",
                                    "wire/id_records.py")
                if kept < KEPT_BOUND:
                    break
        assert kept < KEPT_BOUND, (kept, _largest(before, after))
        # and every one of them is still answered from the cache, not run again
        assert peer.call("SET", {"n": -1}, rid=rids[0]) == {"rows": 0, "bytes": 0}
        assert peer.call("SET", {"n": -1}, rid=rids[-1]) == {"rows": 599, "bytes": 599 * 64}
    finally:
        server.stop()
        thread.join(10)
        peer.close()


def test_recording_request_metrics_keeps_no_number_objects():
    m = Metrics("unit", 0, enabled=True)
    m.declare(("PUT_ROWS", "DROP_ROWS"), totals=("load_rows_total",))
    m.record("PUT_ROWS", 0.001, 10, 5)
    with _traced():
        before = tracemalloc.take_snapshot()
        for i in range(1000):
            m.record("PUT_ROWS", 0.001 + i * 1e-6, 100_000 + i, 70_000 + i)
            m.record("DROP_ROWS", 0.0002, 300 + i, 20)
            m.add("load_rows_total", 1000 + i)
        after = tracemalloc.take_snapshot()
    # (a float or two may sit on the interpreter's free list, which tracemalloc counts as
    # allocated; a number kept per update would be thousands)
    assert _blocks_from(before, after, "metrics.py") <= 2
    rec = m.ops["PUT_ROWS"]
    assert rec.count == 1001 and rec.bytes_in == 10 + sum(100_000 + i for i in range(1000))
    assert m.totals["load_rows_total"] == sum(1000 + i for i in range(1000))


def test_applied_restores_keep_no_object_per_restore():
    applied = AppliedRestores(size=256)
    applied.record("warm", 1)
    with _traced():
        before = tracemalloc.take_snapshot()
        for i in range(1000):
            applied.record(f"{i:032x}", i)
        after = tracemalloc.take_snapshot()
    assert _blocks_from(before, after, "storage/restore.py", "wire/id_records.py") <= 2
    assert applied.get(f"{999:032x}") == {"rows": 999} and f"{999:032x}" in applied
    assert applied.get(f"{0:032x}") is None  # only the last 256 are kept


_PEER_AND_LOOP = r"""
import gc, threading, time, tracemalloc
from concurrent.futures import ThreadPoolExecutor
from tqtx.wire.peer import Peer
from tqtx.wire.rpc import Server
server = Server("unit-0")
server.add("ECHO", lambda body, req: {"n": body["n"]}, mutating=False)
# a reply from a worker thread (as a unit's dumps and restores answer), pending meanwhile
worker = ThreadPoolExecutor(1, initializer=server.prepare_thread)
worker.submit(int).result()
def later(body, req):
    deferred = server.deferred(req, server.current_ident)
    worker.submit(deferred.reply, {"n": body["n"]})
    return deferred
server.add("LATER", later, mutating=True)
# a long poll: once idle, the loop makes no turn (and frees nothing) while we count
thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 60_000})
thread.start()
peer = Peer(server.address, "unit-0", timeout=30)
for i in range(50):
    peer.call("ECHO", {"n": i})
    peer.call("LATER", {"n": i}, rid=f"warm-{i}")
tracemalloc.start(12)
before = tracemalloc.take_snapshot()
for i in range(300):
    assert peer.call("ECHO", {"n": 1000 + i}) == {"n": 1000 + i}
    if i % 3 == 0:
        assert peer.call("LATER", {"n": i}, rid=f"later-{i}") == {"n": i}
time.sleep(0.2)  # the loop finishes the last request and waits in its poll
# what a settled unit does before its quiet trim: the interpreter's free lists (dicts and
# tuples kept for reuse, which tracemalloc counts) are emptied
gc.collect()
after = tracemalloc.take_snapshot()
tracemalloc.stop()
kept = {"peer": 0, "loop": 0}
for d in after.compare_to(before, "traceback"):
    files = [f.filename for f in d.traceback]
    if d.count_diff <= 0 or any(f.endswith("zmq/sugar/poll.py") for f in files):
        continue  # what the poll the loop is blocked in holds is in flight, not kept
    if any(f.endswith("wire/peer.py") for f in files):
        kept["peer"] += d.count_diff
    elif any(f.endswith("wire/rpc.py") for f in files):
        kept["loop"] += d.count_diff
assert peer.frames_received == 0 and peer.header_bytes_received > 300 * 20
server.call_soon(server.stop)  # wakes the long poll
thread.join(10)
worker.shutdown()
peer.close()
print(kept["peer"], kept["loop"])
"""


def test_a_peer_and_a_server_loop_keep_nothing_from_one_request_to_the_next():
    """A unit's heartbeat peer and its server loop run for the unit's whole life. Anything
    they kept from one request (or loop turn) to the next, a counter's new int, a send
    time's float, the last poll result, the last sender's identity, was made while the
    previous one was still alive, so it landed in the same pymalloc pool, over and over:
    that pool, and its arena, could never empty after a clear (docs/performance.md,
    *Unit memory*). So would the last deferred reply's sender, request ID and op, and the
    table of the dict of pending requests, once empty. Counted in a process of its own: no
    other test's threads allocate there."""
    out = subprocess.run([sys.executable, "-c", _PEER_AND_LOOP], check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["0", "0"], out


def test_the_malloc_trimmer_keeps_no_number_from_one_check_to_the_next():
    from tqtx.storage import memory
    if memory.free_bytes() is None:
        pytest.skip("needs glibc malloc (elsewhere the trimmer does nothing)")
    t = memory.Trimmer(threshold=1 << 40, period=60, quiet_checks=1 << 30)
    held = []
    t.check()
    with _traced():
        before = tracemalloc.take_snapshot()
        for i in range(300):
            held.append(bytearray(64 * 1024))  # free bytes change between checks
            if i % 2:
                held.pop(0)
            t.check()
        after = tracemalloc.take_snapshot()
    assert _blocks_from(before, after, "storage/memory.py") == 0
    assert t.trims == 0
    del held


def _held_while_sleeping(sleep) -> int:
    """Blocks allocated by threading.py and still alive in a thread that is in its second
    ``sleep()``, made after the thread started (a process of its own would be cleaner;
    here the other threads of the test process do not allocate in threading.py)."""
    stop = threading.Event()
    awake = threading.Event()

    def run():
        while not sleep(stop):
            awake.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.1)
    with _traced(25):
        before = tracemalloc.take_snapshot()
        assert awake.wait(5)
        time.sleep(0.1)  # back in the next sleep
        after = tracemalloc.take_snapshot()
    stop.set()
    t.join(5)
    return _blocks_from(before, after, "/threading.py")


def test_a_units_threads_sleep_without_keeping_objects_alive():
    """The trimmer and the heartbeat sleep nearly all the time. An Event.wait there keeps
    a lock and an argument tuple alive while it waits, made anew each time wherever the
    allocator has room, and after a clear that pinned an arena the rows had filled
    (docs/performance.md, *Unit memory*); memory.pause makes none."""
    from tqtx.storage.memory import pause

    # the reference: the same loop with Event.wait does keep blocks alive while waiting
    assert _held_while_sleeping(lambda stop: stop.wait(0.3)) > 0
    assert _held_while_sleeping(lambda stop: pause(stop, 0.3)) == 0
    stop = threading.Event()
    assert pause(stop, 0.01) is False
    stop.set()
    assert pause(stop, 0.01) is True


def test_a_unit_starts_its_io_threads_and_their_wake_sockets_before_it_serves():
    """A thread started (or a thread's wake-up socket made) in the middle of a big restore
    lives as long as the unit, in memory the restored rows' objects used: after a clear,
    its arena stayed mapped (docs/performance.md, *Unit memory*). A unit makes all of them
    as it starts."""
    from tqtx.storage.unit import IO_THREADS, StorageUnit

    before = {t.ident for t in threading.enumerate()}
    unit = StorageUnit(7, "tcp://127.0.0.1:9")  # never registered: no controller needed
    try:
        started = [t for t in threading.enumerate()
                   if t.ident not in before and t.name.startswith("unit7-io")]
        assert len(started) == IO_THREADS
        made = unit.server.prepare_thread
        # each pool thread already has its socket: asking again returns the same one
        gate = threading.Barrier(IO_THREADS)

        def own_socket():
            sock = getattr(unit.server._wake_local, "sock", None)
            gate.wait(10)  # every thread answers once: all of them are covered
            return sock is not None and sock is made(), id(sock)

        results = [f.result(10) for f in [unit.pool.submit(own_socket)
                                           for _ in range(IO_THREADS)]]
        assert all(ok for ok, _ in results)
        socks = {i for _, i in results}
        assert len(socks) == IO_THREADS
        assert {t.ident for t in threading.enumerate()
                if t.name.startswith("unit7-io")} == {t.ident for t in started}
    finally:
        unit.pool.shutdown(wait=True)
        unit.server.socket.close(0)
        unit.server._wake.close(0)


def test_a_unit_whose_io_threads_start_slowly_still_starts(caplog):
    """Starting the I/O threads early is for memory only: if they do not all start in
    time, the unit goes on (and logs it) instead of failing to start."""
    from concurrent.futures import ThreadPoolExecutor

    from tqtx.storage.unit import IO_THREADS, _start_all

    pool = ThreadPoolExecutor(max_workers=IO_THREADS - 1)  # one thread short: never all met
    try:
        with caplog.at_level("WARNING", logger="tqtx.unit"):
            assert _start_all(pool, timeout=0.3) is False
        assert any("not all" in r.getMessage() for r in caplog.records)
        assert pool.submit(lambda: 42).result(5) == 42  # the pool still works
    finally:
        pool.shutdown(wait=True)
    full = ThreadPoolExecutor(max_workers=IO_THREADS)
    try:
        assert _start_all(full, timeout=10) is True
    finally:
        full.shutdown(wait=True)


def test_reading_and_writing_a_same_host_clients_memory_keeps_nothing(tmp_path):
    """A same-host put's read (process_vm_readv) and a get's copy into the client
    (process_vm_writev) of ever new row counts leave no object behind (ctypes caches an
    array type per length it is asked for: the copier uses one type)."""
    from tqtx.wire import shm, vmcopy
    if not vmcopy.available():
        pytest.skip("needs process_vm_readv")
    inbox = shm.GetInbox(str(tmp_path))
    files = shm.ReplyFiles(0)
    src = bytearray(range(256)) * 64
    hint = inbox.hint_for("g")

    def spec(k):
        return ["uint8", [[16]] * k, vmcopy.addresses(
            [memoryview(src)[16 * i:16 * i + 16] for i in range(k)]).tobytes()]

    try:
        files.read_from(hint, {"x": spec(3)})  # warm-up: the inbox proved, types made
        with _traced(4):
            before = tracemalloc.take_snapshot()
            for k in range(5, 905, 31):  # 30 distinct lengths, over IOV_MAX in all
                rows = files.read_from(hint, {"x": spec(k), "y": spec(1030 - k)})
                assert bytes(rows["x"][-1].data) == bytes(src[16 * (k - 1):16 * k])
                vmcopy.write(inbox.pid, vmcopy.addresses([src])[0],
                             [(0, memoryview(b"ab" * (k % 7 + 1)))])
            del rows
            after = tracemalloc.take_snapshot()
        # a few objects of the last calls stay in CPython's free lists (the tuples read_from
        # made, in shm.py, are not counted); an array type per length made 45 here
        assert _blocks_from(before, after, "vmcopy.py") <= 16
    finally:
        inbox.close()
