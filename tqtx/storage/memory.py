"""A storage unit's footprint follows its data: freed row memory goes back to the OS.

Rows are many medium-sized buffers (received ZeroMQ frames, records read from a dump)
allocated by glibc malloc from its heaps/arenas. When rows are dropped, overwritten or
replaced by a restore, glibc keeps the freed pages for reuse and the process's RSS stays
at its high-water mark. ``malloc_trim(0)`` hands every whole free page of every arena back
(``madvise(MADV_DONTNEED)``); it is called from a watcher thread whenever the bytes malloc
holds free (``mallinfo2().fordblks``) grew by more than ``TQTX_TRIM_BYTES`` (default
256 MiB, 0 turns trimming off) since the last trim, and once more when the unit has been
quiet for a second (see :class:`Trimmer`; each check reads ``mallinfo2``, about 1 ms with
thousands of free chunks, every ``TQTX_TRIM_PERIOD`` = 0.2 s; a trim costs ≈50 ms per
150 MiB freed). Elsewhere than glibc this is a no-op. Pages handed back are mapped again,
zero-filled, when reused: a put after a trim pays that first touch, as in a fresh process.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from array import array
from typing import Callable

import zmq

from ..layout import libc
from ..wire.codec import ZMQ_RECV_BATCH
from ..wire.values import DTYPE_NAMES, RawTensor, shared_shape

log = logging.getLogger("tqtx.unit")

TRIM_BYTES = int(os.environ.get("TQTX_TRIM_BYTES", str(256 << 20)))
PERIOD = float(os.environ.get("TQTX_TRIM_PERIOD", "0.2"))
QUIET_CHECKS = 5  # unchanged for 1 s at the default period
QUIET_BYTES = 1 << 20
_BASE, _LAST, _SAME, _TRIMS = range(4)  # Trimmer._n
FEW_ROWS = 4096  # a full collection then costs ≈7 ms (7,680 rows: 14 ms; start-up objects frozen)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    # not glibc, or glibc < 2.33 (no mallinfo2): None
    trim = libc.function("malloc_trim", ctypes.c_int, [ctypes.c_size_t])
    info = libc.function("mallinfo2", _Mallinfo2, [])
    return None if trim is None or info is None else libc.load()


_LIBC = _libc()


def free_bytes() -> int | None:
    """Bytes malloc holds free in its arenas (None where unknown)."""
    return int(_LIBC.mallinfo2().fordblks) if _LIBC is not None else None


def trim() -> bool:
    """Return every whole free page malloc holds to the OS; True if any was."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def pause(stop: threading.Event, seconds: float) -> bool:
    """Sleep ``seconds``; True if ``stop`` is set then. For a unit's threads that sleep
    most of the time (the trimmer, the heartbeat): ``stop.wait(seconds)`` would return as
    soon as it is set, but it makes a lock and an argument tuple that are alive while it
    waits, so nearly always, and they pin whatever pymalloc pool (and 1 MiB arena) they
    landed in, perhaps one the rows filled (docs/performance.md, *Unit memory*)."""
    time.sleep(seconds)
    return stop.is_set()


