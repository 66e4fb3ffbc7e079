"""Dump indexes: the row index, the shard indexes and the manifest; writing them and
reading them back with every cross-check that needs no shard payload."""
from __future__ import annotations

import gc
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tqtx.layout import fsutil
from tqtx.layout.paths import DUMP_MANIFEST, ROW_INDEX
from tqtx.schema import field_schema_problem
from tqtx.wire import codec

from .records import PREFIX_SIZE, checksum, file_error, is_int
from .shard import SHARDS_DIR, by_offset, shard_file_name, shard_index_name

# Version 2: records and row index rows name their key's generation (records also their
# partition and key: the row fence). Version 1 dumps are still read.
FORMAT_VERSION = 2
MANIFEST = DUMP_MANIFEST

__all__ = ["FORMAT_VERSION", "MANIFEST", "ROW_INDEX", "SHARDS_DIR", "DumpIndex",
           "read_dump_index", "read_row_index", "write_manifest", "write_row_index",
           "write_shard_index"]


# --------------------------------------------------------------------------- writing

def _arrays(items) -> list:
    """``items`` as a list of msgpack arrays: as given when each is a list or tuple
    (msgpack packs both as the same array; one C-level type scan), else copied."""
    if type(items) is list and set(map(type, items)) <= {list, tuple}:
        return items
    return [list(r) for r in items]


def write_row_index(staging_dir, *, partition_id: str, dump_id: str, field_schema: dict,
                    rows) -> dict:
    """Write ``rows.msgpack`` ([key, gidx, fields, tag, generation] per row) and fsync it.

    Returns the manifest entry ``{"file", "size", "crc32"}``.
    """
    data = codec.packb({"format_version": FORMAT_VERSION, "partition_id": partition_id,
                        "dump_id": dump_id, "field_schema": field_schema,
                        "rows": _arrays(rows)})
    fsutil.write_file_synced(Path(staging_dir) / ROW_INDEX, data)
    return {"file": ROW_INDEX, "size": len(data), "crc32": checksum(data)}


