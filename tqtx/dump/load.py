"""Transactional restore by key: validate, reserve, units stage, commit or abandon.

Lifecycle (each step journaled by the controller; the dump journal marks the dump as
being read): BEGIN_RESTORE reserves indexes and records a pending claim per target
unit; each unit claims, reads only its byte ranges, verifies and stages; FINISH_RESTORE
journals the decision, has units apply, then publishes metadata. Any failure before
the decision drops staged rows and releases reservations: nothing becomes visible.
"""
from __future__ import annotations

import logging
import os
import time

from .. import faults, routing
from ..layout import paths
from .. import format as fmt
from .. import states as st
from ..errors import DumpNotFoundError, PeerTimeoutError, RestorePendingError
from ..process.gcpause import gc_paused
from ..journal.dump import DumpJournal
from ..layout.paths import controller_journal_path, controller_running
from ..plan import BeginRow, LoadItem
from ..schema import validate_row
from ..wire.peer import call_many
from ..wire.rpc import new_id
from ..journal.publish import dump_lock, open_recovery_journal, recover_publications

log = logging.getLogger("tqtx.restore")


def _pending(rec: dict, reason: str, what: str = "") -> RestorePendingError:
    units = st.unit_states(rec)
    err = RestorePendingError(restore_id=rec["restore_id"], dump_dir=rec.get("dump_dir"),
                              reason=reason, units=units, partition_id=rec.get("partition_id"))
    if what:
        return RestorePendingError(f"{what} refused: {err}", restore_id=err.restore_id,
                                   dump_dir=err.dump_dir, reason=reason, units=units,
                                   partition_id=err.partition_id)
    return err


def _controller_alive(state_dir: str | None) -> bool | None:
    """Is a controller holding ``state_dir`` (:func:`tqtx.layout.paths.controller_running`)? None
    when that journal does not exist, or its lock cannot be opened: cannot tell."""
    if not state_dir or not controller_journal_path(state_dir).exists():
        return None
    return controller_running(state_dir)


def settle_reader(client, journal: DumpJournal, dump_dir: str, row: dict, *, action: str) -> None:
    """Resolve a dump-journal 'reading' row if its restore ended; else raise RestorePendingError."""
    rid = row["restore_id"]
    ours = os.path.abspath(row.get("controller_state_dir") or "") == os.path.abspath(
        client.topology["state_dir"])
    if ours:
        rec = client.controller.call("GET_RESTORE", {"restore_id": rid})["restore"]
        if rec is None:
            raise _pending({"restore_id": rid, "dump_dir": dump_dir,
                            "partition_id": row.get("partition_id")}, st.UNKNOWN_RESTORE, action)
        if rec["state"] in st.RESTORE_FINAL:
            journal.finish_restore(rid, rec["state"])
            return
        raise _pending(rec, st.pending_reason(u["state"] for u in rec["units"]), action)
    alive = _controller_alive(row.get("controller_state_dir"))
    if alive is False:
        # Its controller is gone, and its metadata with it: that restore can never commit.
        journal.finish_restore(rid, st.ABORTED)
        log.warning("restore %s: reading %s, belonged to a controller that is gone; marked "
                    "aborted", rid, dump_dir)
        return
    reason = st.OTHER_CONTROLLER if alive else st.UNKNOWN_RESTORE
    raise _pending({"restore_id": rid, "dump_dir": dump_dir,
                    "partition_id": row.get("partition_id")}, reason, action)


def _mark_dump_journal(dump_dir: str, rid: str, state: str, state_dir: str | None = None,
                       journal: DumpJournal | None = None) -> None:
    # Without state_dir, a read-only dump's records are where this process put them before
    # (tqtx.layout.paths.records_location remembers it). ``journal``: that dump journal, still
    # open.
    with dump_lock(dump_dir, state_dir=state_dir):
        dj = journal if journal is not None else DumpJournal(dump_dir, state_dir=state_dir)
        try:
            # one transaction: a row that is gone or already ended is left as it is
            dj.finish_restore(rid, state)
        except (KeyError, st.IllegalTransition):
            pass
        finally:
            if journal is None:
                dj.close()


