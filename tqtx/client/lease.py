"""Indexes leased to this client for puts of new keys.

A put of keys the client believes new writes their rows at leased ``(index, generation)``
pairs and publishes them with one COMMIT_PUT, without ALLOC's round trip first. The
controller makes the keys pending at those indexes only if ALLOC would have made them so
(every key new, schemas compatible, no restore loading into the partition) and the lease
still holds; otherwise it takes the lease back, the client drops the rows it wrote there
and puts the keys through ALLOC (:func:`tqtx.client.put_path.put_columns`). Rows at a
leased index are invisible until that commit: no key maps to the index before it.

A lease is asked for with an ALLOC and is good for one controller incarnation, one process
(a forked child holds none of its parent's) and at most LEASE_MAX_AGE seconds.
``TQTX_PUT_LEASE=0`` turns leases off for the clients a process makes (every put then
takes ALLOC's path, as tests of that path's interleavings need).
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque

LEASE_SIZE = 64          # indexes asked for with an ALLOC when fewer than LEASE_LOW remain
LEASE_LOW = 8
MAX_LEASED_KEYS = 16     # a larger put takes ALLOC's path: its round trip is a small share
LEASE_MAX_AGE = 300.0    # half the controller's LEASE_TTL
KNOWN_KEYS = 4096        # keys this client put lately (and did not clear): an update


class PutLease:
    """The leased pairs of one Client (thread-safe: each pair goes to one put)."""

    def __init__(self):
        self.enabled = os.environ.get("TQTX_PUT_LEASE", "1") != "0"
        self._lock = threading.Lock()
        self._free: deque = deque()
        self._pid = os.getpid()
        self._incarnation = None
        self._granted = 0.0
        self._known: OrderedDict = OrderedDict()  # (partition, key) put by this client

    def wanted(self) -> int:
        """How many indexes an ALLOC should ask to lease now (0: enough are left)."""
        return LEASE_SIZE if self.enabled and len(self._free) < LEASE_LOW else 0

    def add(self, lease, incarnation) -> None:
        """Keep the ``[indexes, gens]`` an ALLOC of controller ``incarnation`` leased."""
        with self._lock:
            self._forget_stale(incarnation)
            self._free.extend(zip(*lease))
            self._granted = time.monotonic()

    def take(self, pid: str, keys: list[str], incarnation) -> tuple[list, list] | None:
        """``(indexes, gens)`` for a put of ``keys`` through the lease, or None: the put is
        too large, repeats a key, names a key this client put lately (an update: ALLOC
        knows its index), or too few pairs are left of a lease of ``incarnation``."""
        n = len(keys)
        if n > MAX_LEASED_KEYS or not self.enabled or len(set(keys)) != n:
            return None
        with self._lock:
            self._forget_stale(incarnation)
            known = self._known
            if len(self._free) < n or any((pid, k) in known for k in keys):
                return None
            pairs = [self._free.popleft() for _ in range(n)]
        return [i for i, _ in pairs], [g for _, g in pairs]

    def remember(self, pid: str, keys: list[str]) -> None:
        """Keys of a small put that stored them: a put of one again is an update."""
        if len(keys) > MAX_LEASED_KEYS:
            return
        with self._lock:
            known = self._known
            for k in keys:
                known[(pid, k)] = None
                known.move_to_end((pid, k))
            while len(known) > KNOWN_KEYS:
                known.popitem(last=False)

    def forget(self, pid: str, keys) -> None:
        """Keys this client clears: a put of one again is of a new key."""
        with self._lock:
            known = self._known
            if known:
                for k in keys:
                    known.pop((pid, k), None)

    def _forget_stale(self, incarnation) -> None:
        """Drop the lease if it is not this process's, its controller's or is too old."""
        if (self._pid != os.getpid() or incarnation != self._incarnation
                or time.monotonic() - self._granted > LEASE_MAX_AGE):
            self._free.clear()
            self._pid, self._incarnation = os.getpid(), incarnation