def write_shard_index(staging_dir, unit, entries) -> dict:
    """Write ``shards/unit-<unit>.index`` (a new file, as its shard is) and fsync it;
    returns ``{"file", "size", "crc32"}``."""
    rel = shard_index_name(unit)
    data = codec.packb({"format_version": FORMAT_VERSION, "unit": unit,
                        "shard": shard_file_name(unit), "records": _arrays(entries)})
    path = Path(staging_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_file_synced(path, data, exclusive=True)
    return {"file": rel, "size": len(data), "crc32": checksum(data)}


def write_manifest(staging_dir, *, dump_id: str, partition_id: str, keys: int,
                   rows_with_data: int, bytes: int, row_index: dict, shards: list,
                   writer: str, tqtx_version: str) -> dict:
    """Write ``dump_info.json`` atomically (temp file, fsync, rename); returns the manifest.

    Directory entries of everything written before are made durable first, so a visible
    manifest implies a complete dump.
    """
    staging = Path(staging_dir)
    manifest = {
        "format_version": FORMAT_VERSION,
        "dump_id": dump_id,
        "partition_id": partition_id,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "tqtx_version": tqtx_version,
        "keys": keys,
        "rows_with_data": rows_with_data,
        "bytes": bytes,
        "row_index": dict(row_index),
        "shards": [dict(s) for s in shards],
        "writer": writer,
    }
    if (staging / SHARDS_DIR).is_dir():
        fsutil.fsync_dir(staging / SHARDS_DIR)
    fsutil.fsync_dir(staging)
    fsutil.replace_file_synced(staging / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode(),
                               tmp=staging / (MANIFEST + ".tmp"))
    fsutil.fsync_dir(staging)
    return manifest


# --------------------------------------------------------------------------- reading

@dataclass
class DumpIndex:
    """Everything known about a dump without reading shard payloads."""

    dump_dir: Path
    manifest: dict
    partition_id: str
    dump_id: str
    field_schema: dict
    rows: list = field(default_factory=list)    # (key, gidx, fields, tag)
    shards: list = field(default_factory=list)  # {"unit", "file", "path", "size", "records"}
    gens: dict = field(default_factory=dict)    # gidx -> generation (format version 2)

    @property
    def version(self) -> int:
        return self.manifest["format_version"]

    def record_idents(self) -> dict | None:
        """``{global_index: (partition_id, key, generation)}`` every record must name
        (:func:`tqtx.format.records.decode_record`'s ``expect``); None for a version 1 dump,
        whose records name no row."""
        if self.version < 2:
            return None
        pid, gens = self.partition_id, self.gens
        return {gidx: (pid, key, gens[gidx]) for key, gidx, fields, _ in self.rows if fields}

    def record_locations(self) -> dict:
        """``{global_index: (shard path as a str, offset, length, crc32)}`` for every
        record (one str per shard: a request names the shard of each record)."""
        out = {}
        for shard in self.shards:
            path = str(shard["path"])
            for gidx, offset, length, crc in shard["records"]:
                out[gidx] = (path, offset, length, crc)
        return out


@dataclass
class _Rows:
    """The row index's rows and what the shard checks need to know about them."""

    path: Path
    field_schema: dict
    rows: list                  # (key, gidx, fields, tag)
    gidx_key: dict              # gidx -> key, every row
    with_data: dict             # gidx -> key, rows with fields
    gens: dict                  # gidx -> generation (version 2 row indexes)


@contextmanager
def _gc_paused():
    # Unpacking a big row index creates millions of containers; the cyclic GC would
    # rescan them repeatedly (3x slower), and none of them can form cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_dump_index(dump_dir, *, check_files: bool = True) -> DumpIndex:
    """Read and cross-check manifest, row index and shard indexes (no shard payload read).

    With ``check_files`` also checks that each shard exists with the manifest's size.
    Raises DumpFormatError naming the offending file (and key / global index).
    """
    with _gc_paused():
        dump_dir = Path(os.path.abspath(dump_dir))
        mpath = dump_dir / MANIFEST
        manifest = _read_manifest(dump_dir, mpath)
        real_dir = os.path.realpath(dump_dir)
        rows = _read_rows(dump_dir, real_dir, mpath, manifest)
        shards = _read_shards(dump_dir, real_dir, mpath, manifest, rows, check_files)
        return DumpIndex(dump_dir=dump_dir, manifest=manifest,
                         partition_id=manifest["partition_id"], dump_id=manifest["dump_id"],
                         field_schema=rows.field_schema, rows=rows.rows, shards=shards,
                         gens=rows.gens)


def read_row_index(dump_dir) -> dict:
    """Public view of a dump's rows: ``{"format_version", "partition_id", "dump_id",
    "rows": {key: {"global_index", "fields", "tag"}}, "field_schema"}``.

    Shard files are not opened; tags keep their RawTensors.
    """
    idx = read_dump_index(dump_dir, check_files=False)
    with _gc_paused():
        rows = {key: {"global_index": gidx, "fields": list(fields), "tag": tag}
                for key, gidx, fields, tag in idx.rows}
    return {"format_version": idx.manifest["format_version"], "partition_id": idx.partition_id,
            "dump_id": idx.dump_id,
            "rows": rows,
            "field_schema": idx.field_schema}


# ------------------------------------------------------------------ read_dump_index's steps

def _read_manifest(dump_dir: Path, mpath: Path) -> dict:
    """Parse ``dump_info.json`` and check its version and top-level entries' types."""
    try:
        raw = mpath.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        if not dump_dir.is_dir():
            raise file_error(dump_dir, "dump directory not found", missing=True) from None
        raise file_error(mpath, f"no {MANIFEST} in the directory "
                                f"(not a tqtx dump or an unfinished one)", missing=True) from None
    except OSError as exc:
        raise file_error(mpath, f"cannot read: {exc}") from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise file_error(mpath, f"invalid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise file_error(mpath, "manifest is not a JSON object")
    version = manifest.get("format_version")
    if not is_int(version) or version < 1:
        raise file_error(mpath, f"invalid format_version {version!r} "
                                f"(Unsupported dump format version {version!r})")
    if version > FORMAT_VERSION:
        raise file_error(mpath, f"format_version {version} is newer than this tqtx supports "
                                f"(format_version {FORMAT_VERSION}). Unsupported dump format "
                                f"version {version}: upgrade tqtx to read it")
    for name, typ in (("dump_id", str), ("partition_id", str), ("keys", int),
                      ("rows_with_data", int), ("bytes", int), ("row_index", dict),
                      ("shards", list)):
        value = manifest.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise file_error(mpath, f"missing or invalid {name!r}")
    return manifest


def _check_rel_path(dump_dir: Path, real_dir: str, rel, manifest_path: Path, what: str) -> Path:
    """The file a manifest entry names, refused unless it is a normalized relative path
    resolving inside the dump directory."""
    if not isinstance(rel, str) or not rel:
        raise file_error(manifest_path,
                         f"{what}: file path must be a non-empty string, got {rel!r}")
    if rel.startswith("/") or os.path.isabs(rel) or "\\" in rel or "\x00" in rel:
        raise file_error(manifest_path, f"{what}: file path {rel!r} must be relative to the dump")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise file_error(manifest_path, f"{what}: file path {rel!r} is not normalized or "
                                        f"escapes the dump directory")
    path = dump_dir / rel
    if not os.path.realpath(path).startswith(real_dir + os.sep):
        raise file_error(manifest_path,
                         f"{what}: file path {rel!r} resolves outside the dump directory")
    return path


def _check_file_entry(entry, manifest_path: Path, what: str) -> None:
    if (not isinstance(entry, dict) or not is_int(entry.get("size")) or entry["size"] < 0
            or not is_int(entry.get("crc32"))):
        raise file_error(manifest_path, f"{what}: entry must have a file, a size and a crc32")


def _read_checked(path: Path, entry: dict):
    """Read an index file, check size and crc32 against the manifest, and unpack it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise file_error(path, "file is missing", missing=True) from None
    except OSError as exc:
        raise file_error(path, f"cannot read: {exc}") from None
    if len(data) != entry["size"]:
        raise file_error(path, f"size is {len(data)} bytes, {MANIFEST} says {entry['size']}")
    crc = checksum(data)
    if crc != entry["crc32"]:
        raise file_error(path, f"checksum (CRC-32C) mismatch ({crc:#010x}, {MANIFEST} says "
                               f"{entry['crc32']:#010x})")
    try:
        return codec.unpack_stored(data)
    except codec.CodecError as exc:
        raise file_error(path, f"malformed msgpack: {exc}") from None


def _read_rows(dump_dir: Path, real_dir: str, mpath: Path, manifest: dict) -> _Rows:
    """Read ``rows.msgpack``, check its header and field schema against the manifest."""
    ri = manifest["row_index"]
    _check_file_entry(ri, mpath, "row_index")
    rpath = _check_rel_path(dump_dir, real_dir, ri.get("file"), mpath, "row_index")
    index = _read_checked(rpath, ri)
    if not isinstance(index, dict) or not isinstance(index.get("rows"), list):
        raise file_error(rpath, "malformed row index (expected a map with 'rows')")
    for name in ("format_version", "partition_id", "dump_id"):
        if index.get(name) != manifest[name]:
            raise file_error(rpath, f"{name} {index.get(name)!r} differs from {MANIFEST} "
                                    f"({manifest[name]!r})")
    field_schema = index.get("field_schema")
    problem = field_schema_problem(field_schema)
    if problem is not None:
        raise file_error(rpath, problem)
    rows = _check_rows(index["rows"], field_schema, rpath, manifest["format_version"])
    if manifest["keys"] != len(rows.rows):
        raise file_error(mpath, f"keys is {manifest['keys']} but {ROW_INDEX} has "
                                f"{len(rows.rows)} rows")
    if manifest["rows_with_data"] != len(rows.with_data):
        raise file_error(mpath, f"rows_with_data is {manifest['rows_with_data']} but "
                                f"{ROW_INDEX} has {len(rows.with_data)} rows with fields")
    return rows


def _check_rows(entries: list, field_schema: dict, rpath: Path, version: int) -> _Rows:
    """Check every ``[key, gidx, fields, tag]`` entry (version 2: ``[..., generation]``):
    types, unique keys and global indexes, fields listed once and present in the field
    schema."""
    rows = []
    keys_seen = set()
    gidx_key: dict[int, str] = {}
    with_data: dict[int, str] = {}
    gens: dict[int, int] = {}
    width = 4 if version < 2 else 5
    valid_fields: set[tuple] = set()  # field lists already checked (rows share a few)
    for r in entries:
        if type(r) is not list or len(r) != width:
            raise file_error(rpath, f"malformed row entry {r!r}")
        key, gidx, fields, tag = r[:4]
        if type(key) is not str or type(gidx) is not int or type(fields) is not list \
                or not (tag is None or type(tag) is dict):
            raise file_error(rpath, f"malformed row entry for key {key!r}", key=key)
        if width == 5:
            if type(r[4]) is not int:
                raise file_error(rpath, f"malformed generation {r[4]!r} for key {key!r}",
                                 key=key, global_index=gidx)
            gens[gidx] = r[4]
        if key in keys_seen:
            raise file_error(rpath, f"duplicate key {key!r}", key=key, global_index=gidx)
        keys_seen.add(key)
        if gidx in gidx_key:
            raise file_error(rpath, f"global index {gidx} is used by keys {gidx_key[gidx]!r} "
                                    f"and {key!r}", key=key, global_index=gidx)
        gidx_key[gidx] = key
        if fields:
            try:
                names = tuple(fields)
                known = names in valid_fields
            except TypeError:  # an unhashable entry: the checks below name it
                names, known = None, False
            if not known:
                for f in fields:
                    if type(f) is not str or f not in field_schema:
                        raise file_error(rpath, f"row {key!r} has field {f!r} missing from "
                                                f"field_schema", key=key, global_index=gidx)
                if len(fields) > 1 and len(set(fields)) != len(fields):
                    raise file_error(rpath, f"row {key!r} lists a field twice", key=key,
                                     global_index=gidx)
                valid_fields.add(names)
            with_data[gidx] = key
        rows.append((key, gidx, fields, tag))
    return _Rows(rpath, field_schema, rows, gidx_key, with_data, gens)


def _read_shards(dump_dir: Path, real_dir: str, mpath: Path, manifest: dict, rows: _Rows,
                 check_files: bool) -> list:
    """Read every shard's index, check its records against the rows, and that every row
    with fields has exactly one record."""
    version = manifest["format_version"]
    shards = []
    units_seen = set()
    files_seen = set()
    record_shard: dict[int, str] = {}  # gidx -> shard file holding its record
    for s in manifest["shards"]:
        if not isinstance(s, dict) or "unit" not in s or not is_int(s.get("size")) \
                or s["size"] < 0 or not is_int(s.get("records")):
            raise file_error(mpath, f"malformed shard entry {s!r}")
        unit = s["unit"]
        if type(unit) not in (int, str):
            raise file_error(mpath, f"malformed shard entry: unit {unit!r}")
        if unit in units_seen:
            raise file_error(mpath, f"unit {unit!r} has two shards")
        units_seen.add(unit)
        spath = _check_rel_path(dump_dir, real_dir, s.get("file"), mpath,
                                f"shard of unit {unit}")
        ientry = s.get("index")
        _check_file_entry(ientry, mpath, f"index of unit {unit}")
        ipath = _check_rel_path(dump_dir, real_dir, ientry.get("file"), mpath,
                                f"index of unit {unit}")
        for p in (spath, ipath):
            if p in files_seen:
                raise file_error(mpath, f"file {p.relative_to(dump_dir)} is listed twice")
            files_seen.add(p)
        sidx = _read_checked(ipath, ientry)
        if not isinstance(sidx, dict) or not isinstance(sidx.get("records"), list):
            raise file_error(ipath, "malformed shard index (expected a map with 'records')")
        if sidx.get("format_version") != version or sidx.get("unit") != unit \
                or sidx.get("shard") != s["file"]:
            raise file_error(ipath, f"shard index header (unit {sidx.get('unit')!r}, shard "
                                    f"{sidx.get('shard')!r}) does not match {MANIFEST}")
        records = sidx["records"]
        if len(records) != s["records"]:
            raise file_error(ipath, f"has {len(records)} records, {MANIFEST} says {s['records']}")
        _check_records(records, s, spath, ipath, rows, record_shard)
        if check_files:
            _check_shard_file(spath, s["size"])
        shards.append({"unit": unit, "file": s["file"], "path": spath, "size": s["size"],
                       "records": records})
    if len(record_shard) != len(rows.with_data):
        missing = [g for g in rows.with_data if g not in record_shard]
        g = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise file_error(rows.path, f"row {rows.with_data[g]!r} (global index {g}) has fields "
                                    f"but no record in any shard{more}",
                         key=rows.with_data[g], global_index=g)
    return shards


def _check_records(records: list, s: dict, spath: Path, ipath: Path, rows: _Rows,
                   record_shard: dict) -> None:
    """Check one shard index's ``[gidx, offset, length, crc32]`` entries: inside the
    shard, not overlapping, each for a row with fields that has no other record."""
    size = s["size"]
    last, ordered = -1, True  # written in offset order: no sort needed for the overlap check
    for rec in records:
        if type(rec) is not list or len(rec) != 4:
            raise file_error(ipath, f"malformed record entry {rec!r}")
        gidx, offset, length, crc = rec
        if type(gidx) is not int or type(offset) is not int or type(length) is not int \
                or type(crc) is not int:
            raise file_error(ipath, f"malformed record entry {rec!r}")
        if offset < 0 or length < PREFIX_SIZE or offset + length > size \
                or not 0 <= crc <= 0xFFFFFFFF:
            raise file_error(spath, f"record for global index {gidx} (offset {offset}, "
                                    f"length {length}) lies outside the shard ({size} bytes)",
                             global_index=gidx)
        if gidx not in rows.with_data:
            why = (f"row {rows.gidx_key[gidx]!r} has no fields" if gidx in rows.gidx_key
                   else "no row has that global index")
            raise file_error(ipath, f"record for global index {gidx}, but {why} in {ROW_INDEX}",
                             global_index=gidx, key=rows.gidx_key.get(gidx))
        if gidx in record_shard:
            raise file_error(ipath, f"global index {gidx} has a second record (first in "
                                    f"{record_shard[gidx]})", global_index=gidx,
                             key=rows.with_data[gidx])
        record_shard[gidx] = s["file"]
        if offset < last:
            ordered = False
        last = offset
    prev_end = 0
    for gidx, offset, length, _ in (records if ordered else sorted(records, key=by_offset)):
        if offset < prev_end:
            raise file_error(spath, f"record for global index {gidx} overlaps the previous "
                                    f"record", global_index=gidx)
        prev_end = offset + length


def _check_shard_file(spath: Path, size: int) -> None:
    try:
        st = os.stat(spath)
    except FileNotFoundError:
        raise file_error(spath, "shard file is missing", missing=True) from None
    if st.st_size != size:
        raise file_error(spath, f"shard is {st.st_size} bytes, {MANIFEST} says {size} "
                                f"(truncated or altered)")
