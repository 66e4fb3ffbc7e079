"""Index writers: rows and records given as lists, tuples or other sequences are written
as the same bytes (lists of lists go to msgpack as given, without a copy)."""
from __future__ import annotations

import pytest

from tqtx import format as fmt


def _written(tmp_path, name, rows, entries):
    d = tmp_path / name
    d.mkdir()
    ri = fmt.write_row_index(d, partition_id="p", dump_id="x", field_schema={}, rows=rows)
    si = fmt.write_shard_index(d, 0, entries)
    return ri, si, (d / fmt.ROW_INDEX).read_bytes(), (d / "shards" / "unit-0.index").read_bytes()


def test_row_and_shard_index_bytes_do_not_depend_on_the_sequence_type(tmp_path):
    rows = [["k0", 0, [], None], ["k1", 1, [], None]]
    entries = [[1, 0, 40, 7], [3, 40, 40, 9]]
    want = _written(tmp_path, "lists", rows, entries)
    assert _written(tmp_path, "tuples", [tuple(r) for r in rows],
                    [tuple(e) for e in entries]) == want
    assert _written(tmp_path, "mixed", [rows[0], tuple(rows[1])], iter(entries)) == want
    assert _written(tmp_path, "gen", (r for r in rows),
                    [e for e in entries]) == want


def test_shard_index_is_created_beside_its_shard_and_never_overwrites(tmp_path):
    shard = tmp_path / fmt.shard_file_name(3)
    assert fmt.shard_dump_dir(shard, 3) == tmp_path
    for wrong in (tmp_path / "unit-3.bin", tmp_path / fmt.shard_file_name(4)):
        with pytest.raises(ValueError, match="not the shard of unit 3"):
            fmt.shard_dump_dir(wrong, 3)
    fmt.write_shard_index(tmp_path, 3, [[0, 0, 8, 1]])
    before = (tmp_path / fmt.shard_index_name(3)).read_bytes()
    with pytest.raises(FileExistsError):
        fmt.write_shard_index(tmp_path, 3, [])
    assert (tmp_path / fmt.shard_index_name(3)).read_bytes() == before
