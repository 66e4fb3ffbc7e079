"""Selective dump by key: the client orchestrates, the owning units write their rows.

The controller describes the rows (metadata only); each owner unit snapshots its rows
and writes one shard and its index; the client writes the row index and manifest and
publishes the staging directory crash-safely (see :mod:`tqtx.journal.publish`).
"""
from __future__ import annotations

import logging
import shutil
import threading
import time

from .. import faults, routing
from ..layout import paths
from .. import format as fmt
from .. import states as st
from ..client.fence import FENCE_ATTEMPTS, fence_pause, stale_keys_error
from ..client.get_path import read_rows
from ..errors import StaleRowsError
from ..process.gcpause import gc_paused
from ..journal.dump import DumpJournal
from ..arguments.table import DUMP_KEYS, check_keys
from ..arguments.kinds import check_utf8
from ..version import __version__
from ..wire.columns import NUMPY_DTYPE, unpack_int64
from ..wire.peer import call_many
from ..wire.rpc import new_id
from ..journal.publish import Publication, check_publish_target, dump_lock, recover_publications

log = logging.getLogger("tqtx.dump")

_handles_lock = threading.Lock()
_handles: dict[str, "DumpHandle"] = {}


class DumpCancelled(RuntimeError):
    """A background dump was cancelled before it was published."""


class DumpHandle:
    """A dump running in the background (``dump_data_by_key(..., block=False)``)."""

    def __init__(self, dump_dir: str, dump_id: str):
        self.dump_dir = dump_dir
        self.dump_id = dump_id
        self._done = threading.Event()
        self._snapshot = threading.Event()
        self._resumed = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._on_cancel = None
        self.background = False
        self.critical_path_seconds: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> dict:
        """Wait for the dump; return its report or raise its error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"dump {self.dump_id} to {self.dump_dir} still running "
                               f"after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> bool:
        """Ask the dump to stop; True if it will not be published (the old dump stays)."""
        if self.done():
            return self._error is not None
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel()
        self._done.wait()
        return self._error is not None

    def __repr__(self):
        state = st.DONE if self.done() else "running"
        return f"DumpHandle({self.dump_dir!r}, dump_id={self.dump_id}, {state})"


def settle_background_dumps(*, cancel: bool = False) -> dict:
    """Wait for (or cancel) every outstanding background dump; say which."""
    with _handles_lock:
        pending = [h for h in _handles.values() if not h.done()]
    report = {"waited": [], "cancelled": []}
    for h in pending:
        if cancel:
            h.cancel()
            report["cancelled"].append(h.dump_id)
            log.warning("dump %s: cancelled by close (background dump to %s)", h.dump_id,
                        h.dump_dir)
        else:
            try:
                h.result()
            except Exception as exc:  # reported by the handle's owner; close still proceeds
                log.error("dump %s: background dump failed (seen at close): %s", h.dump_id, exc)
            report["waited"].append(h.dump_id)
    return report


_warm_lock = threading.Lock()
_warmed = False


def warm() -> None:
    """The first dump's once-per-process work, done ahead (see :func:`tqtx.api.init`)."""
    global _warmed
    with _warm_lock:
        if _warmed:
            return
        _warmed = True
    import numpy  # noqa: F401 -- _per_unit's
    from ..journal.migrate import DUMP, warm as warm_journal
    from ..placement import probe  # noqa: F401
    from . import load  # noqa: F401 -- check_no_reader's
    warm_journal(DUMP)


def normalize_keys(keys) -> list[str]:
    """``keys`` checked as :func:`tqtx.dump_data_by_key` takes them (:data:`DUMP_KEYS`: a
    list, tuple or set of str), duplicates dropped (the first wins)."""
    return list(dict.fromkeys(check_keys("dump_data_by_key()", keys, DUMP_KEYS)))


def check_no_reader(client, journal: DumpJournal, dump_dir: str) -> None:
    """Refuse (RestorePendingError) while a restore that may still read ``dump_dir`` is open."""
    from .load import settle_reader
    for row in journal.active_restores():
        settle_reader(client, journal, dump_dir, row, action="a dump replacing it")


