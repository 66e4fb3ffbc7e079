"""Index writers: rows and records given as lists, tuples or other sequences are written
as the same bytes (lists of lists go to msgpack as given, without a copy)."""
from __future__ import annotations

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
