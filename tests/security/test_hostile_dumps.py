"""Hostile and corrupt dumps: refused with an error naming the file, or loaded correctly.

Never wrong data, never a dead unit, never code execution (no pickle anywhere).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import uuid
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

import tqtx as tq  # noqa: E402
from buffers import assert_same_rows, assert_same_value, rollout_batch  # noqa: E402
from tqtx import format as fmt  # noqa: E402
from tqtx.layout.paths import dump_journal_path  # noqa: E402
from treehash import assert_unchanged, snapshot, tqtx_own  # noqa: E402

N = 8
DUMP_FILES = ["dump_info.json", "rows.msgpack"]  # shards added per dump (unit-k.bin/.index)
JOURNAL = "<journal>"
MUTATIONS = ["truncate", "delete", "append", "flip"]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def base_dump(tmp_path_factory):
    """A reference dump of N rows (every kind of field), written once per module."""
    import tqtx.api as api
    root = tmp_path_factory.mktemp("hostile")
    state = root / "state"
    tq.close()
    tq.init({"num_units": 3, "state_dir": str(state)})
    keys, td, tags = rollout_batch(N, seed=3)
    tq.kv_batch_put(keys, "src", td, tags=tags)
    dump = root / "base"
    tq.dump_data_by_key(dump, keys, "src")
    assert dump_journal_path(dump).exists()
    files = sorted(str(p.relative_to(dump)) for p in dump.rglob("*") if p.is_file())
    assert any(f.endswith(".bin") for f in files) and any(f.endswith(".index") for f in files)
    yield {"root": root, "dump": dump, "keys": keys, "td": td, "tags": tags, "files": files,
           "cfg": dict(api._config)}
    tq.close()


def _copy(base: dict, name: str | None = None) -> Path:
    dest = base["root"] / (name or f"copy-{uuid.uuid4().hex[:10]}")
    shutil.copytree(base["dump"], dest)
    shutil.copyfile(dump_journal_path(base["dump"]), dump_journal_path(dest))
    return dest


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    for suffix in (".journal.sqlite", ".journal.sqlite-journal", ".lock"):
        try:
            os.unlink(str(path) + suffix)
        except FileNotFoundError:
            pass


def _units_alive() -> None:
    client = tq.get_client()
    for u in range(client.num_units):
        assert client.unit(u).call("PING", timeout=20)["unit_id"] == u
    client.controller.call("PING", timeout=20)


def _check_loaded(base: dict, pid: str) -> None:
    """What a successful load produced is exactly the reference rows and tags."""
    keys, td, tags = base["keys"], base["td"], base["tags"]
    listed = tq.kv_list(pid)[pid]
    assert set(listed) == set(keys)
    for k, t in zip(keys, tags):
        assert_same_value(t, listed[k], f"tag of {k}")
    got = tq.kv_batch_get(keys, pid)
    assert_same_rows(td, got, keys)


def _mutate(path: Path, mutation: str, pos: float, data: bytes) -> None:
    raw = path.read_bytes()
    at = min(int(pos * len(raw)), max(len(raw) - 1, 0))
    if mutation == "truncate":
        path.write_bytes(raw[:at])
        return raw[at:].strip() != b""  # cutting only the manifest's final newline is harmless
    elif mutation == "delete":
        path.unlink()
        return True
    elif mutation == "append":
        path.write_bytes(raw + (data or b"\0"))
    elif mutation == "flip":
        mask = (data[0] if data else 0) or 0x01
        b = bytearray(raw)
        b[at] ^= mask
        path.write_bytes(bytes(b))


def _names(target: str) -> list[str]:
    """Strings one of which an error about ``target`` must contain."""
    if target == JOURNAL:
        return ["journal.sqlite"]
    return [target, os.path.basename(target)]


def _attempt(base: dict, target: str, mutation: str, pos: float, data: bytes) -> str:
    """Mutate one file of a fresh copy, load it; returns 'refused' or 'loaded'."""
    dump = _copy(base)
    pid = f"h-{uuid.uuid4().hex[:8]}"
    path = dump_journal_path(dump) if target == JOURNAL else dump / target
    must_refuse = _mutate(path, mutation, pos, data) and target != JOURNAL
    tree = snapshot(base["root"])
    outcome = None
    try:
        try:
            tq.load_data_by_key(dump, partition_id=pid)
        except Exception as exc:  # noqa: BLE001 - every refusal must name the damaged file
            msg = f"{type(exc).__name__}: {exc}"
            # A damaged dump journal is reported by SQLite without the file's name: see
            # test_damaged_journal_error_names_the_file (xfail); here it must only be refused.
            # A damaged manifest may rename the files it lists: the error then names the
            # (missing) file the manifest points to, inside this dump.
            names = _names(target) + ([str(dump)] if target == fmt.MANIFEST else [])
            assert target == JOURNAL or any(n in msg for n in names), \
                f"{mutation} of {target}: error does not name the file: {msg}"
            # nothing became visible
            assert tq.kv_list(pid).get(pid, {}) == {}, "a refused load published keys"
            outcome = "refused"
        else:
            assert not must_refuse, f"{mutation} at {pos:.3f} of {target} was not refused"
            _check_loaded(base, pid)
            outcome = "loaded"
        _units_alive()
        # Refused or loaded, a load changed nothing but the dump's lock and journal files
        # (and the controller's state dir): not the dump, not its neighbours.
        own = tqtx_own(base["root"], dump, dump_may_change=False)
        assert_unchanged(tree, snapshot(base["root"]),
                         lambda rel: own(rel) or rel.split(os.sep)[0] == "state")
    finally:
        try:
            tq.kv_clear(list(base["keys"]), pid)
        except Exception:  # noqa: BLE001 - a pending restore keeps its keys; the pid is unique
            pass
        _remove(dump)
    return outcome


# ---------------------------------------------------------------- the fuzz test
def _cases(base):
    targets = base["files"] + [JOURNAL]
    return st.tuples(st.sampled_from(targets), st.sampled_from(MUTATIONS),
                     st.floats(0, 1, allow_nan=False), st.binary(min_size=1, max_size=64))


SEEN: dict = {}


def _fuzz(base, case):
    target, mutation, pos, data = case
    outcome = _attempt(base, target, mutation, pos, data)
    SEEN.setdefault((target, mutation), {}).setdefault(outcome, 0)
    SEEN[(target, mutation)][outcome] += 1


@pytest.mark.slow
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_damaged_dump_is_refused_or_loads_correctly(base_dump, data):
    _fuzz(base_dump, data.draw(_cases(base_dump)))


@pytest.mark.slow
@pytest.mark.timeout(600)  # 1,500 examples of a restore each: minutes on a busy machine
@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_damaged_dump_many(base_dump, data):
    _fuzz(base_dump, data.draw(_cases(base_dump)))


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_every_file_every_mutation(base_dump, mutation):
    """Deterministic sweep: each file of the dump, each kind of damage, mid-file."""
    for target in base_dump["files"] + [JOURNAL]:
        outcome = _attempt(base_dump, target, mutation, 0.5, b"\xff\x00garbage")
        if target != JOURNAL and mutation != "append":
            assert outcome == "refused", (target, mutation)


def test_journal_appended_is_harmless(base_dump):
    assert _attempt(base_dump, JOURNAL, "append", 1.0, b"\0" * 100) == "loaded"
    assert _attempt(base_dump, JOURNAL, "delete", 0.0, b"") == "loaded"


def test_damaged_journal_error_names_the_file(base_dump):
    dump = _copy(base_dump)
    try:
        journal = dump_journal_path(dump)
        journal.write_bytes(journal.read_bytes()[:1000])
        with pytest.raises(tq.DumpFormatError, match=r"journal\.sqlite: damaged dump journal"):
            tq.load_data_by_key(dump, partition_id=f"j-{uuid.uuid4().hex[:6]}")
    finally:
        _remove(dump)


def test_undamaged_copy_loads(base_dump):
    dump = _copy(base_dump)
    pid = f"ok-{uuid.uuid4().hex[:6]}"
    try:
        tq.load_data_by_key(dump, partition_id=pid)
        _check_loaded(base_dump, pid)
    finally:
        _remove(dump)


# ---------------------------------------------------------------- consistent forgeries
def _rewrite_manifest(dump: Path, edit) -> None:
    m = json.loads((dump / fmt.MANIFEST).read_text())
    edit(m)
    (dump / fmt.MANIFEST).write_text(json.dumps(m))


def _fix_entry(entry: dict, path: Path) -> None:
    raw = path.read_bytes()
    entry["size"], entry["crc32"] = len(raw), zlib.crc32(raw)


@pytest.mark.parametrize("bad", ["../x", "../base/shards/unit-0.bin", "/etc/passwd",
                                 "shards/../../x", "shards/./unit-0.bin", "link"])
def test_shard_outside_dump_is_refused(base_dump, bad):
    dump = _copy(base_dump)
    outside = dump.parent / "x"
    outside.write_bytes(b"TQR1" + b"\0" * 64)
    if bad == "link":
        os.symlink(outside, dump / "shards" / "link")
        bad = "shards/link"
    pid = f"o-{uuid.uuid4().hex[:6]}"
    try:
        _rewrite_manifest(dump, lambda m: m["shards"][0].__setitem__("file", bad))
        with pytest.raises(tq.DumpFormatError, match="dump_info.json") as ei:
            tq.load_data_by_key(dump, partition_id=pid)
        assert bad in str(ei.value)
        # the same for a shard *index* and the row index pointing outside
        _rewrite_manifest(dump, lambda m: m["row_index"].__setitem__("file", "../x"))
        with pytest.raises(tq.DumpFormatError, match="outside|escapes"):
            tq.load_data_by_key(dump, partition_id=pid)
        assert tq.kv_list(pid).get(pid, {}) == {}
        _units_alive()
    finally:
        _remove(dump)
        outside.unlink()


class _Marker:
    """Unpickling this creates the marker file (what a pickle-based loader would do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_pickle(marker: Path) -> bytes:
    blob = pickle.dumps(_Marker(str(marker)), protocol=2)
    # sanity: this really is an executing pickle
    probe = marker.with_suffix(".probe")
    pickle.loads(pickle.dumps(_Marker(str(probe)))).close()
    assert probe.exists()
    probe.unlink()
    return blob


# where the pickle is planted -> how the load refuses the dump (before anything unpickles it)
REFUSED = {
    "rows": r"rows\.msgpack: checksum \(CRC-32C\) mismatch",
    "shard": r"unit-0\.index: checksum \(CRC-32C\) mismatch",
    "shard_index": r"unit-0\.index: checksum \(CRC-32C\) mismatch",
    "manifest": r"dump_info\.json: invalid JSON",
    "journal": r"journal\.sqlite: damaged dump journal",
}


@pytest.mark.parametrize("where", list(REFUSED))
def test_pickle_in_dump_is_never_executed(base_dump, where, tmp_path):
    marker = tmp_path / f"PWNED-{where}"
    blob = _evil_pickle(marker)
    dump = _copy(base_dump)
    pid = f"pk-{uuid.uuid4().hex[:6]}"
    try:
        if where == "rows":
            (dump / "rows.msgpack").write_bytes(blob)
            _rewrite_manifest(dump, lambda m: _fix_entry(m["row_index"], dump / "rows.msgpack"))
        elif where == "shard":
            shard = dump / "shards" / "unit-0.bin"
            shard.write_bytes(blob)
            idx_path = dump / "shards" / "unit-0.index"
            idx = msgpack.unpackb(idx_path.read_bytes(), raw=False)
            # one record spanning the whole pickle, with a matching checksum
            idx["records"] = [[idx["records"][0][0], 0, len(blob), zlib.crc32(blob)]]
            idx_path.write_bytes(msgpack.packb(idx, use_bin_type=True))

            def edit(m):
                s = m["shards"][0]
                s["size"], s["records"] = len(blob), 1
                _fix_entry(s["index"], idx_path)
            _rewrite_manifest(dump, edit)
        elif where == "shard_index":
            idx_path = dump / "shards" / "unit-0.index"
            idx_path.write_bytes(blob)
            _rewrite_manifest(dump, lambda m: _fix_entry(m["shards"][0]["index"], idx_path))
        elif where == "manifest":
            (dump / fmt.MANIFEST).write_bytes(blob)
        elif where == "journal":
            dump_journal_path(dump).write_bytes(blob)
        with pytest.raises(tq.DumpFormatError, match=REFUSED[where]):
            tq.load_data_by_key(dump, partition_id=pid)
        for fn in (tq.read_row_index, fmt.verify_dump, fmt.inspect_dump):
            try:
                fn(dump)
            except Exception:  # noqa: BLE001 - refusing is fine; executing is not
                pass
        assert not marker.exists(), "a pickle in the dump was executed"
        assert tq.kv_list(pid).get(pid, {}) == {}
        _units_alive()
    finally:
        _remove(dump)


def test_pickle_as_stored_value_stays_bytes(base_dump, tmp_path):
    """Pickle bytes stored as a value or tag round-trip through a dump as inert bytes."""
    marker = tmp_path / "PWNED-value"
    blob = _evil_pickle(marker)
    pid = f"pv-{uuid.uuid4().hex[:6]}"
    dump = base_dump["root"] / f"pv-{uuid.uuid4().hex[:6]}"
    try:
        tq.kv_put("evil", pid, {"payload": blob, "x": torch.tensor([1.0])}, tag={"p": blob})
        tq.dump_data_by_key(dump, ["evil"], pid)
        tq.kv_clear(["evil"], pid)
        tq.load_data_by_key(dump, partition_id=pid)
        got = tq.kv_batch_get(["evil"], pid)
        value = got["payload"]
        value = value[0] if isinstance(value, list) else value.tolist()[0]
        assert value == blob
        assert tq.kv_list(pid)[pid]["evil"]["p"] == blob
        assert not marker.exists()
    finally:
        tq.kv_clear(["evil"], pid)
        _remove(dump)


def test_pickle_ext_type_in_record_is_refused(base_dump, tmp_path):
    """A record whose object field is a msgpack extension (type 99) holding a pickle."""
    marker = tmp_path / "PWNED-ext"
    blob = _evil_pickle(marker)
    from tqtx.wire import codec
    with pytest.raises(codec.CodecError, match="unexpected extension type 99"):
        codec.unpack_stored(msgpack.packb(msgpack.ExtType(99, blob)))
    with pytest.raises(codec.CodecError):
        codec.unpackb(msgpack.packb({"v": msgpack.ExtType(99, blob)}))
    assert not marker.exists()