def _finish(client, rid: str, *, commit: bool, cancel: bool = False, reason: str | None = None,
            dump_dir: str = "", attempts: int = 3) -> dict:
    """FINISH_RESTORE, retried after a lost reply (the journal makes it idempotent)."""
    body = {"restore_id": rid, "commit": commit, "cancel": cancel, "reason": reason}
    last = None
    for _ in range(attempts):
        try:
            return client.controller.call("FINISH_RESTORE", body)
        except PeerTimeoutError as exc:
            last = exc
            log.warning("restore %s: FINISH_RESTORE reply lost (%s); retrying", rid, exc)
    raise RestorePendingError(
        f"restore {rid} of {dump_dir!r}: the controller did not answer FINISH_RESTORE "
        f"({last}); its outcome is in the controller journal. Settle it with "
        f"tqtx.recover_data_load({dump_dir!r}).", restore_id=rid, dump_dir=dump_dir,
        reason=st.LOST_REPLY)


@gc_paused  # per-row lists and dicts, no cycles: a full collection here walked torch's
#             objects (≈0.2 s inside a process's first 256 MiB restore; see tqtx.process.gcpause)
def load_data_by_key(client, dump_dir: str, *, partition_id: str | None = None,
                     via: str = "units") -> dict:
    """See :func:`tqtx.load_data_by_key`."""
    if via not in ("units", "client"):
        raise ValueError(f"via must be 'units' or 'client', got {via!r}")
    t0 = time.perf_counter()
    dump_dir = paths.check_path_arg(dump_dir, "dump_dir")
    if not os.path.isdir(dump_dir) and not paths.lock_path(dump_dir).exists():
        raise DumpNotFoundError(f"{dump_dir}: no such dump directory", dump_dir)
    state_dir = client.topology["state_dir"]  # keeps the records of a read-only dump
    if via == "client":
        report = _load_via_client(client, dump_dir, partition_id, t0)
        client.count("restores", report["rows_with_data"], report["bytes"])
        return report
    rid = new_id()
    dj = None  # the dump journal, opened once for the whole restore
    try:
        with dump_lock(dump_dir, state_dir=state_dir):
            dj = open_recovery_journal(dump_dir, state_dir)
            if dj is not None:
                recover_publications(dump_dir, dj)
            # every check that needs no payload, before any write
            index = fmt.read_dump_index(dump_dir)
            pid = partition_id or index.partition_id
            if dj is None:
                dj = DumpJournal(dump_dir, state_dir=state_dir)
            plan = _begin(client, dj, dump_dir, rid, pid, index)
        return _run_restore(client, dump_dir, rid, pid, index, plan, dj, t0)
    finally:
        if dj is not None:
            dj.close()


def _begin(client, dj: DumpJournal, dump_dir: str, rid: str, pid: str, index) -> dict:
    """Settle earlier readers, BEGIN_RESTORE, then the dump journal's reader row."""
    for row in dj.active_restores():
        settle_reader(client, dj, dump_dir, row, action="a second load of this dump")
    # src lets the controller have a unit re-read its rows after the commit decision
    rows = [BeginRow(key, list(fields), tag, src).to_wire()
            for key, src, fields, tag in index.rows]
    nbytes = sum(s["size"] for s in index.shards)
    plan = client.controller.call("BEGIN_RESTORE", {
        "restore_id": rid, "partition_id": pid, "dump_dir": dump_dir,
        "dump_id": index.dump_id, "rows": rows, "field_schema": index.field_schema,
        "bytes": nbytes})
    try:
        dj.begin_restore(restore_id=rid, controller_address=client.address,
                         incarnation_id=plan["incarnation"],
                         controller_state_dir=client.topology["state_dir"],
                         partition_id=pid)
    except BaseException as exc:
        _finish(client, rid, commit=False, reason=f"dump journal: {exc}", dump_dir=dump_dir)
        raise
    return plan