@gc_paused  # per-row objects, no cycles (see tqtx.process.gcpause)
def dump_data_by_key(client, dump_dir: str, keys, partition_id: str, *, via: str = "units",
                     block: bool = True):
    """See :func:`tqtx.dump_data_by_key`."""
    if via not in ("units", "client"):
        raise ValueError(f"via must be 'units' or 'client', got {via!r}")
    if not isinstance(partition_id, str) or not partition_id:
        raise TypeError(f"partition_id must be a non-empty str, got {partition_id!r}")
    check_utf8("partition_id", partition_id)
    keys = normalize_keys(keys)
    dump_dir = paths.check_path_arg(dump_dir, "dump_dir")
    check_publish_target(dump_dir, "dump")  # refuses before anything is touched
    if via == "units":  # every unit must reach the target's filesystem (no-op: all local)
        from ..placement.probe import check_units_reach
        check_units_reach(client, dump_dir, "dump")
    handle = DumpHandle(dump_dir, new_id())
    t0 = time.perf_counter()
    if block:
        _run(client, handle, keys, partition_id, via, None, t0)
        return handle.result()
    # The metadata round trip (and its O(rows) work) runs in this thread; the dump's thread
    # takes the lock (held until it publishes) and the units' snapshots, then hands back.
    handle.background = True
    described = _describe(client, handle, keys, partition_id, via, hold_tags=True)
    with _handles_lock:
        _handles[handle.dump_id] = handle
    thread = threading.Thread(target=_run,
                              args=(client, handle, keys, partition_id, via, described, t0),
                              name=f"tqtx-dump-{handle.dump_id[:8]}", daemon=True)
    thread.start()
    try:
        handle._snapshot.wait()
    finally:
        handle._resumed.set()
    handle.critical_path_seconds = time.perf_counter() - t0
    if handle.done() and handle._error is not None:
        with _handles_lock:
            _handles.pop(handle.dump_id, None)
        raise handle._error
    return handle


def _run(client, handle: DumpHandle, keys, pid, via, described, t0) -> None:
    try:
        handle._result = _dump(client, handle, keys, pid, via, described, t0)
    except BaseException as exc:
        handle._error = exc
    finally:
        handle._done.set()  # before _snapshot: a caller woken by a failure sees it done
        handle._snapshot.set()


def _describe(client, handle: DumpHandle, keys: list[str], pid: str, via: str, *,
              hold_tags: bool = False):
    """The rows' metadata (DESCRIBE) and the request to each owner unit.

    ``hold_tags`` (background dumps): the controller keeps the rows' tags as of this call
    and the dump's thread takes them (:func:`_take_tags`), so the O(rows) tags never
    cross the wire on the caller's path.
    """
    # Metadata first: unknown partition or keys fail here, before anything touches the disk.
    body = {"partition_id": pid, "keys": keys, "packed": True}
    if hold_tags:
        body["hold_tags"] = handle.dump_id
    desc = client.controller.call("DESCRIBE_ROWS_BY_KEY", body)
    faults.hit("client.dump.after_describe")
    per_unit = _per_unit(client, handle.dump_id, pid, keys, desc) if via == "units" else {}
    return desc, per_unit


def _take_tags(client, dump_id: str, desc: dict) -> None:
    """Fetch the tags DESCRIBE held for this dump, into ``desc`` (once)."""
    if "tags" not in desc:
        desc["tags"] = client.controller.call("TAKE_DUMP_TAGS", {"dump_id": dump_id})["tags"]


def _column(values):
    """A DESCRIBE column (packed, see :mod:`tqtx.wire.columns`, or a list) as an array."""
    import numpy as np
    return np.asarray(unpack_int64(values), dtype=np.int64)


