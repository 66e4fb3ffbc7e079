"""tqtx.storage.memory: the watcher trims once enough was freed, and when things go quiet."""
from __future__ import annotations

import pytest

from tqtx.storage import memory

pytestmark = pytest.mark.skipif(memory.free_bytes() is None, reason="needs glibc malloc")

MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_check_trims_after_a_large_free_and_rss_falls():
    t = memory.Trimmer(threshold=16 * MiB, period=60)
    t.check()
    # ~96 MiB in 24 KiB buffers: below the mmap threshold, so they sit in malloc's heap
    bufs = [bytearray(24 * 1024) for _ in range(4096)]
    for b in bufs:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page
    t.check()
    full = _rss()
    trims = t.trims
    del bufs[::2]  # half freed, interleaved with live buffers: no heap top to shrink
    assert t.check() is True
    assert t.trims == trims + 1
    assert _rss() < full - 32 * MiB
    assert t.check() is False  # nothing new freed: no second trim
    del bufs


def test_quiet_trim_after_a_small_free():
    t = memory.Trimmer(threshold=1 << 40, period=60, quiet_checks=2)  # no growth trims
    bufs = [bytearray(24 * 1024) for _ in range(512)]
    t.check()
    del bufs[::2]
    seen = [t.check() for _ in range(3)]
    # free bytes just changed; unchanged once; unchanged twice: quiet, and > 1 MiB freed
    assert seen == [False, False, True]
    assert [t.check() for _ in range(3)] == [False, False, False]  # nothing new to give


def test_small_allocations_of_a_quiet_unit_do_not_keep_it_from_trimming():
    """A unit's heartbeats and stats allocate a little all the time: changes of free bytes
    under QUIET_BYTES between checks still count as quiet."""
    t = memory.Trimmer(threshold=1 << 40, period=60, quiet_checks=2)
    bufs = [bytearray(24 * 1024) for _ in range(512)]
    t.check()
    del bufs[::2]
    noise, seen = [], []
    for i in range(3):
        seen.append(t.check())
        noise.append(bytearray(64 * 1024 * (i + 1)))  # a heartbeat's worth, changing
    assert seen == [False, False, True]
    del bufs, noise


def test_quiet_trim_after_reuse_that_hides_what_was_freed():
    """A put that reuses a clear's free pages and frees its request's buffers between two
    checks shows no growth of free bytes; the change alone still earns the quiet trim
    (else the request's freed buffers stayed resident: +20% RSS in one put of two)."""
    t = memory.Trimmer(threshold=1 << 40, period=60, quiet_checks=2)
    held = [bytearray(24 * 1024) for _ in range(512)]
    del held[::2]  # ~6 MiB free between live buffers
    t.check()
    t.check()
    assert t.check() is True  # the clear's quiet trim
    reused = [bytearray(24 * 1024) for _ in range(256)]  # free bytes fall: no growth
    seen = [t.check() for _ in range(3)]
    assert seen == [False, False, True]
    assert [t.check() for _ in range(3)] == [False, False, False]
    del held, reused


_THREAD_TOP = r"""
import sys, threading
from tqtx.storage import memory
if sys.argv[1] == "single":
    assert memory.single_arena()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
big = bytearray(16 << 20)  # mmapped and freed: malloc's dynamic thresholds rise (as in a unit)
del big
def rows():  # ~24 MiB of rows allocated and freed by one thread: they become its heap's top
    bufs = [bytearray(24 * 1024) for _ in range(1024)]
    for b in bufs:
        b[::4096] = b"\x01" * len(b[::4096])
    del bufs
before = rss()
t = threading.Thread(target=rows)
t.start()
t.join()
memory.trim()
print(rss() - before)
"""


@pytest.mark.parametrize("arenas", ["single", "default"])
def test_trim_returns_what_a_thread_freed_only_with_a_single_arena(arenas):
    """malloc_trim gives back free chunks of every arena, but not the free top of a
    thread's arena: rows a unit's I/O thread read (a restore) and a clear freed stayed
    resident. A unit process therefore allocates from the main arena only."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _THREAD_TOP, arenas], check=True,
                         capture_output=True, text=True).stdout
    kept = int(out)
    if arenas == "single":
        assert kept < 4 * MiB
    else:  # glibc's behaviour this works around (shows the test measures something)
        assert kept > 16 * MiB


def test_quiet_trim_collects_first_only_when_asked(monkeypatch):
    """A unit holding few rows asks for a full collection before its quiet trim (it empties
    the interpreter's free lists); a growth trim, or a unit holding many rows, does not."""
    collected = []
    monkeypatch.setattr(memory.gc, "collect", lambda *a: collected.append(1) or 0)
    few = [True]
    t = memory.Trimmer(threshold=1 << 40, period=60, quiet_checks=2,
                       collect_if=lambda: few[0])
    bufs = [bytearray(24 * 1024) for _ in range(512)]
    t.check()
    del bufs[::2]
    assert [t.check() for _ in range(3)] == [False, False, True]
    assert collected == [1]
    few[0] = False
    del bufs[::2]
    assert [t.check() for _ in range(3)] == [False, False, True]
    assert collected == [1]  # many rows: a collection would cost too much; trimmed anyway
    more = [bytearray(24 * 1024) for _ in range(512)]
    g = memory.Trimmer(threshold=4 * MiB, period=60, collect_if=lambda: True)
    g.check()
    del more[::2]  # 6 MiB freed at once
    assert g.check() is True and collected == [1]  # a growth trim never collects
    del bufs, more


def test_a_growth_trim_leaves_the_quiet_trim_and_its_collection_due(monkeypatch):
    """A burst that ends with a growth trim (a restore over live keys, then a clear: more
    than the threshold freed at once) still gets the quiet trim and its collection once
    the unit settles: the free lists the burst filled would else keep the rows' object
    arenas mapped."""
    collected = []
    monkeypatch.setattr(memory.gc, "collect", lambda *a: collected.append(1) or 0)
    bufs = [bytearray(24 * 1024) for _ in range(512)]
    t = memory.Trimmer(threshold=4 * MiB, period=60, quiet_checks=2, collect_if=lambda: True)
    t.check()
    del bufs[::2]  # 6 MiB freed at once: the last thing the burst did
    assert t.check() is True and collected == []  # growth trim, no collection mid-burst
    assert [t.check() for _ in range(3)] == [False, True, False]  # settled: quiet trim
    assert collected == [1]
    assert [t.check() for _ in range(3)] == [False, False, False]  # nothing new: no more
    del bufs