def _run_restore(client, dump_dir, rid, pid, index, plan, dj, t0) -> dict:
    """Units load and stage; FINISH_RESTORE commits (or abandons); the dump journal's row ends."""
    faults.hit("client.restore.after_begin")
    log.info("restore %s: begun from %s into %r (units %s)", rid, dump_dir, pid, plan["units"])

    locations = index.record_locations()
    per_unit: dict[int, dict] = {}
    items_of: dict[int, list] = {}
    num_units = plan["num_units"]
    read_bytes = 0
    src_gens = index.gens
    for (key, src, fields, _tag), dest, gen in zip(index.rows, plan["indexes"], plan["gens"]):
        if not fields:
            continue
        path, offset, length, crc = locations[src]
        u = routing.owner(dest, num_units)
        items = items_of.get(u)
        if items is None:
            items = items_of[u] = []
            per_unit[u] = {"restore_id": rid, "unit_id": u, "field_schema": index.field_schema,
                           "format_version": index.version, "items": items}
        items.append(LoadItem(dest, gen, path, offset, length, crc, src, key,
                              src_gens.get(src)).to_wire())
        read_bytes += length
    uids = sorted(per_unit)
    # Only the controller can conclude this restore: if it dies or restarts while the
    # units load, stop waiting at once (the units' replies would take their report retries)
    watch = client.controller_watch(
        f"unit(s) {uids} were loading restore {rid} of {dump_dir}; nothing of it is visible. "
        f"Restart the controller (or the whole deployment on the same state dir), then run "
        f"tqtx.recover_data_load({dump_dir!r}) to settle the restore")
    results = call_many([(client.unit(u), "LOAD_ROWS", per_unit[u]) for u in uids],
                        raise_first=False, watch=watch)
    errors = [(u, r) for u, r in zip(uids, results) if isinstance(r, BaseException)]
    if errors:
        rec = client.controller.call("GET_RESTORE", {"restore_id": rid})["restore"]
        timed_out = {u for u, e in errors if isinstance(e, PeerTimeoutError)}
        running = [x["unit_id"] for x in rec["units"]
                   if x["state"] == st.CLAIMED and x["unit_id"] in timed_out]
        if running:
            # A unit that claimed permission may still be writing its staging area: the
            # restore stays open until it reports (recover_data_load settles it).
            raise _pending(rec, st.UNIT_RUNNING,
                           f"restore {rid}: unit(s) {running} did not reply in time;")
        first = errors[0][1]
        for u, e in errors:
            log.warning("restore %s: unit %d failed: %s; abandoning", rid, u, e)
        out = _finish(client, rid, commit=False, reason=f"unit {errors[0][0]}: {first}",
                      dump_dir=dump_dir)
        faults.hit("client.restore.after_abort")
        _mark_dump_journal(dump_dir, rid, out["outcome"], journal=dj)
        raise first
    faults.hit("client.restore.before_finish")
    out = _finish(client, rid, commit=True, dump_dir=dump_dir)
    faults.hit("client.restore.after_finish")
    _mark_dump_journal(dump_dir, rid, out["outcome"], journal=dj)
    if out["outcome"] != st.COMMITTED:
        raise RuntimeError(f"restore {rid} of {dump_dir} was {out['outcome']}: {out['reason']}")
    new_keys = sum(1 for n in plan["new"] if n)
    report = {"restore_id": rid, "keys": len(index.rows), "new_keys": new_keys,
              "rows_with_data": sum(len(b["items"]) for b in per_unit.values()),
              "shards": len(index.shards), "bytes": read_bytes, "units": uids,
              "seconds": time.perf_counter() - t0, "partition_id": pid, "dump_dir": dump_dir}
    log.info("restore %s: committed %d keys (%d new) in %.3fs", rid, report["keys"], new_keys,
             report["seconds"])
    client.count("restores", report["rows_with_data"], read_bytes)
    return report


