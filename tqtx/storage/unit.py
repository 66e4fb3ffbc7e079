"""A storage unit process: payload rows in memory, shard I/O for dumps and restores.

The request loop runs quick operations (put, get, drop, apply) inline and hands
long file I/O (DUMP_ROWS, LOAD_ROWS, checkpoints) to worker threads, so puts and gets
keep flowing while a dump is written. Rows are never modified in place: a put
replaces the value objects, so a dump snapshots rows by reference.

Every row is held with its generation (``gens``, see :mod:`tqtx.controller.metadata`):
the key incarnation the controller gave that index. A request that reads rows by index
names the generations it expects and is served only if every row holds them
(:class:`~tqtx.errors.StaleRowsError` otherwise: the client asks the controller again); a
write of an older generation than the row holds is refused, a newer one replaces the row;
a drop takes only a row of the generation it names. So a request that raced a clear and
the index's reuse never reads, dumps, overwrites or drops another key's row.

With durability ``buffer`` or ``sync`` every change of the rows is also queued to the row
log (:mod:`tqtx.storage.rowlog`) at the end of the request that made it, and the unit
replays that log when it starts, before it registers.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .. import faults
from ..errors import StaleRowsError
from ..format.rowlog import MARK_RESTORE
from ..placement.probe import node_name, unit_probe
from ..wire import shm
from ..wire.peer import Peer
from ..wire.rpc import Server
from ..wire.values import forget_shapes
from .attach import UnitAttachment
from .checkpoints import UnitCheckpoints
from .dumps import UnitDumps
from .memory import free_bytes, own_small_frames
from .restore import RestoreWorker
from ..wire.columns import rows_of_columns
from .replies import into_reply, reply_columns
from .rowlog import RowLog
from .rows import SharedViews, drop_from, store_into

log = logging.getLogger("tqtx.unit")


# The named totals a unit adds to (made at start-up: see Metrics.declare).
UNIT_TOTALS = ("dumps_total", "dump_rows_total", "dump_bytes_total", "dump_seconds_total",
               "dump_errors_total", "loads_total", "load_rows_total", "load_bytes_total",
               "load_seconds_total")


IO_THREADS = 4
# Requests that change rows; with a row log they write it before replying, and with
# durability sync those that store rows reply once it is fsynced (a dropped row needs no
# fsync: the controller's journal no longer names it, so a replay that finds it drops it).
LOGGED_OPS = ("PUT_ROWS", "DROP_ROWS", "APPLY_STAGED", "APPLY_CHECKPOINT")
SYNCED_OPS = ("PUT_ROWS", "APPLY_STAGED", "APPLY_CHECKPOINT")
READ_OPS = ("GET_ROWS", "GET_INTO")  # with sync, answered once what they may read is durable


def _start_all(pool: ThreadPoolExecutor, timeout: float = 10.0) -> bool:
    """Start every thread of ``pool`` now (it starts them lazily, one a busy submit): a
    thread's objects live as long as it does, and one started during a big restore would
    keep the memory pages the restored rows' objects used (docs/performance.md, *Unit memory*).
    False if they did not all start within ``timeout`` (the rest then start when needed:
    a unit is not refused for this)."""
    gate = threading.Barrier(IO_THREADS + 1)
    for _ in range(IO_THREADS):
        pool.submit(gate.wait, timeout)
    try:
        gate.wait(timeout)
        return True
    except threading.BrokenBarrierError:
        log.warning("unit I/O threads: not all %d started within %gs; the rest start when "
                    "needed", IO_THREADS, timeout)
        return False


class StorageUnit:
    """A storage unit: its rows (``rows``, ``gens``), the roles that serve them (``attach``:
    REGISTER_UNIT and the heartbeat; ``restore``: the restore steps; ``checkpoints``: the
    checkpoint steps; ``dumps``: the dump steps), its row log (``rowlog``, or None) and the
    request table of its server."""

    def __init__(self, unit_id: int, controller_address: str, *, host: str = "127.0.0.1",
                 port: int = 0, curve=None, client_curve=None, log_dir: str | None = None,
                 sync: bool = False, flush_interval: float = 1.0):
        self.unit_id = unit_id
        self.controller_address = controller_address
        self.client_curve = client_curve
        self.server = Server(f"unit-{unit_id}", host, port, curve=curve)
        self.address = self.server.address
        self.metrics = self.server.metrics
        self.started = time.time()
        # the rows: only the request loop writes them (see the module docstring)
        self.rows: dict[int, dict] = {}
        self.gens: dict[int, int] = {}  # index -> generation of the row held there
        self.bytes_held = 0  # running total of the live rows' value bytes (no O(rows) stats)
        self.reply_files = shm.ReplyFiles(unit_id)
        self.pool = ThreadPoolExecutor(max_workers=IO_THREADS,
                                       initializer=self.server.prepare_thread,
                                       thread_name_prefix=f"unit{unit_id}-io")
        _start_all(self.pool)
        self.trimmer = None  # the process's malloc trimmer (storage/__main__ starts it)
        # the roles
        self.attach = UnitAttachment(self)
        self.restore = RestoreWorker(self)
        self.checkpoints = UnitCheckpoints(self)
        self.dumps = UnitDumps(self)
        # durability buffer / sync: the rows are also in a log in log_dir, replayed here
        self.rowlog: RowLog | None = None
        self.views = SharedViews(lambda: self.rows)
        self.remove_log = False  # set by a SHUTDOWN without keep_buffer
        self.replayed: dict | None = None
        if log_dir is not None:
            self._open_log(log_dir, sync, flush_interval)
        self._register_handlers()

    def _open_log(self, log_dir: str, sync: bool, interval: float) -> None:
        """Open the row log, replay it into the rows, then log every change from here on."""
        rowlog = RowLog(log_dir, sync=sync, interval=interval,
                        live_bytes=lambda: self.bytes_held,
                        rows=lambda: (self.rows, self.gens), remembers=self._remembers)
        self.replayed = rowlog.replay(self.store_row, self._drop_row, self._reset_rows,
                                      self._replay_mark)
        # replayed rows share their files' buffers, which drops can leave mostly dead
        self.views.watch(self.bytes_held)
        self.replayed["copied_bytes"] = self.views.look(self.bytes_held)
        self.replayed["dir"] = log_dir
        if not (self.replayed["entries"] or self.replayed["torn"]):
            self.replayed = None  # a new log: nothing to report
        if self.replayed is not None:
            log.info("unit %d: replayed %d rows from its row log %s (%d entries, %d bytes, "
                     "%.3fs)", self.unit_id, len(self.rows), log_dir,
                     self.replayed["entries"], self.replayed["bytes"], self.replayed["seconds"])
        self.rowlog = rowlog.start(self.server.call_soon, self.server.turn_hooks)

    def _register_handlers(self) -> None:
        s = self.server
        for op, fn, mutating in [
            ("PING", self.ping, False), ("PUT_ROWS", self.put_rows, True),
            ("GET_ROWS", self.get_rows, False), ("GET_INTO", self.get_into, False),
            ("DROP_ROWS", self.drop_rows, True),
            ("DUMP_ROWS", self.dumps.dump_rows, True),
            ("DUMP_SNAPSHOT", self.dumps.dump_snapshot, True),
            ("DUMP_WAIT", self.dumps.dump_wait, False),
            ("DUMP_CANCEL", self.dumps.dump_cancel, False),
            ("LOAD_ROWS", self.restore.load_rows, True),
            ("APPLY_STAGED", self.restore.apply_staged, True),
            ("DROP_STAGED", self.restore.drop_staged, True),
            ("REDO_RESTORE", self.restore.redo_restore, True),
            ("SAVE_CHECKPOINT", self.checkpoints.save, True),
            ("LOAD_CHECKPOINT", self.checkpoints.load, True),
            ("APPLY_CHECKPOINT", self.checkpoints.apply, True),
            ("DROP_CHECKPOINT", self.checkpoints.drop, True),
            ("STATS", self.stats, False), ("GET_STATS", self.stats, False),
            ("PROBE_PATH", self.probe_path, False), ("SHUTDOWN", self.shutdown, True),
        ]:
            if self.rowlog is not None and op in LOGGED_OPS:
                fn = self._logged(fn, stores=op in SYNCED_OPS)
            elif self.rowlog is not None and self.rowlog.sync and op in READ_OPS:
                fn = self._read_durable(fn)
            s.add(op, fn, mutating=mutating)
        m = self.metrics
        m.declare(totals=UNIT_TOTALS)
        m.gauge("rows_held", lambda: len(self.rows))
        m.gauge("bytes_held", lambda: self.bytes_held)
        m.gauge("open_restores", lambda: len(self.restore.staging))
        if self.rowlog is not None:
            m.gauge("row_log_bytes", lambda: self.rowlog.stats()["disk_bytes"])

    def _logged(self, fn, *, stores: bool):
        """``fn`` followed by queueing what it logged. A request that ``stores`` rows is
        refused while the log cannot be written, and with ``sync`` its reply waits for the
        fsync of its rows."""
        rowlog, server = self.rowlog, self.server
        sync = stores and rowlog.sync

        def handler(body, req):
            if stores:
                rowlog.refuse_if_failing()
            reply = fn(body, req)
            if not rowlog.dirty:
                return reply
            rowlog.write()
            return server.hold(req, reply, rowlog.reply_when_durable) if sync else reply
        return handler

    def _read_durable(self, fn):
        """``fn`` (a read) whose reply waits, with ``sync``, for the fsync of every change
        made before it: a row overwritten in place is read from its put on, and a reader
        shown it must not see the old row again after a power loss."""
        rowlog, server = self.rowlog, self.server

        def handler(body, req):
            reply = fn(body, req)
            return server.hold(req, reply, rowlog.reply_when_durable) if rowlog.undurable \
                else reply
        return handler

    def write_log(self) -> None:
        """Write what the row log holds pending (loop thread; for changes made outside a
        request handler)."""
        if self.rowlog is not None:
            self.rowlog.write()

    def controller(self) -> Peer:
        return Peer(self.controller_address, "controller", timeout=60, curve=self.client_curve)

    # ---------------------------------------------------------------- kv
    def ping(self, body, req):
        return {"unit_id": self.unit_id}

    def probe_path(self, body, req):
        """Can this unit reach a dump target's parent? (see :mod:`tqtx.placement.probe`)"""
        return unit_probe(self.unit_id, body)

    def shutdown(self, body, req):
        """Stop serving. The row log is removed unless ``keep_buffer``: a SHUTDOWN is a
        clean close (a signal keeps the log, so a preempted job recovers)."""
        self.remove_log = not (body or {}).get("keep_buffer")
        self.server.stop()
        return {"ok": True}

    def store_row(self, idx: int, gen: int, values: dict) -> int | None:
        """Store ``values`` at ``idx`` as generation ``gen``: merged into a row of that
        generation (copy-on-write: snapshots of the old row stay intact), replacing a row
        of an older one (another key left it). None, and nothing stored, where the row is
        newer; else the bytes of ``values``. Used by puts and restores alike."""
        stored = store_into(self.rows, self.gens, idx, gen, values)
        if stored is None:
            return None
        if self.rowlog is not None:
            self.rowlog.row(idx, gen, values)
        nbytes, freed = stored
        self.bytes_held += nbytes - freed
        if freed:  # most puts store new rows: no call for them
            self.views.went(freed, self.bytes_held)
        return nbytes

    def put_rows(self, body, req):
        """Store rows (``idx``: their indexes and ``cols``: field -> the rows' values, or
        ``rows``: ``[index, values]`` each; ``gens``: the generation of each; see
        :meth:`store_row`). With ``from`` (``hint``, ``cols``), tensor columns are read
        from a same-host client's memory first (:meth:`shm.ReplyFiles.read_from`). Rows
        refused because the index holds a newer generation (the put's key was cleared and
        the index given to another key since ALLOC) come back as ``stale``."""
        items, want = body.get("rows"), body["gens"]
        src = body.get("from")
        if src is not None:
            if not isinstance(src, dict) or not isinstance(body.get("cols"), dict):
                raise ValueError("PUT_ROWS: 'from' must be a map, beside a map 'cols'")
            try:
                read = self.reply_files.read_from(src.get("hint"), src.get("cols"))
            except OSError as exc:  # nothing stored: the client sends frames instead
                return {"from_failed": str(exc)}  # the client names the unit
            body["cols"].update(read)
            faults.hit("unit.put.after_read")
        if items is None:
            items = rows_of_columns(body["idx"], body["cols"])
        if len(want) != len(items):
            raise ValueError(f"PUT_ROWS: {len(want)} generations for {len(items)} rows")
        store = self.store_row
        nbytes = 0
        stale, written = [], []
        # Each decoded tensor owns its frame (or inline bytes): storing it pins nothing else
        # (frames that would share a ZeroMQ receive buffer are copied out of it).
        for (idx, values), gen in zip(items, want):
            n = store(idx, gen, own_small_frames(values))
            if n is None:
                stale.append(idx)
            else:
                nbytes += n
                written.append(idx)
        if self.attach.write_watch:  # a registration in flight: these rows survive its reply
            self.attach.note_writes(written)
        reply = {"rows": len(written), "bytes": nbytes}
        if stale:
            reply["stale"] = stale
        return reply

    def get_rows(self, body, req):
        return reply_columns(self._columns(body), body.get("shm"), self.reply_files)

    def get_into(self, body, req):
        """The second step of a same-host get (see :mod:`tqtx.wire.shm`): the tensor
        columns copied into the client's result buffers, the rest in the reply."""
        if len(body.get("into") or ()) != len(body["fields"]):
            raise ValueError(f"GET_INTO: {len(body.get('into') or ())} targets for "
                             f"{len(body['fields'])} fields")
        return into_reply(self._columns(body), body, self.reply_files)

    def stale(self, indexes, want, what: str) -> StaleRowsError:
        gens = self.gens
        stale = [i for i, g in zip(indexes, want) if gens.get(i) != g]
        return StaleRowsError(f"unit {self.unit_id}: {what}: no row of the named generation at "
                              f"global index(es) {stale[:10]}", stale)

    def _columns(self, body) -> list[list]:
        """Per field of ``body["fields"]``, the values of the rows at ``body["indexes"]``,
        each of the generation ``body["gens"]`` names (else StaleRowsError)."""
        fields, indexes, want = body["fields"], body["indexes"], body["gens"]
        if len(want) != len(indexes):
            raise ValueError(f"{len(want)} generations for {len(indexes)} indexes")
        if list(map(self.gens.get, indexes)) != want:
            raise self.stale(indexes, want, "read")
        out = []
        rows = self.rows
        for idx in indexes:
            row = rows[idx]
            try:
                out.append([row[f] for f in fields])
            except KeyError as exc:
                # The row came back without a field its key had: this unit restarted and the
                # row was only partly written again. The controller names it lost once this
                # unit has re-registered; until then the read is retried.
                raise StaleRowsError(f"unit {self.unit_id}: row {idx} has no field {exc}",
                                     [idx]) from None
        return [[r[j] for r in out] for j in range(len(fields))]

    def drop_rows(self, body, req):
        """Forget the rows at ``indexes`` that still hold the generation ``gens`` names."""
        indexes, want = body["indexes"], body["gens"]
        if len(want) != len(indexes):
            raise ValueError(f"DROP_ROWS: {len(want)} generations for {len(indexes)} indexes")
        rows, gens = self.rows, self.gens
        n = freed = 0
        logged = [] if self.rowlog is not None else None  # (index, generation) dropped
        for idx, gen in zip(indexes, want):
            nbytes = drop_from(rows, gens, idx, gen)
            if nbytes is not None:
                freed += nbytes
                n += 1
                if logged is not None:
                    logged.append((idx, gen))
        self.bytes_held -= freed
        if logged:
            self.rowlog.drop([i for i, _ in logged], [g for _, g in logged])
        if n and not self.rows:
            self._emptied()
        else:
            self.views.went(freed, self.bytes_held)
        return {"dropped": n}

    def replace_rows(self, rows: dict[int, dict], gens: dict[int, int], nbytes: int, *,
                     shared: bool = False) -> None:
        """Make ``rows`` (of generations ``gens``, ``nbytes`` value bytes) the unit's rows
        (a checkpoint switch); the row log records the reset and every new row. ``shared``:
        some rows are views of buffers they share (read regions, a checkpoint's row log
        files), watched as drops go (:class:`SharedViews`)."""
        self.rows, self.gens, self.bytes_held = rows, gens, nbytes
        self.views.stop()
        if shared:
            self.views.watch(nbytes)
        rowlog = self.rowlog
        if rowlog is not None:
            rowlog.reset()
            for idx, row in rows.items():
                rowlog.row(idx, gens[idx], row)

    def _replay_mark(self, what: str, ident: str, rows: int) -> None:
        """Replay of a logged mark: the unit applied that restore or checkpoint load (a
        roll-forward after the restart is answered as done, never applied again)."""
        if what == MARK_RESTORE:
            self.restore.applied.record(ident, rows)
        else:
            self.checkpoints.applied = ident

    def _remembers(self, what: str, ident: str) -> bool:
        """Whether a compaction keeps a mark: the unit still answers by it."""
        if what == MARK_RESTORE:
            return ident in self.restore.applied
        return self.checkpoints.applied == ident

    def _drop_row(self, idx: int, gen: int) -> None:
        """Replay of a logged drop."""
        self.bytes_held -= drop_from(self.rows, self.gens, idx, gen) or 0

    def _reset_rows(self) -> None:
        """Replay of a logged reset (a checkpoint's rows follow)."""
        self._emptied()
        self.bytes_held = 0

    def _emptied(self) -> None:
        """The last row went: let go of what only rows needed, so the memory pages it sits
        on can go back to the OS (docs/performance.md, *Unit memory*). A dict keeps its
        table at its largest size; clear() frees it (the same dict: others hold it)."""
        self.rows.clear()
        self.gens.clear()
        self.views.stop()
        forget_shapes()

    def stats(self, body, req):
        """GET_STATS (alias STATS): rows/bytes held (running totals), staged restores, ops."""
        m = self.metrics
        return {"role": "unit", "unit_id": self.unit_id, "pid": os.getpid(), "node": node_name(),
                "uptime": time.time() - self.started, "address": self.address,
                "rows": len(self.rows), "bytes": self.bytes_held,
                "staged_restores": self.restore.staged_ids(),
                "open_dumps": list(self.dumps.jobs),
                "metrics_enabled": m.enabled, "gc_frozen": gc.get_freeze_count(),
                "reply_files": self.reply_files.files,
                "result_copies": self.reply_files.copies,
                "put_reads": self.reply_files.reads,
                "ops": m.ops_snapshot(), "totals": m.totals_snapshot(),
                # malloc's free bytes (resident or handed back) and how often it trimmed
                "malloc_free_bytes": free_bytes(),
                "malloc_trims": self.trimmer.trims if self.trimmer is not None else 0,
                "row_log": self.rowlog.stats() if self.rowlog is not None else None}

    def serve_forever(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self.attach.stopped.set()
            self.pool.shutdown(wait=True)
            if self.rowlog is not None:
                self.rowlog.close(remove=self.remove_log)
