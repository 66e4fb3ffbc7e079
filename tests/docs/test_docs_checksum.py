"""The docs say what checksum the dump format really uses (issue 12, item 7).

The ``crc32`` fields of dumps and checkpoints hold CRC-32C (Castagnoli) values, not zlib's
CRC-32; a reader implementing the format from docs/data_dump.md must get matching values.
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

from crc32c import crc32c

from tqtx import format as fmt

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_record_checksums_are_crc32c(tmp_path):
    path = tmp_path / "unit-0.bin"
    with fmt.ShardWriter(path) as w:
        w.write_rows([(0, {"x": b"payload"}, 1, "p", "a"), (1, {"y": "text"}, 2, "p", "b")])
    data = path.read_bytes()
    for _gidx, offset, length, crc in w.entries:
        record = data[offset:offset + length]
        assert crc == crc32c(record) != zlib.crc32(record)
    entry = fmt.write_shard_index(tmp_path, 0, w.entries)
    index = (tmp_path / entry["file"]).read_bytes()
    assert entry["crc32"] == crc32c(index) != zlib.crc32(index)


def test_data_dump_doc_names_crc32c_and_its_check_value():
    text = (ROOT / "docs" / "data_dump.md").read_text()
    assert "CRC-32C" in text
    value = re.search(r'CRC-32C of\s+`b"123456789"` is `(0x[0-9A-Fa-f]{8})`', text)
    assert value, "data_dump.md gives no check value for its checksum"
    assert int(value.group(1), 16) == fmt.checksum(b"123456789") == 0xE3069283


def test_no_doc_says_the_format_uses_zlib():
    bad = []
    for doc in DOCS:
        for para in re.split(r"\n\s*\n", doc.read_text()):
            # zlib may only be mentioned to contrast it with the CRC-32C actually used
            if "zlib" in para.lower() and "CRC-32C" not in para:
                bad.append(f"{doc.name}: {para.strip()[:120]!r}")
    assert not bad, "\n".join(bad)