def _per_unit(client, dump_id: str, pid: str, keys: list[str], desc: dict) -> dict[int, dict]:
    """Group the rows with fields by owner unit (``client.owner``: index mod units), each
    with the generation the unit must hold it at and its key (the records name both);
    vectorized: no Python work per row, which matters on a background dump's call path."""
    import numpy as np

    field_sets = desc["field_sets"]
    idx, sid = _column(desc["indexes"]), _column(desc["fields_of"])
    if not len(idx):
        return {}
    gens = _column(desc["gens"])
    names = np.asarray(keys, dtype=object)
    has_fields = np.asarray([bool(fs) for fs in field_sets])[sid]  # fieldless: row index only
    owner = routing.owner(idx, client.num_units)  # element-wise on the index array
    per_unit = {}
    for u in range(client.num_units):
        sel = has_fields & (owner == u)
        if not sel.any():
            continue
        per_unit[u] = {"dump_id": dump_id, "unit_id": u, "partition_id": pid,
                       "indexes": idx[sel].astype(NUMPY_DTYPE).tobytes(),
                       "gens": gens[sel].astype(NUMPY_DTYPE).tobytes(),
                       "keys": names[sel].tolist(),
                       "fields_of": sid[sel].astype(NUMPY_DTYPE).tobytes(), "field_sets": field_sets}
    return per_unit


def _moved(keys: list[str], desc: dict, exc: StaleRowsError) -> list[str]:
    """The keys of ``desc``'s rows at the indexes a StaleRowsError names."""
    stale = set(exc.indexes)
    return [k for k, i in zip(keys, _column(desc["indexes"]).tolist()) if i in stale]


def _snapshot(client, handle: DumpHandle, keys: list[str], pid: str, via: str, desc: dict,
              per_unit: dict) -> tuple[dict, dict]:
    """A background dump's snapshots (DUMP_SNAPSHOT on every owner unit), each of the rows
    at the generations DESCRIBE named: a row that moved since (its key cleared, or cleared
    and put again) makes the dump describe its keys again (at most FENCE_ATTEMPTS times).
    Returns the description the snapshots hold."""
    for attempt in range(FENCE_ATTEMPTS):
        try:
            client.fan_out("DUMP_SNAPSHOT", per_unit)
            return desc, per_unit
        except StaleRowsError as exc:
            _cancel_units(client, handle.dump_id, per_unit)  # those that did snapshot
            moved = _moved(keys, desc, exc)
        except BaseException:
            _cancel_units(client, handle.dump_id, per_unit)
            raise
        if attempt + 1 < FENCE_ATTEMPTS:
            fence_pause(attempt + 1)
            desc, per_unit = _describe(client, handle, keys, pid, via, hold_tags=True)
    raise stale_keys_error("dump_data_by_key", moved, pid)


