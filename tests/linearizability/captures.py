"""What a put writes, how a read row is identified, and what a dump or checkpoint captured.

Every put writes a unique value id per key, ``<partition>/<key>#w<process>.<seq>``, encoded
in its row as an int64 field ``ids = [key code, process, seq]`` plus a field ``pad`` whose
length and contents follow from those three (so a row mixed from two puts shows as torn),
and in its tag as ``{"vid": value id}``. A read decodes a row back to the value id of the put
(and the key!) it came from.

A dump's or checkpoint's contents are learned offline from its files (its row index and
shards; a checkpoint's ``controller.msgpack`` and unit files), never by reading the live
system. Runs in the worker processes (imports tqtx's format readers; no torch).
"""
from __future__ import annotations

import json
import os

ABSENT = "<absent>"
LOST = "<lost>"
NOROW = "<no row>"  # a captured key whose row is missing: no write produces it


class KeySpace:
    """The keys of the run: ``keys_per_partition`` keys in each partition."""

    def __init__(self, partitions: list[str], keys_per_partition: int):
        self.partitions = list(partitions)
        self.keys = [(p, f"k{i}") for p in self.partitions for i in range(keys_per_partition)]
        self.code = {k: i for i, k in enumerate(self.keys)}

    def of(self, pid: str) -> list[tuple[str, str]]:
        return [k for k in self.keys if k[0] == pid]


def value_id(space: KeySpace, code: int, proc: int, seq: int) -> str:
    pid, key = space.keys[code]
    return f"{pid}/{key}#w{proc}.{seq}"


def pad_of(code: int, proc: int, seq: int) -> list[int]:
    return [code * 1_000_003 + proc * 10_007 + seq] * (1 + (seq + code) % 5)


def row_value(space: KeySpace, ids: list[int], pad: list[int]) -> str:
    """The value id a row holds (``<torn ...>`` / ``<garbage ...>`` if it is not a put's)."""
    if len(ids) != 3 or not 0 <= ids[0] < len(space.keys):
        return f"<garbage ids={ids} pad={pad[:6]}>"
    code, proc, seq = ids
    vid = value_id(space, code, proc, seq)
    if list(pad) != pad_of(code, proc, seq):
        return f"<torn {vid} pad={list(pad)[:6]}>"
    return vid


def tag_value(tag) -> str:
    if isinstance(tag, dict) and isinstance(tag.get("vid"), str) and len(tag) == 1:
        return tag["vid"]
    return f"<tag {tag!r}>"


def _ints(raw) -> list[int]:
    """A stored int64 tensor (tqtx.wire.values.RawTensor) as a list of ints."""
    if raw.dtype != "int64":
        return [-1]
    mv = memoryview(raw.data).cast("B")
    return list(mv.cast("q")) if mv.nbytes else []


def _record_value(space: KeySpace, row: dict) -> str:
    if "ids" not in row or "pad" not in row:
        return f"<fields {sorted(row)}>"
    return row_value(space, _ints(row["ids"]), _ints(row["pad"]))


def _log_rows(ckpt_dir: str, log: dict, gens: dict) -> dict:
    """The rows a checkpoint's row log files hold (replayed as a unit would); their
    generations go into ``gens``."""
    from tqtx.storage.logdir import read_rows
    rows, mine = read_rows([os.path.join(ckpt_dir, log["dir"], f["file"])
                            for f in log["files"]])
    gens.update(mine)
    return rows


def _records(path, entries) -> dict:
    from tqtx import format as fmt
    out = {}
    for batch in fmt.read_records(path, entries):
        for gidx, row in batch:
            out[gidx] = row
    return out


def dump_capture(space: KeySpace, dump_dir: str) -> dict:
    """``{"values": {(pid, key): value id}, "tags": {...}}`` of a published dump."""
    from tqtx import format as fmt
    index = fmt.read_dump_index(dump_dir)
    rows = {}
    for shard in index.shards:
        rows.update(_records(shard["path"], shard["records"]))
    pid = index.partition_id
    values, tags = {}, {}
    for key, gidx, _fields, tag in index.rows:
        row = rows.get(gidx)
        values[(pid, key)] = NOROW if row is None else _record_value(space, row)
        tags[(pid, key)] = tag_value(tag)
    return {"values": values, "tags": tags}


def checkpoint_capture(space: KeySpace, ckpt_dir: str) -> dict:
    """Every key of ``space`` as a checkpoint holds it: its value id, LOST, NOROW or ABSENT
    (see tqtx/dump/checkpoint.py for the layout)."""
    from tqtx.wire.codec import unpackb
    with open(os.path.join(ckpt_dir, "checkpoint_info.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(ckpt_dir, manifest["controller"]["file"]), "rb") as f:
        meta = unpackb(f.read())
    rows, gens = {}, {}
    for unit in manifest["units"]:
        if "log" in unit:  # format version 3: the unit's row log files
            rows.update(_log_rows(ckpt_dir, unit["log"], gens))
            continue
        with open(os.path.join(ckpt_dir, unit["index"]["file"]), "rb") as f:
            entries = unpackb(f.read())
        rows.update(_records(os.path.join(ckpt_dir, unit["file"]), entries))
    values = {k: ABSENT for k in space.keys}
    tags = {k: ABSENT for k in space.keys}
    for pid, part in meta["partitions"].items():
        for row in part["rows"]:
            key, gidx, _fields, tag = row[:4]
            k = (pid, key)
            if len(row) > 4 and row[4] is not None:
                values[k] = LOST
            elif gidx not in rows or (gidx in gens and len(row) > 5 and gens[gidx] != row[5]):
                values[k] = NOROW
            else:
                values[k] = _record_value(space, rows[gidx])
            tags[k] = tag_value(tag)
    return {"values": values, "tags": tags}


def save_capture(path: str, directory: str, capture: dict) -> None:
    """Publish a capture for the loaders of other processes (atomically)."""
    data = {"dir": directory,
            "values": [[p, k, v] for (p, k), v in capture["values"].items()],
            "tags": [[p, k, v] for (p, k), v in capture["tags"].items()]}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def load_capture(path: str) -> tuple[str, dict]:
    with open(path) as f:
        data = json.load(f)
    return data["dir"], {"values": {(p, k): v for p, k, v in data["values"]},
                         "tags": {(p, k): v for p, k, v in data["tags"]}}