class Trimmer:
    """Calls :func:`trim` when malloc's free bytes grew by ``threshold`` since the last trim
    (memory stays bounded during a long burst of drops), and once more when they stopped
    changing (by less than ``QUIET_BYTES``) for ``quiet_checks`` checks in a row after
    having changed since the last trim (the unit went quiet after freeing rows or a
    request's buffers: settle at idle + live). Waiting for quiet
    rather than trimming at once lets a put that follows a clear (the usual training loop)
    reuse the freed pages instead of faulting fresh ones."""

    def __init__(self, threshold: int = TRIM_BYTES, period: float = PERIOD,
                 quiet_checks: int = QUIET_CHECKS, collect_if: Callable[[], bool] | None = None):
        self.threshold, self.period, self.quiet_checks = threshold, period, quiet_checks
        # Before a quiet trim, a full collection when collect_if() says it is cheap (a
        # unit holding few rows): it empties the interpreter's free lists (tuples, dicts,
        # floats kept for reuse); after a clear, those objects, spread over the arenas the
        # rows used, kept 1-2 MiB a unit resident (measured; docs/performance.md, *Unit memory*).
        self.collect_if = collect_if
        self._stop = threading.Event()
        # base (free bytes growth is measured from), last (free bytes at the last check),
        # same (consecutive checks that saw the same free bytes), trims done. In an array:
        # an int kept from one check to the next would be made beside the last one, in the
        # same pymalloc pool, and keep that pool's arena mapped (docs/performance.md,
        # *Unit memory*)
        free = free_bytes() or 0
        self._n = array("q", [free, free, 0, 0])
        self._moved = False  # free bytes changed since the last trim
        self._thread = threading.Thread(target=self._run, name="tqtx-trim", daemon=True)

    @property
    def trims(self) -> int:
        """How many times this watcher trimmed."""
        return self._n[_TRIMS]

    def check(self) -> bool:
        """One check; trims and returns True if it is time to."""
        free = free_bytes()
        if free is None:
            return False
        n = self._n
        # "the same" within QUIET_BYTES: a quiet unit still allocates a little (heartbeats,
        # stats), which must not keep it from ever counting as quiet
        if abs(free - n[_LAST]) < QUIET_BYTES:
            n[_SAME] += 1
        else:
            n[_SAME] = 0
            # Freed bytes may also be hidden by reuse between two checks (a put reusing a
            # clear's pages and freeing its request's buffers: no growth seen), so any
            # change counts as activity to trim after.
            self._moved = True
        n[_LAST] = free
        if free < n[_BASE]:
            n[_BASE] = free  # freed memory was reused: measure growth from here
        grown = free - n[_BASE]
        quiet = n[_SAME] >= self.quiet_checks and (self._moved or grown > QUIET_BYTES)
        if grown < self.threshold and not quiet:
            return False
        if quiet and self.collect_if is not None and self.collect_if():
            gc.collect()
        trim()
        n[_TRIMS] += 1
        n[_BASE] = n[_LAST] = free_bytes() or 0  # trimmed pages still count as free
        n[_SAME] = 0
        # A growth trim comes mid-burst: the quiet trim (and its collection) is still due
        # once the unit settles. Else a burst that ended with a growth trim (a restore over
        # live keys, then a clear) left the interpreter's free lists, filled while the rows
        # were held, pinning the rows' pymalloc arenas (measured: 6,000 blocks, +20% RSS).
        self._moved = not quiet
        return True

    def _run(self) -> None:
        while not pause(self._stop, self.period):
            try:
                self.check()
            except Exception as exc:  # never take the unit down for this
                log.warning("malloc trim watcher stopped: %s", exc)
                return

    def start(self) -> "Trimmer":
        if _LIBC is not None and self.threshold > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def single_arena() -> bool:
    """Make every thread of this process allocate from malloc's main arena (call before
    any thread starts). :func:`trim` can hand back all of the main arena's free memory,
    its top included, but not the free top of a thread's arena: rows read by an I/O
    thread and freed together become that top, and stayed resident (13-31 MiB a unit
    after a clear of a 128 MiB restore). True if set."""
    if _LIBC is None:
        return False
    _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(_LIBC.mallopt(M_ARENA_MAX, 1))


def start_trimmer(collect_if: Callable[[], bool] | None = None) -> Trimmer:
    """Start the watcher thread of this process (a unit's ``__main__`` calls it)."""
    return Trimmer(collect_if=collect_if).start()


# A frame that fits libzmq's shared receive buffer is a view into it: a stored row frame of
# 5 KiB would keep its whole 8 KiB buffer alive (measured: +4 KiB per 5 KiB row). tqtx's
# codec inlines such tensors in the header, so this copy guards against other senders only.
SHARED_RECV_LIMIT = ZMQ_RECV_BATCH


def own_small_frames(values: dict) -> dict:
    """A put row's field values with every tensor frame small enough to share a ZeroMQ
    receive buffer copied into bytes of its own (larger ones stay zero-copy, holding the
    frame itself rather than a view of it), and each tensor's dtype name and shape shared
    with the rows stored before (see share_header)."""
    out = None
    for field, v in values.items():
        if type(v) is RawTensor:
            share_header(v)
            data = v.data
            if type(data) is not memoryview:
                continue
            if data.nbytes <= SHARED_RECV_LIMIT:
                if out is None:
                    out = dict(values)
                out[field] = v.compact()
            elif isinstance(data.obj, zmq.Frame) and data.nbytes == len(data.obj):
                # The view and the buffer it manages are two more small objects (≈250
                # bytes) per stored tensor; they would outlive the request only to reach
                # the frame, whose buffer readers take as they took the view's.
                v.data = data.obj
    return values if out is None else out


def share_header(v: RawTensor) -> None:
    """Point a fresh, not yet stored tensor's dtype and shape at shared equal objects."""
    v.dtype = DTYPE_NAMES.get(v.dtype, v.dtype)
    if v.shape:
        v.shape = shared_shape(v.shape)
