"""Whole-system checkpoint: every unit writes its own file, the controller its metadata.

Layout of ``<dir>``: ``checkpoint_info.json`` (manifest, written last), ``controller.msgpack``
(metadata), ``metadata.json`` (the user's), ``units/unit-<k>.bin`` + ``.index`` (records in
the dump format). Published like a dump: staged in a sibling, swapped via ``<dir>.old``.
"""
from __future__ import annotations

import json
import logging
import os
import time

from . import paths
from . import format as fmt
from .publish import Publication, dump_lock, recover_publications
from .errors import DumpFormatError, DumpNotFoundError
from .journal.store import DumpJournal
from .version import __version__
from .wire.codec import packb, unpackb
from .wire.peer import call_many
from .wire.rpc import new_id

FORMAT_VERSION = 1
MANIFEST = "checkpoint_info.json"
METADATA = "metadata.json"  # TransferQueue's layout: {"storage_saved", "user_metadata"}

log = logging.getLogger("tqtx.checkpoint")


def _write(path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "crc32": fmt.checksum(data)}


def save(client, ckpt_dir: str, *, metadata: dict | None = None,
         include_storage: bool = True) -> dict:
    """See :func:`tqtx.save_checkpoint`."""
    t0 = time.perf_counter()
    ckpt_dir = paths.check_path_arg(ckpt_dir, "checkpoint_dir")
    paths.check_publish_target(ckpt_dir, "checkpoint")  # refuses before anything is touched
    from .placement.probe import check_units_reach
    check_units_reach(client, ckpt_dir, "checkpoint")  # no-op when all units are local
    if not include_storage:
        # As TransferQueue does for its in-memory SimpleStorage: a checkpoint without the
        # units' rows would lose every row on restart.
        log.warning("save_checkpoint(include_storage=False) has no effect: tqtx units hold "
                    "their rows in memory, so the checkpoint always includes them")
    # fails early on non-JSON metadata
    user_meta = json.dumps({"storage_saved": True, "user_metadata": metadata or {}}, indent=2)
    snap = client.controller.call("CHECKPOINT_SNAPSHOT", {})
    with dump_lock(ckpt_dir):
        recover_publications(ckpt_dir)
        paths.check_publish_target(ckpt_dir, "checkpoint")  # again, now under the lock
        with DumpJournal(ckpt_dir) as journal:
            pub = Publication(ckpt_dir, kind="checkpoint", dump_id=None, journal=journal)
            try:
                units_dir = pub.staging_dir / "units"
                units_dir.mkdir()
                replies = client.fan_out("SAVE_CHECKPOINT", {
                    u: {"path": str(units_dir / f"unit-{u}.bin")} for u in range(client.num_units)})
                units = []
                for u, r in sorted(replies.items()):
                    idx = _write(units_dir / f"unit-{u}.index", packb(r["entries"]))
                    units.append({"unit": u, "file": f"units/unit-{u}.bin", "size": r["bytes"],
                                  "rows": r["rows"], "index": {"file": f"units/unit-{u}.index",
                                                               **idx}})
                ctl = _write(pub.staging_dir / "controller.msgpack", packb(snap["metadata"]))
                _write(pub.staging_dir / METADATA, user_meta.encode())
                manifest = {"format_version": FORMAT_VERSION, "kind": "tqtx-checkpoint",
                            "num_units": client.num_units, "tqtx_version": __version__,
                            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "controller": {"file": "controller.msgpack", **ctl}, "units": units}
                _write(pub.staging_dir / MANIFEST, json.dumps(manifest, indent=2).encode())
                pub.mark_written()
                total = pub.commit()
            except BaseException as exc:
                pub.abort(f"{type(exc).__name__}: {exc}")
                raise
    return {"dir": ckpt_dir, "bytes": total, "num_units": client.num_units,
            "keys": sum(len(p["rows"]) for p in snap["metadata"]["partitions"].values()),
            "seconds": time.perf_counter() - t0}


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


def _verify_records(path: str, entries) -> None:
    """Check every record's checksum before any unit replaces its rows (a unit finding a
    corrupt record mid-load would leave the other units already loaded)."""
    try:
        with open(path, "rb") as f:
            for gidx, offset, length, crc in entries:
                f.seek(offset)
                data = f.read(length)
                if len(data) != length or fmt.checksum(data) != crc:
                    raise DumpFormatError(f"{path}: record of global index {gidx} is truncated "
                                          f"or its checksum does not match")
    except FileNotFoundError:
        raise DumpNotFoundError(f"{path}: missing", path) from None
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read: {exc}") from None


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
        if manifest.get("format_version") != FORMAT_VERSION:
            version = manifest.get("format_version")
            raise DumpFormatError(f"{mpath}: format_version {version} is not supported (this "
                                  f"tqtx reads {FORMAT_VERSION}; Unsupported checkpoint format "
                                  f"version {version})")
        if manifest["num_units"] != client.num_units:
            raise ValueError(f"unit count mismatch: checkpoint {ckpt_dir} was saved with "
                             f"{manifest['num_units']} units, this deployment has "
                             f"{client.num_units}")
        meta = unpackb(_read_checked(os.path.join(ckpt_dir, "controller.msgpack"),
                                     manifest["controller"]))
        per_unit = {}
        for entry in manifest["units"]:
            rel = entry["file"]
            if os.path.isabs(rel) or ".." in rel.split("/"):
                raise DumpFormatError(f"{mpath}: unit file {rel!r} escapes the checkpoint")
            entries = unpackb(_read_checked(os.path.join(ckpt_dir, entry["index"]["file"]),
                                            entry["index"]))
            path = os.path.join(ckpt_dir, rel)
            if not os.path.isfile(path):
                raise DumpNotFoundError(f"{path}: unit file missing", path)
            if os.path.getsize(path) != entry["size"]:
                raise DumpFormatError(f"{path}: size {os.path.getsize(path)} does not match "
                                      f"{MANIFEST} ({entry['size']})")
            _verify_records(path, entries)
            per_unit[entry["unit"]] = {"path": path, "entries": entries}
        # The controller refuses while a restore is unresolved, before any unit is touched.
        client.controller.call("CHECKPOINT_SNAPSHOT", {})
        load_id = new_id()
        for body in per_unit.values():
            body["load_id"] = load_id
        try:
            client.fan_out("LOAD_CHECKPOINT", per_unit)  # every unit reads and stages
        except BaseException:
            call_many([(client.unit(u), "DROP_CHECKPOINT", {"load_id": load_id})
                       for u in per_unit], raise_first=False, timeout=30)
            raise
        # The controller journals the checkpoint's metadata (the decision), then switches
        # every unit to its staged rows: a crash in between is rolled forward at restart.
        client.controller.call("CHECKPOINT_REPLACE", {"metadata": meta, "load_id": load_id})
    return {"dir": ckpt_dir, "metadata": saved["user_metadata"],
            "storage_saved": saved["storage_saved"], "seconds": time.perf_counter() - t0,
            "keys": sum(len(p["rows"]) for p in meta["partitions"].values())}


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
