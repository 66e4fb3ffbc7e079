"""A bounded map of request ID -> bytes that makes no Python object per entry.

Servers keep the outcome of their last few thousand mutating requests (the reply cache of
:class:`~tqtx.wire.rpc.Server`, a unit's applied restores) so that a retried request gets
the recorded outcome. Kept as dict entries, every outcome is a few small objects (key
string, value bytes, dict or list) that live for thousands of requests; those made while
a unit held many rows sit among the rows' small objects in pymalloc's 1 MiB arenas, and
one survivor keeps its whole arena mapped after the rows are cleared (docs/performance.md,
*Unit memory*). Here an entry is bytes in one anonymous mapping made at start-up (slots
written round-robin, the oldest replaced first) plus a slot number in an open-addressing
table (an ``array``): inserting and finding allocate only transient objects.

An entry whose key and value do not fit a slot (large replies, rare), or whose value is
not bytes (a reply of several frames), is kept in an ordinary bounded dict instead.
"""
from __future__ import annotations

import mmap
import threading
from array import array
from collections import OrderedDict

_EMPTY = -1


class IdRecords:
    """A map ``str -> bytes`` that keeps an entry for the ``capacity`` inserts after it
    (a key inserted again starts over): at most ``capacity`` entries, the oldest forgotten.
    A value that is not bytes-like is kept as it is, in the bounded dict."""

    def __init__(self, capacity: int = 4096, slot_bytes: int = 256):
        if capacity < 1 or slot_bytes < 16:
            raise ValueError("IdRecords needs capacity >= 1 and slot_bytes >= 16")
        self.capacity, self.slot_bytes = capacity, slot_bytes
        # anonymous memory: only the pages of slots written so far become resident
        self._buf = mmap.mmap(-1, capacity * slot_bytes)
        self._klen = array("i", [_EMPTY]) * capacity  # key length of a slot; -1: unused
        self._vlen = array("i", [0]) * capacity
        self._hash = array("q", [0]) * capacity
        self._pos = array("i", [_EMPTY]) * capacity  # a used slot's position in the table
        size = 1 << (2 * capacity - 1).bit_length()  # at most half full
        self._table = array("i", [_EMPTY]) * size
        self._mask = size - 1
        self._next = 0  # the slot written next (the oldest once all are used)
        self._large: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0  # slots holding an entry
        self._lock = threading.Lock()  # a worker thread may record while the loop looks up

    def __len__(self) -> int:
        return self._used + len(self._large)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def get(self, key: str, default=None):
        """The value recorded for ``key`` (bytes, or what was stored if not bytes-like),
        or ``default``."""
        kb = key.encode()
        with self._lock:
            pos = self._find(kb, hash(kb))
            if pos >= 0:
                s = self._table[pos]
                off = s * self.slot_bytes + len(kb)
                return self._buf[off:off + self._vlen[s]]
            return self._large.get(key, default)

    def __setitem__(self, key: str, value) -> None:
        kb = key.encode()
        with self._lock:
            self._set(kb, hash(kb), key, value)

    def _set(self, kb: bytes, h: int, key: str, value) -> None:
        pos = self._find(kb, h)
        if pos >= 0:
            self._unlink(pos)
        else:
            self._large.pop(key, None)
        raw = isinstance(value, (bytes, bytearray, memoryview))
        if not raw or len(kb) + len(value) > self.slot_bytes:
            self._large[key] = bytes(value) if raw else value
            while len(self._large) > self.capacity:
                self._large.popitem(last=False)
            return
        s = self._next
        self._next = (s + 1) % self.capacity
        if self._klen[s] != _EMPTY:  # forget the slot's oldest entry
            self._unlink(self._pos[s])
        off = s * self.slot_bytes
        self._buf[off:off + len(kb) + len(value)] = kb + value
        self._klen[s], self._vlen[s], self._hash[s] = len(kb), len(value), h
        self._used += 1
        table, mask = self._table, self._mask
        pos = h & mask
        while table[pos] != _EMPTY:
            pos = (pos + 1) & mask
        table[pos] = s
        self._pos[s] = pos

    def _find(self, kb: bytes, h: int) -> int:
        """Table position of the slot holding ``kb``, or -1."""
        table, hashes, mask, n = self._table, self._hash, self._mask, len(kb)
        pos = h & mask
        while True:
            s = table[pos]
            if s == _EMPTY:
                return -1
            if hashes[s] == h and self._klen[s] == n:
                off = s * self.slot_bytes
                if self._buf[off:off + n] == kb:
                    return pos
            pos = (pos + 1) & mask

    def _unlink(self, pos: int) -> None:
        """Remove table position ``pos`` (its slot becomes unused), shifting back the
        entries after it that would otherwise no longer be found (linear probing)."""
        table, hashes, mask = self._table, self._hash, self._mask
        self._klen[table[pos]] = _EMPTY
        self._used -= 1
        hole, j = pos, pos
        while True:
            j = (j + 1) & mask
            s = table[j]
            if s == _EMPTY:
                break
            home = hashes[s] & mask
            # the entry at j may move to the hole unless its home lies in (hole, j]
            if (hole < j and not hole < home <= j) or (hole > j and j < home <= hole):
                table[hole] = s
                self._pos[s] = hole
                hole = j
        table[hole] = _EMPTY
