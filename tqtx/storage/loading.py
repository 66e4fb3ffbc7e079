"""A unit's side of LOAD_ROWS: the claim sent ahead of the first read, and the read loop.

Used by :meth:`tqtx.storage.unit.StorageUnit._load_job` (and the read loop by REDO_RESTORE).
Reading changes nothing, so the unit's claim travels to the controller while the first
batch is read; the claim's reply is awaited before anything is staged and before the
first ``unit.load.after_read_batch`` point, so every fault point keeps its meaning.
"""
from __future__ import annotations

import logging
from functools import partial

from .. import format as fmt
from ..errors import PeerTimeoutError
from ..schema import validate_row
from ..wire.peer import CONNECT_TIMEOUT, Peer
from ..wire.values import value_nbytes

log = logging.getLogger("tqtx.unit")

BATCH = 128  # rows per read batch (docs/data_dump.md: "<=128 rows per batch")


class Report:
    """A RESTORE_UNIT report sent now, its reply awaited by :meth:`wait`.

    A lost reply is asked again with the same request ID (the controller answers from its
    record instead of acting twice). A controller that is gone is not retried: PeerDiedError
    as soon as its connection closes after the report was sent, or no connection is made
    within CONNECT_TIMEOUT, so a unit's LOAD_ROWS reply is not held up by retries that
    cannot succeed.
    """

    def __init__(self, peer: Peer, body: dict, *, attempts: int = 3, timeout: float = 15.0):
        if peer.connect_timeout is None:
            peer.connect_timeout = CONNECT_TIMEOUT
        self.peer, self.body, self.attempts, self.timeout = peer, body, attempts, timeout
        self.done = False
        self.first = peer.start("RESTORE_UNIT", body)
        self.rid = self.first.rid

    def wait(self):
        """The controller's reply; raises what the controller answered (e.g. a refusal)."""
        self.done = True
        peer, body = self.peer, self.body
        for attempt in range(self.attempts):
            try:
                if attempt == 0:
                    return self.first.wait(self.timeout)
                return peer.call("RESTORE_UNIT", body, rid=self.rid, timeout=self.timeout)
            except PeerTimeoutError:
                if attempt == self.attempts - 1:
                    raise
                log.warning("restore %s: unit %s: no reply to RESTORE_UNIT %s; retrying",
                            body["restore_id"], body["unit_id"], body["action"])


class ReadPlan:
    """LOAD_ROWS items (:class:`tqtx.plan.LoadItem`) grouped for reading: per shard path
    the distinct records to read (``[src, offset, length, crc]``) and the row each must
    name (``expect``: ``{src: (None, key, generation or None)}``, for version 2 dumps);
    per ``(path, src)`` the ``(dest, gen)`` rows it fills."""

    def __init__(self, items, *, check_key: bool):
        self.by_shard: dict[str, list] = {}
        self.expect: dict[str, dict] = {}
        self.targets: dict[tuple[str, int], list] = {}
        for it in items:
            key = (it.path, it.src)
            t = self.targets.get(key)
            if t is None:
                self.by_shard.setdefault(it.path, []).append([it.src, it.offset, it.length,
                                                              it.crc])
                if check_key:
                    self.expect.setdefault(it.path, {})[it.src] = (None, it.key, it.src_gen)
                self.targets[key] = [(it.dest, it.gen)]
            else:
                t.append((it.dest, it.gen))


def read_and_check(reads: ReadPlan, schema: dict, staged: dict, after_batch):
    """Read every record (checksums and, in version 2 dumps, the key and generation it
    names verified), check it against ``schema`` and put it in ``staged`` ({dest: (gen,
    row)}); ``after_batch()`` runs after each batch of at most :data:`BATCH` rows. Returns
    the value bytes read (once per distinct record)."""
    nbytes = 0
    targets = reads.targets
    for path, entries in reads.by_shard.items():
        for batch in fmt.read_records(path, entries, batch=BATCH,
                                      expect=reads.expect.get(path)):
            for src, row in batch:
                validate_row(row, schema, where=partial(_location, path, src))
                for dest, gen in targets[(path, src)]:
                    staged[dest] = (gen, row)
                for v in row.values():
                    nbytes += value_nbytes(v)
            after_batch()
    return nbytes


def _location(path, src) -> str:
    return f"{path} record of global index {src}"