def _dump(client, handle: DumpHandle, keys: list[str], pid: str, via: str, described,
          t0: float) -> dict:
    dump_dir, dump_id = handle.dump_dir, handle.dump_id
    desc, per_unit = described or _describe(client, handle, keys, pid, via)
    snapshotted = False
    try:
        # The lock comes before the snapshot, so dumps to one path publish in call order
        # (a later call waits here for an earlier one).
        with dump_lock(dump_dir):
            if handle.background and per_unit:
                # The caller gets control back once every owner unit holds its snapshot;
                # the staging directory and the writing happen after that.
                desc, per_unit = _snapshot(client, handle, keys, pid, via, desc, per_unit)
                snapshotted = True
                handle._on_cancel = lambda: _cancel_units(client, dump_id, per_unit)
            if handle.background:
                handle._snapshot.set()
                handle._resumed.wait()  # the caller runs first (else it waits for the GIL)
            faults.hit("client.dump.after_snapshot")
            _take_tags(client, dump_id, desc)
            if handle._cancel.is_set():
                raise DumpCancelled(f"dump {dump_id} to {dump_dir} was cancelled")
            rows, with_data = _rows(keys, desc)
            # One journal connection for the whole publication, recovery included.
            with DumpJournal(dump_dir) as journal:
                recover_publications(dump_dir, journal)
                check_publish_target(dump_dir, "dump")  # again, now under the lock
                check_no_reader(client, journal, dump_dir)
                pub = Publication(dump_dir, kind="dump", dump_id=dump_id, journal=journal)
                try:
                    for attempt in range(FENCE_ATTEMPTS):
                        shards_dir = pub.staging_dir / fmt.SHARDS_DIR
                        shards_dir.mkdir()
                        row_index = []  # the row index is written while the units write
                        try:
                            if via == "units":
                                for u, req in per_unit.items():
                                    req["path"] = str(pub.staging_dir / fmt.shard_file_name(u))
                                    req["index"] = True  # units write the shard's index beside it
                                written = _unit_write(client, handle, per_unit, snapshotted,
                                                      while_writing=lambda: row_index.append(
                                                          _write_row_index(pub.staging_dir,
                                                                           dump_id, pid, desc,
                                                                           rows)))
                                snapshotted = False  # the units' jobs end (and release) by themselves
                            else:
                                written = _client_write(client, pub.staging_dir, pid, keys,
                                                        with_data)
                            break
                        except StaleRowsError as exc:
                            # A blocking dump's unit met a row that moved since DESCRIBE (a
                            # background dump's snapshots were checked above): this attempt's
                            # shards go, the keys are described again.
                            shutil.rmtree(shards_dir)
                            moved = _moved(keys, desc, exc)
                            if attempt + 1 == FENCE_ATTEMPTS:
                                raise stale_keys_error("dump_data_by_key", moved, pid) from None
                            fence_pause(attempt + 1)
                            desc, per_unit = _describe(client, handle, keys, pid, via)
                            rows, with_data = _rows(keys, desc)
                    faults.hit("client.dump.after_units_written")
                    shards = _write_indexes(pub.staging_dir, dump_id, pid, via, desc, rows,
                                            with_data, written,
                                            row_index[0] if row_index else None)
                    if handle._cancel.is_set():
                        raise DumpCancelled(f"dump {dump_id} to {dump_dir} was cancelled")
                    pub.mark_written()
                    record = _DumpRecord(client, {
                        "dump_id": dump_id, "dump_dir": dump_dir, "partition_id": pid,
                        "keys": len(rows), "rows_with_data": len(with_data),
                        "shards": len(shards)})
                    # every writer fsynced its file
                    total = pub.commit(files_synced=True, on_published=record.send)
                except BaseException as exc:
                    if per_unit:
                        _cancel_units(client, dump_id, per_unit)
                    pub.abort(f"{type(exc).__name__}: {exc}")
                    raise
    except BaseException as exc:
        if snapshotted:
            _cancel_units(client, dump_id, per_unit)  # release the snapshots
        if "tags" not in desc:  # release the controller's hold
            try:
                _take_tags(client, dump_id, desc)
            except Exception:  # noqa: BLE001 -- best effort: the hold expires by itself
                pass
        log.error("dump %s: to %s failed: %s", dump_id, dump_dir, exc)
        if handle._cancel.is_set() and not isinstance(exc, DumpCancelled):
            raise DumpCancelled(f"dump {dump_id} to {dump_dir} was cancelled") from exc
        raise
    report = {"keys": len(rows), "rows_with_data": len(with_data), "shards": len(shards),
              "bytes": total, "dump_id": dump_id, "seconds": time.perf_counter() - t0,
              "dump_dir": dump_dir, "partition_id": pid, "via": via}
    record.wait()
    log.info("dump %s: %d keys (%d with data) to %s, %d bytes in %.3fs", dump_id, len(rows),
             len(with_data), dump_dir, total, report["seconds"])
    client.count("dumps", len(with_data), total)
    return report


class _DumpRecord:
    """The controller journal's audit row of a published dump (RECORD_DUMP), best effort:
    sent the moment the dump is published, its reply awaited once the old dump is gone,
    so the controller's journal write overlaps that cleanup."""

    def __init__(self, client, body: dict):
        self.client, self.body = client, body
        self.pending = None

    def send(self, size: int) -> None:
        try:
            self.pending = self.client.controller.start("RECORD_DUMP",
                                                        {**self.body, "bytes": size})
        except Exception as exc:  # the dump is published; the audit row is best effort
            self._warn(exc)

    def wait(self) -> None:
        if self.pending is None:
            return
        try:
            self.pending.wait()
        except Exception as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        log.warning("dump %s: could not record it in the controller journal: %s",
                    self.body["dump_id"], exc)


