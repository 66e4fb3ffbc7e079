"""On-disk dump format (format_version 1): shards of per-row records, indexes, manifest.

Layout of a dump directory::

    dump_info.json            manifest, written last (its presence marks a finished dump)
    rows.msgpack              row index: key, global index, fields and tag of every row
    shards/unit-<k>.bin       concatenated self-contained records, one per row with data
    shards/unit-<k>.index     [global_index, offset, length, crc32] per record of the shard

Modules: :mod:`.records` (one row as bytes), :mod:`.shard` (shard files), :mod:`.index`
(row index, shard indexes, manifest), :mod:`.verify` (whole-dump checks). Importers use
``from tqtx import format as fmt`` and the names below. Torch-free: this runs inside
storage-unit processes.
"""
from .index import (FORMAT_VERSION, MANIFEST, ROW_INDEX, SHARDS_DIR, DumpIndex,
                    read_dump_index, read_row_index, write_manifest, write_row_index,
                    write_shard_index)
from .records import PREFIX_SIZE, RECORD_MAGIC, checksum, decode_record, encode_record
from .shard import (ShardWriter, read_records, shard_dump_dir, shard_file_name,
                    shard_index_name, shares_regions)
from .verify import inspect_dump, verify_dump

__all__ = [
    "FORMAT_VERSION", "MANIFEST", "PREFIX_SIZE", "RECORD_MAGIC", "ROW_INDEX", "SHARDS_DIR",
    "DumpIndex", "ShardWriter", "checksum", "decode_record", "encode_record", "inspect_dump",
    "read_dump_index", "read_records", "read_row_index", "shard_dump_dir", "shard_file_name",
    "shard_index_name", "shares_regions",
    "verify_dump", "write_manifest", "write_row_index", "write_shard_index",
]