def _load_via_client(client, dump_dir: str, partition_id, t0) -> dict:
    """Fallback when units cannot reach the dump: the client reads and puts (not transactional)."""
    state_dir = client.topology["state_dir"]
    with dump_lock(dump_dir, state_dir=state_dir):
        recover_publications(dump_dir)
        index = fmt.read_dump_index(dump_dir)
        journal = paths.find_dump_journal(dump_dir, state_dir)
        if journal is not None:
            with DumpJournal(dump_dir, path=journal) as dj:
                for row in dj.active_restores():
                    settle_reader(client, dj, dump_dir, row, action="a load of this dump")
    pid = partition_id or index.partition_id
    client.controller.call("VALIDATE_DUMP_SCHEMA", {"partition_id": pid,
                                                    "field_schema": index.field_schema})
    by_src = {src: (key, fields, tag) for key, src, fields, tag in index.rows}
    rows_by_key: dict[str, dict] = {}
    read_bytes = 0
    idents = index.record_idents()
    for shard in index.shards:
        for batch in fmt.read_records(shard["path"], shard["records"], batch=128,
                                      expect=idents):
            for src, row in batch:
                key, fields, _tag = by_src[src]
                validate_row(row, index.field_schema, where=f"{shard['path']} global index {src}")
                rows_by_key[key] = row
        read_bytes += shard["size"]
    groups: dict[tuple, list] = {}
    for key, src, fields, tag in index.rows:
        groups.setdefault(tuple(fields), []).append((key, tag))
    existing = set(client.list_keys(pid).get(pid, {}))
    for fields, members in groups.items():
        for start in range(0, len(members), 1024):
            chunk = members[start:start + 1024]
            keys = [k for k, _ in chunk]
            columns = {f: [rows_by_key[k][f] for k in keys] for f in fields}
            schemas = {f: index.field_schema[f] for f in fields}
            client.put_columns(keys, pid, columns, schemas, [t or {} for _, t in chunk])
    return {"restore_id": None, "keys": len(index.rows),
            "new_keys": sum(1 for key, _src, _fields, _tag in index.rows
                            if key not in existing),
            "rows_with_data": len(rows_by_key), "shards": len(index.shards), "bytes": read_bytes,
            "units": [], "seconds": time.perf_counter() - t0, "partition_id": pid,
            "dump_dir": dump_dir, "via": "client"}


def recover_data_load(client, dump_dir: str, *, cancel: bool = False) -> bool:
    """See :func:`tqtx.recover_data_load`."""
    dump_dir = paths.check_path_arg(dump_dir, "dump_dir")
    state_dir = client.topology["state_dir"]
    paths.records_location(dump_dir, state_dir)  # _settle marks a read-only dump's records there
    rids: dict[str, dict | None] = {}
    for rec in client.controller.call("LIST_RESTORES", {})["restores"]:
        if os.path.abspath(rec["dump_dir"]) == dump_dir:
            rids[rec["restore_id"]] = None
    journal = paths.find_dump_journal(dump_dir, state_dir)
    if journal is not None:
        with dump_lock(dump_dir, state_dir=state_dir):
            recover_publications(dump_dir)
            with DumpJournal(dump_dir, path=journal) as dj:
                for row in dj.active_restores():
                    rids[row["restore_id"]] = row
    ok = True
    for rid, row in rids.items():
        ok = _settle(client, dump_dir, rid, row, cancel) and ok
    return ok


def _settle(client, dump_dir: str, rid: str, row: dict | None, cancel: bool) -> bool:
    rec = client.controller.call("GET_RESTORE", {"restore_id": rid})["restore"]
    if rec is None:
        if row is not None and os.path.abspath(row.get("controller_state_dir") or "") != \
                os.path.abspath(client.topology["state_dir"]):
            if _controller_alive(row.get("controller_state_dir")) is False:
                _mark_dump_journal(dump_dir, rid, st.ABORTED)
                return False
        if cancel:
            _mark_dump_journal(dump_dir, rid, st.CANCELLED)
            log.warning("restore %s: of %s, unknown to the controller; cancelled", rid, dump_dir)
            return False
        raise _pending({"restore_id": rid, "dump_dir": dump_dir,
                        "partition_id": (row or {}).get("partition_id")}, st.UNKNOWN_RESTORE)
    if rec["state"] == st.COMMITTING:
        # decided: roll forward whatever was asked; cancel only ends as failed a restore
        # the dump can no longer roll forward (reason redo_failed)
        out = _finish(client, rid, commit=True, cancel=cancel, dump_dir=dump_dir)
        rec = {**rec, "state": out["outcome"]}
    elif rec["state"] not in st.RESTORE_FINAL:
        decision = st.restore_decision(u["state"] for u in rec["units"])
        if cancel:
            out = _finish(client, rid, commit=False, cancel=True, reason="cancelled by "
                          "recover_data_load", dump_dir=dump_dir)
        elif decision == st.WAIT:
            raise _pending(rec, st.UNIT_RUNNING)
        elif decision == st.COMMIT:
            out = _finish(client, rid, commit=True, dump_dir=dump_dir)
        else:
            out = _finish(client, rid, commit=False, reason="recovered: not every unit staged",
                          dump_dir=dump_dir)
        rec = {**rec, "state": out["outcome"]}
    _mark_dump_journal(dump_dir, rid, rec["state"])
    return rec["state"] == st.COMMITTED
