"""Whole-system checkpoint: every unit writes its own file, the controller its metadata.

Layout of ``<dir>``: ``checkpoint_info.json`` (manifest, written last), ``controller.msgpack``
(metadata), ``metadata.json`` (the user's), ``units/unit-<k>.bin`` + ``.index`` (records in
the dump format). Published like a dump: staged in a sibling, swapped via ``<dir>.old``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time

from .. import faults, routing
from ..layout import fsutil, paths
from .. import format as fmt
from ..journal.publish import Publication, check_publish_target, dump_lock, recover_publications
from ..errors import (CheckpointBusyError, ControllerRecoveringError, DumpFormatError,
                      DumpNotFoundError, RestorePendingError, TqtxError)
from ..client.fence import FENCE_ATTEMPTS, fence_pause
from ..process.gcpause import gc_paused
from ..journal.dump import DumpJournal
from ..arguments.table import check_snapshot_names
from ..plan import checkpoint_save_requests
from ..version import __version__
from ..wire.codec import packb, unpackb
from ..wire.peer import call_many
from ..wire.rpc import new_id

# Version 2: unit files hold version 2 records (naming partition, key and generation) and
# controller.msgpack rows carry the generation; version 1 checkpoints are still loaded.
# Version 3: units with a row log (durability buffer, sync) saved their log's files
# (``units/unit-<k>/``) instead of a unit file; written only then.
FORMAT_VERSION = 2
LOG_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = paths.CHECKPOINT_MANIFEST
METADATA = paths.CHECKPOINT_USER_METADATA  # TransferQueue's: {"storage_saved", "user_metadata"}
CONTROLLER = paths.CHECKPOINT_METADATA

log = logging.getLogger("tqtx.checkpoint")


def _write(path, data: bytes) -> dict:
    """Write and fsync one checkpoint file; its manifest entry."""
    fsutil.write_file_synced(path, data)
    return {"size": len(data), "crc32": fmt.checksum(data)}


@gc_paused  # per-row objects, no cycles (see tqtx.process.gcpause)
def save(client, ckpt_dir: str, *, metadata: dict | None = None,
         include_storage: bool = True) -> dict:
    """See :func:`tqtx.save_checkpoint`."""
    t0 = time.perf_counter()
    ckpt_dir = paths.check_path_arg(ckpt_dir, "checkpoint_dir")
    check_publish_target(ckpt_dir, "checkpoint")  # refuses before anything is touched
    from ..placement.probe import check_units_reach
    check_units_reach(client, ckpt_dir, "checkpoint")  # no-op when all units are local
    if not include_storage:
        # As TransferQueue does for its in-memory SimpleStorage: a checkpoint without the
        # units' rows would lose every row on restart.
        log.warning("save_checkpoint(include_storage=False) has no effect: tqtx units hold "
                    "their rows in memory, so the checkpoint always includes them")
    # fails early on non-JSON metadata
    user_meta = json.dumps({"storage_saved": True, "user_metadata": metadata or {}}, indent=2)
    with dump_lock(ckpt_dir):
        recover_publications(ckpt_dir)
        check_publish_target(ckpt_dir, "checkpoint")  # again, now under the lock
        with DumpJournal(ckpt_dir) as journal:
            pub = Publication(ckpt_dir, kind="checkpoint", dump_id=None, journal=journal)
            try:
                units_dir = pub.staging_dir / paths.CHECKPOINT_UNITS_DIR
                snap, replies = _save_units(client, units_dir)
                units = []
                for u, r in sorted(replies.items()):
                    if "log" in r:  # the unit linked its row log's files
                        units.append({"unit": u, "size": r["bytes"], "rows": r["rows"],
                                      "log": {"dir": paths.checkpoint_unit_log_dir(u),
                                              "files": r["log"]}})
                        continue
                    index = paths.checkpoint_unit_index(u)
                    idx = r["index"]  # the unit wrote and fsynced it beside its rows
                    units.append({"unit": u, "file": paths.checkpoint_unit_file(u),
                                  "size": r["bytes"], "rows": r["rows"],
                                  "index": {"file": index, **idx}})
                ctl = _write(pub.staging_dir / CONTROLLER, snap["metadata_packed"])
                _write(pub.staging_dir / METADATA, user_meta.encode())
                version = LOG_FORMAT_VERSION if any("log" in u for u in units) \
                    else FORMAT_VERSION
                manifest = {"format_version": version, "kind": "tqtx-checkpoint",
                            "num_units": client.num_units, "tqtx_version": __version__,
                            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "controller": {"file": CONTROLLER, **ctl}, "units": units}
                _write(pub.staging_dir / MANIFEST, json.dumps(manifest, indent=2).encode())
                pub.mark_written()
                total = pub.commit()
            except BaseException as exc:
                pub.abort(f"{type(exc).__name__}: {exc}")
                raise
    return {"dir": ckpt_dir, "bytes": total, "num_units": client.num_units,
            "keys": snap["keys"],
            "seconds": time.perf_counter() - t0}


def _save_units(client, units_dir) -> tuple[dict, dict]:
    """The controller's metadata snapshot (packed as the checkpoint's controller file) and
    every unit's file of the rows it names, in ``units_dir``: ``(snapshot, SAVE_CHECKPOINT
    replies)``.

    Each row is saved at the generation the snapshot names; a row that moved since is
    settled with the controller (CHECKPOINT_CHECK): its key was cleared (absent from the
    checkpoint, as if it had been taken after the clear) or its row lost (named lost in
    the checkpoint, as a RowsLostError on read). A checkpoint loaded while this one was
    being written replaced every row: the snapshot is taken again (at most
    FENCE_ATTEMPTS times)."""
    for attempt in range(FENCE_ATTEMPTS):
        snap = client.controller.call("CHECKPOINT_SNAPSHOT", {})
        faults.hit("client.checkpoint.after_snapshot")
        per_unit = {u: body for u, body in snap["units"]}
        units_dir.mkdir()
        for u, body in per_unit.items():
            body["path"] = str(units_dir.parent / paths.checkpoint_unit_file(u))
            body["log_dir"] = str(units_dir.parent / paths.checkpoint_unit_log_dir(u))
            body["index_path"] = str(units_dir.parent / paths.checkpoint_unit_index(u))
        replies = client.fan_out("SAVE_CHECKPOINT", per_unit)
        if _settle_missing(client, snap, replies):
            return snap, replies
        shutil.rmtree(units_dir)  # this attempt's files, in the checkpoint's staging dir
        if attempt + 1 < FENCE_ATTEMPTS:
            fence_pause(attempt + 1)
    raise TqtxError(f"save_checkpoint: the buffer was replaced by load_checkpoint during each "
                    f"of {FENCE_ATTEMPTS} tries to save it; try again")


def _settle_missing(client, snap: dict, replies: dict) -> bool:
    """Settle the rows the units no longer held at the snapshot's generation (see
    :func:`_save_units`) in ``snap``'s packed metadata and key count; False if a checkpoint
    load replaced the buffer since the snapshot."""
    missing = {i for r in replies.values() for i in r.get("missing", ())}
    if not missing:
        return True
    meta = unpackb(snap["metadata_packed"])
    moved = [[pid, r[0], r[5]] for pid, data in meta["partitions"].items()
             for r in data["rows"] if r[1] in missing]
    check = client.controller.call("CHECKPOINT_CHECK", {"epoch": snap["epoch"],
                                                        "rows": moved})
    if check["replaced"]:
        return False
    lost = {(pid, key) for pid, key in check["lost"]}
    cleared = 0
    for pid, data in list(meta["partitions"].items()):
        kept = []
        for r in data["rows"]:
            if r[1] not in missing:
                kept.append(r)
            elif (pid, r[0]) in lost:
                kept.append([*r[:4], routing.owner(r[1], client.num_units), r[5]])
            else:
                cleared += 1
        data["rows"] = kept
        if not kept:
            del meta["partitions"][pid]
    snap["metadata_packed"] = packb(meta)
    snap["keys"] = sum(len(p["rows"]) for p in meta["partitions"].values())
    log.info("save_checkpoint: %d keys cleared while it ran are left out, %d rows lost "
             "meanwhile are named lost", cleared, len(lost))
    return True


def _read_checked(path, entry: dict) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DumpNotFoundError(f"{path}: missing", path) from None
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read: {exc}") from None
    if len(data) != entry["size"] or fmt.checksum(data) != entry["crc32"]:
        raise DumpFormatError(f"{path}: size or checksum does not match {MANIFEST}")
    return data


def _expected_rows(path: str, entries, idents: dict | None) -> list | None:
    """Per record of ``entries``, the ``[partition_id, key, generation]`` it must name
    (version 2 checkpoints on: ``idents`` ``{global_index: (partition_id, key,
    generation)}``), checked by the unit as it reads the record; a record no key of the
    metadata has is refused here, before any unit is asked to read."""
    if idents is None:
        return None
    out = []
    for gidx, _offset, _length, _crc in entries:
        ident = idents.get(gidx)
        if ident is None:
            raise DumpFormatError(f"{path}: record of global index {gidx}: no key of "
                                  f"controller.msgpack has that index")
        out.append(list(ident))
    return out


@gc_paused  # the metadata of every key, decoded: no cycles (see tqtx.process.gcpause)
def load(client, ckpt_dir: str) -> dict:
    """See :func:`tqtx.load_checkpoint`."""
    t0 = time.perf_counter()
    ckpt_dir = paths.check_path_arg(ckpt_dir, "checkpoint_dir")
    with dump_lock(ckpt_dir, state_dir=client.topology["state_dir"]):
        recover_publications(ckpt_dir)
        if not os.path.isdir(ckpt_dir):
            raise DumpNotFoundError(f"checkpoint directory not found: {ckpt_dir}", ckpt_dir)
        saved = _read_metadata(ckpt_dir)  # first, as TransferQueue: a dir without it is named so
        mpath = os.path.join(ckpt_dir, MANIFEST)
        manifest = _read_json(mpath, "missing (not a tqtx checkpoint)")
        version = manifest.get("format_version")
        if version not in READABLE_VERSIONS:
            raise DumpFormatError(f"{mpath}: format_version {version} is not supported (this "
                                  f"tqtx reads {', '.join(map(str, READABLE_VERSIONS))}; "
                                  f"Unsupported checkpoint format version {version})")
        if manifest["num_units"] != client.num_units:
            raise ValueError(f"unit count mismatch: checkpoint {ckpt_dir} was saved with "
                             f"{manifest['num_units']} units, this deployment has "
                             f"{client.num_units}")
        meta_packed = _read_checked(os.path.join(ckpt_dir, CONTROLLER), manifest["controller"])
        meta = unpackb(meta_packed)
        check_snapshot_names(meta, os.path.join(ckpt_dir, CONTROLLER))
        idents = None
        if version >= 2:
            idents = {r[1]: (pid, r[0], r[5]) for pid, data in meta["partitions"].items()
                      for r in data["rows"]}
        per_unit = {}
        keep = checkpoint_save_requests(meta, client.num_units) if version >= 3 else {}
        for entry in manifest["units"]:
            if "log" in entry:
                per_unit[entry["unit"]] = _log_load(ckpt_dir, mpath, entry,
                                                    keep[entry["unit"]])
                continue
            path = _unit_member(ckpt_dir, mpath, entry["file"], entry["size"], "unit file")
            entries = unpackb(_read_checked(os.path.join(ckpt_dir, entry["index"]["file"]),
                                            entry["index"]))
            # each unit checks its records' checksums and keys as it stages them, in
            # parallel; a bad one fails the staging everywhere before any unit switches
            per_unit[entry["unit"]] = {"path": path, "entries": entries,
                                       "expect": _expected_rows(path, entries, idents)}
        # The controller refuses while a restore is unresolved, before any unit is touched.
        client.controller.call("CHECKPOINT_SNAPSHOT", {"check_only": True})
        load_id = _stage_everywhere(client, per_unit)
        # The controller journals the checkpoint's metadata and the units' read plan (the
        # decision), then switches every unit to its staged rows: a crash in between is
        # rolled forward at restart, a unit that restarted meanwhile reading its rows again.
        try:
            # the controller gets both as packed here: it journals the read plan as is
            client.controller.call("CHECKPOINT_REPLACE", {
                "metadata_packed": meta_packed, "load_id": load_id,
                "unit_loads_packed": packb([[u, body] for u, body in per_unit.items()])})
        except (RestorePendingError, ControllerRecoveringError):
            # refused before any decision: the staged rows go now, rather than hold the
            # units' staging slots (CheckpointBusyError for other loads) until they are stale
            _drop_staged(client, per_unit, load_id)
            raise
    return {"dir": ckpt_dir, "metadata": saved["user_metadata"],
            "storage_saved": saved["storage_saved"], "seconds": time.perf_counter() - t0,
            "keys": sum(len(p["rows"]) for p in meta["partitions"].values())}


def _stage_everywhere(client, per_unit: dict) -> str:
    """LOAD_CHECKPOINT on every unit (each reads and stages its rows, invisible); the load
    ID. A unit busy with the staged loads of other load_checkpoint calls refuses
    (CheckpointBusyError): what was staged is dropped and the load tried again, at most
    FENCE_ATTEMPTS times. Any other failure drops what was staged and is raised."""
    attempt = 0
    while True:
        load_id = new_id()
        for body in per_unit.values():
            body["load_id"] = load_id
        try:
            client.fan_out("LOAD_CHECKPOINT", per_unit)
            return load_id
        except BaseException as exc:
            _drop_staged(client, per_unit, load_id)
            attempt += 1
            if not isinstance(exc, CheckpointBusyError) or attempt == FENCE_ATTEMPTS:
                raise
        fence_pause(attempt)


def _drop_staged(client, per_unit: dict, load_id: str) -> None:
    """DROP_CHECKPOINT of ``load_id`` on every unit of ``per_unit`` (failures ignored: a
    unit that missed it drops the load once it is stale)."""
    call_many([(client.unit(u), "DROP_CHECKPOINT", {"load_id": load_id}) for u in per_unit],
              raise_first=False, timeout=30)


def _log_load(ckpt_dir: str, mpath: str, entry: dict, keep: dict) -> dict:
    """The LOAD_CHECKPOINT body of a unit that saved its row log's files: the files (each
    of the size the manifest names: saved files are never appended to) and the rows to
    keep, every row of the metadata that unit holds (the unit checks each entry's CRC and
    each kept row's generation as it replays)."""
    log_dir = entry["log"]["dir"]
    files = [_unit_member(ckpt_dir, mpath, f"{log_dir}/{f['file']}", f["size"],
                          "unit row log file") for f in entry["log"]["files"]]
    return {"log_files": files, "keep_indexes": keep["indexes"], "keep_gens": keep["gens"]}


def _unit_member(ckpt_dir: str, mpath: str, rel: str, size: int, what: str) -> str:
    """The path of a unit's file ``rel`` in the checkpoint: inside it, present, of the
    ``size`` the manifest names (DumpFormatError / DumpNotFoundError naming it)."""
    if os.path.isabs(rel) or ".." in rel.split("/"):
        raise DumpFormatError(f"{mpath}: unit file {rel!r} escapes the checkpoint")
    path = os.path.join(ckpt_dir, rel)
    if not os.path.isfile(path):
        raise DumpNotFoundError(f"{path}: {what} missing", path)
    if os.path.getsize(path) != size:
        raise DumpFormatError(f"{path}: size {os.path.getsize(path)} does not match "
                              f"{MANIFEST} ({size})")
    return path


def _read_metadata(ckpt_dir: str) -> dict:
    """``metadata.json`` as ``{"storage_saved", "user_metadata"}``, read before anything is
    replaced. (Checkpoints of earlier tqtx hold only the user's dict there.)"""
    path = os.path.join(ckpt_dir, METADATA)
    saved = _read_json(path, f"{METADATA} not found in {ckpt_dir}")
    if isinstance(saved, dict) and set(saved) == {"storage_saved", "user_metadata"}:
        return saved
    return {"storage_saved": True, "user_metadata": saved}


def _read_json(path: str, missing: str):
    """A checkpoint's JSON file; DumpNotFoundError (``missing`` says why) or DumpFormatError."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DumpNotFoundError(f"{path}: {missing}", path) from None
    except ValueError as exc:
        raise DumpFormatError(f"{path}: not valid JSON: {exc}") from None
