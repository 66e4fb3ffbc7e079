"""Whole-dump checks and summaries: :func:`verify_dump` reads every record,
:func:`inspect_dump` only the indexes."""
from __future__ import annotations

import os

from tqtx.layout import fsutil
from tqtx.errors import DumpFormatError
from tqtx.schema import validate_row
from tqtx.wire.values import RawTensor

from .index import read_dump_index
from .shard import by_offset, read_entry


def verify_dump(dump_dir) -> dict:
    """Check a whole dump, reading every record (crc32, decoding, schema, and in a format
    version 2 dump that each record names the row index's partition, key and generation).

    Returns ``{"ok", "dump_dir", "records", "bytes", "errors": [{"file", "global_index",
    "key", "error"}]}``; record errors are collected, an index-level error is the only one.
    """
    result = {"ok": False, "dump_dir": str(dump_dir), "records": 0, "bytes": 0, "errors": []}
    try:
        idx = read_dump_index(dump_dir)
    except DumpFormatError as exc:
        result["errors"].append({"file": getattr(exc, "file", str(dump_dir)),
                                 "global_index": getattr(exc, "global_index", None),
                                 "key": getattr(exc, "key", None), "error": str(exc)})
        return result
    fields_of = {gidx: (key, fields) for key, gidx, fields, _ in idx.rows}
    idents = idx.record_idents() or {}
    errors = result["errors"]
    for shard in idx.shards:
        path = shard["path"]
        try:
            fd = os.open(path, os.O_RDONLY | fsutil.O_CLOEXEC)
        except OSError as exc:
            errors.append({"file": str(path), "global_index": None, "key": None,
                           "error": f"{path}: cannot open: {exc}"})
            continue
        try:
            for entry in sorted(shard["records"], key=by_offset):
                gidx = entry[0]
                key, fields = fields_of[gidx]
                try:
                    _, row = read_entry(fd, entry, True, str(path), idents.get(gidx))
                    where = f"{path}: record for global index {gidx} (key {key!r})"
                    if set(row) != set(fields):
                        raise DumpFormatError(f"{where}: fields {sorted(row)} differ from the "
                                              f"row index {sorted(fields)}")
                    validate_row(row, idx.field_schema, where=where)
                except DumpFormatError as exc:
                    errors.append({"file": str(path), "global_index": gidx, "key": key,
                                   "error": str(exc)})
                result["records"] += 1
                result["bytes"] += entry[2]
        finally:
            os.close(fd)
    result["ok"] = not errors
    return result


def _jsonable(value):
    """``value`` with tensors and byte strings replaced by short descriptions."""
    if isinstance(value, RawTensor):
        return f"tensor({value.dtype}, {list(value.shape)})"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"bytes({memoryview(value).nbytes})"
    return value


def inspect_dump(dump_dir) -> dict:
    """JSON-friendly summary of a dump (no shard payload read)."""
    idx = read_dump_index(dump_dir)
    m = idx.manifest
    fields = {}
    for name, fs in idx.field_schema.items():
        if fs.get("kind") == "tensor":
            fields[name] = {"kind": "tensor", "dtype": fs["dtype"], "shape": fs.get("shape"),
                            "jagged": fs.get("jagged", False)}
        else:
            fields[name] = {"kind": fs.get("kind")}
    tags = []
    for key, _, _, tag in idx.rows:
        if tag is not None:
            tags.append({"key": key, "tag": _jsonable(tag)})
            if len(tags) == 5:
                break
    return {"dump_dir": str(idx.dump_dir), "partition_id": idx.partition_id,
            "dump_id": idx.dump_id, "format_version": m["format_version"],
            "created_at": m.get("created_at"), "tqtx_version": m.get("tqtx_version"),
            "writer": m.get("writer"), "keys": m["keys"], "rows_with_data": m["rows_with_data"],
            "bytes": m["bytes"], "fields": fields,
            "shards": [{"unit": s["unit"], "file": s["file"], "size": s["size"],
                        "records": len(s["records"])} for s in idx.shards],
            "sample_tags": tags}