@gc_paused  # also in a background dump's thread: a short, O(rows) step
def _rows(keys: list[str], desc: dict) -> tuple[list, list]:
    """Row-index rows ``[key, index, fields, tag, generation]``, and those with fields."""
    field_sets = desc["field_sets"]
    indexes, fields_of = _column(desc["indexes"]).tolist(), _column(desc["fields_of"]).tolist()
    gens = _column(desc["gens"]).tolist()
    rows = [[k, i, field_sets[sid], t, g]
            for k, i, sid, t, g in zip(keys, indexes, fields_of, desc["tags"], gens)]
    return rows, [r for r in rows if r[2]]


@gc_paused
def _write_row_index(staging, dump_id: str, pid: str, desc: dict, rows: list) -> dict:
    return fmt.write_row_index(staging, partition_id=pid, dump_id=dump_id,
                               field_schema=desc["field_schema"], rows=rows)


@gc_paused
def _write_indexes(staging, dump_id: str, pid: str, via: str, desc: dict, rows: list,
                   with_data: list, written: dict, row_index: dict | None) -> list[dict]:
    """Write the shard indexes the units did not, the row index unless ``row_index`` (its
    manifest entry) says it is written, and the manifest; returns the shard list."""
    shards, payload = [], 0
    for u, reply in sorted(written.items()):
        index_entry = reply.get("index")  # units write their shard's index
        if index_entry is None:
            index_entry = fmt.write_shard_index(staging, u, reply["entries"])
        shards.append({"unit": u, "file": fmt.shard_file_name(u), "size": reply["bytes"],
                       "records": reply["rows"], "index": index_entry})
        payload += reply["bytes"]
    if row_index is None:
        row_index = _write_row_index(staging, dump_id, pid, desc, rows)
    fmt.write_manifest(staging, dump_id=dump_id, partition_id=pid, keys=len(rows),
                       rows_with_data=len(with_data), bytes=payload, row_index=row_index,
                       shards=shards, writer=via, tqtx_version=__version__)
    return shards


def _cancel_units(client, dump_id: str, per_unit: dict) -> None:
    call_many([(client.unit(u), "DUMP_CANCEL", {"dump_id": dump_id}) for u in per_unit],
              raise_first=False, timeout=30)


def _unit_write(client, handle: DumpHandle, per_unit: dict[int, dict], snapshotted: bool, *,
                while_writing) -> dict:
    """Owner units write their rows in parallel; payload never reaches us.

    Blocking dumps snapshot and write in one round trip (DUMP_ROWS); background dumps
    already hold their snapshots and start writing with DUMP_WAIT. ``while_writing()``
    runs here once the requests are out (not at all without units to write).
    """
    if not per_unit:
        return {}
    if snapshotted:
        result = client.fan_out("DUMP_WAIT", {u: {"dump_id": handle.dump_id, "path": r["path"],
                                                  "index": r["index"]}
                                              for u, r in per_unit.items()},
                                after_send=while_writing)
        if handle._cancel.is_set():
            raise DumpCancelled(f"dump {handle.dump_id} to {handle.dump_dir} was cancelled")
        return result
    return client.fan_out("DUMP_ROWS", per_unit, after_send=while_writing)


def _client_write(client, staging_dir, pid: str, keys: list[str], with_data: list) -> dict:
    """Fallback: read rows through the client and write the same format here (each row
    read at the generation DESCRIBE named: StaleRowsError if one moved since)."""
    if not with_data:
        return {}
    groups: dict[tuple, list] = {}
    for key, idx, fields, tag, gen in with_data:
        groups.setdefault(tuple(fields), []).append((key, idx, gen))
    writer = fmt.ShardWriter(staging_dir / fmt.shard_file_name(0))
    try:
        for fields, members in groups.items():
            for start in range(0, len(members), 1024):
                chunk = members[start:start + 1024]
                meta = {"keys": [k for k, _, _ in chunk], "fields": list(fields),
                        "indexes": [i for _, i, _ in chunk], "gens": [g for _, _, g in chunk],
                        "schemas": {}}
                _, columns, _ = read_rows(client, meta, meta["keys"], False, None)
                writer.write_rows((idx, {f: columns[f][i] for f in fields}, gen, pid, key)
                                  for i, (key, idx, gen) in enumerate(chunk))
        entries = writer.close(fsync=True)
    except BaseException:
        writer.abort()
        raise
    return {0: {"entries": entries, "bytes": writer.bytes_written, "rows": len(entries)}}
