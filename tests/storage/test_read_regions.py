"""Rows read from files in batches share one fresh region per batch (huge pages where the
kernel gives them); a unit holding such rows copies the survivors out of a region that drops
and overwrites left mostly dead, so the region's memory goes back."""
from __future__ import annotations

import os

import pytest

from tqtx import format as fmt
from tqtx.errors import DumpFormatError
from tqtx.storage.unit import StorageUnit
from tqtx.wire.values import RawTensor

LARGE = 96 << 10  # over FRESH_MIN: such records share their batch's region


def _tensor(seed: int, nbytes: int) -> RawTensor:
    return RawTensor("uint8", (nbytes,), bytes((seed * 7 + i) % 251 for i in range(nbytes)))


def _shard(tmp_path, sizes: list[int]) -> tuple[str, list, dict]:
    """A shard of one record per size (global index = position); its entries and rows."""
    path = str(tmp_path / "unit-0.bin")
    rows = {i: {"x": _tensor(i, n), "tag": f"row {i}"} for i, n in enumerate(sizes)}
    with fmt.ShardWriter(path) as w:
        w.write_rows((i, row, 1, "p", f"k{i}") for i, row in rows.items())
    return path, w.entries, rows


def _read(path, entries, batch=128) -> dict:
    return {i: row for b in fmt.read_records(path, entries, batch=batch) for i, row in b}


def test_a_batch_of_large_records_shares_one_region_and_small_ones_keep_their_own(tmp_path):
    sizes = [LARGE] * 30 + [1000, 20 << 10]  # 30 x 96 KiB = 2.8 MiB: over REGION_MIN
    path, entries, want = _shard(tmp_path, sizes)
    assert fmt.shares_regions(entries, 128)
    got = _read(path, entries)
    assert {i: (bytes(r["x"].data), r["tag"]) for i, r in got.items()} == \
        {i: (bytes(r["x"].data), r["tag"]) for i, r in want.items()}
    bases = {id(got[i]["x"].data.obj) for i in range(30)}
    assert len(bases) == 1
    region = got[0]["x"].data.obj
    assert len(region) == sum(e[2] for e in entries[:30])  # exactly the large records
    for i in (30, 31):  # below FRESH_MIN: memory of their own, not the region
        data = got[i]["x"].data
        assert getattr(data, "obj", data) is not region


def test_batches_too_small_for_a_region_read_each_record_into_its_own_memory(tmp_path):
    path, entries, want = _shard(tmp_path, [LARGE] * 30)
    assert not fmt.shares_regions(entries, 16)  # 16 x 96 KiB = 1.5 MiB a batch
    got = _read(path, entries, batch=16)
    assert len({id(r["x"].data.obj) for r in got.values()}) == 30
    assert all(bytes(got[i]["x"].data) == bytes(want[i]["x"].data) for i in want)


def test_a_truncated_record_read_into_a_region_is_named(tmp_path):
    path, entries, _ = _shard(tmp_path, [LARGE] * 30)
    os.truncate(path, entries[20][1] + 100)
    with pytest.raises(DumpFormatError, match="global index 20.*truncated shard"):
        _read(path, entries)


def test_a_corrupt_record_in_a_region_fails_its_checksum(tmp_path):
    path, entries, _ = _shard(tmp_path, [LARGE] * 30)
    with open(path, "r+b") as f:
        f.seek(entries[7][1] + entries[7][2] - 10)
        f.write(b"\xff" * 4)
    with pytest.raises(DumpFormatError, match="global index 7.*checksum"):
        _read(path, entries)


@pytest.fixture
def unit():
    u = StorageUnit(0, "tcp://127.0.0.1:9")
    yield u
    u.server.stop()
    u.pool.shutdown(wait=True)
    u.server.socket.close(linger=0)
    u.server._wake.close(linger=0)


def _region_rows(tmp_path, n: int = 30) -> tuple[dict, int]:
    path, entries, _ = _shard(tmp_path, [LARGE] * n)
    rows = _read(path, entries)
    return rows, sum(r["x"].nbytes for r in rows.values())


def test_drops_that_leave_a_region_mostly_dead_copy_its_live_rows_out(unit, tmp_path):
    rows, nbytes = _region_rows(tmp_path)
    region = rows[0]["x"].data.obj
    unit.replace_rows(rows, {i: 1 for i in rows}, nbytes, shared=True)
    want = {i: bytes(rows[i]["x"].data) for i in (27, 28, 29)}
    drop = unit.server.handlers["DROP_ROWS"][0]
    drop({"indexes": list(range(2)), "gens": [1] * 2}, None)  # 7% of the bytes: no look yet
    assert all(unit.rows[i]["x"].data.obj is region for i in range(2, 30))
    drop({"indexes": list(range(2, 27)), "gens": [1] * 25}, None)
    assert {i: type(unit.rows[i]["x"].data) for i in want} == {i: bytes for i in want}
    assert {i: bytes(unit.rows[i]["x"].data) for i in want} == want
    assert unit.views.checked_at is None  # nothing shared any more: no more looks


def test_overwrites_count_as_the_region_bytes_they_free(unit, tmp_path):
    rows, nbytes = _region_rows(tmp_path)
    unit.replace_rows(rows, {i: 1 for i in rows}, nbytes, shared=True)
    put = unit.server.handlers["PUT_ROWS"][0]
    put({"rows": [[i, {"x": _tensor(100 + i, LARGE)}] for i in range(28)],
         "gens": [2] * 28}, None)
    assert type(unit.rows[29]["x"].data) is bytes  # copied out of the region
    assert bytes(unit.rows[29]["x"].data) == bytes(_tensor(29, LARGE).data)
    assert bytes(unit.rows[3]["x"].data) == bytes(_tensor(103, LARGE).data)


def test_a_region_the_live_rows_still_fill_stays_shared(unit, tmp_path):
    rows, nbytes = _region_rows(tmp_path)
    region = rows[0]["x"].data.obj
    unit.replace_rows(rows, {i: 1 for i in rows}, nbytes, shared=True)
    unit.server.handlers["DROP_ROWS"][0]({"indexes": [0, 1], "gens": [1] * 2}, None)
    assert unit.views.look(unit.bytes_held) == 0  # 93% live: nothing copied
    assert all(unit.rows[i]["x"].data.obj is region for i in range(2, 30))
    assert unit.views.checked_at == unit.bytes_held


