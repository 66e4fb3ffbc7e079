"""IdRecords: a bounded request-ID map kept in preallocated memory (tqtx/wire/id_records.py)."""
import random
import tracemalloc
import pytest
from hypothesis import given, settings, strategies as st

from tqtx.wire.id_records import IdRecords


def test_round_trip_replace_and_miss():
    r = IdRecords(4, slot_bytes=64)
    r["a"] = b"1"
    r["b"] = b""
    assert r.get("a") == b"1" and r.get("b") == b"" and "b" in r
    assert r.get("c") is None and r.get("c", b"x") == b"x" and "c" not in r
    r["a"] = b"22"
    assert r.get("a") == b"22" and len(r) == 2


def test_the_oldest_entry_is_forgotten_first():
    r = IdRecords(3, slot_bytes=32)
    for k in "abcd":
        r[k] = k.encode() * 3
    assert "a" not in r and [r.get(k) for k in "bcd"] == [b"bbb", b"ccc", b"ddd"]
    assert len(r) == 3


def test_an_entry_larger_than_a_slot_is_kept_too():
    r = IdRecords(2, slot_bytes=16)
    big = bytes(range(256)) * 4
    r["rid-big"] = big
    r["x"] = b"small"
    assert r.get("rid-big") == big and r.get("x") == b"small"
    r["rid-big"] = b"now small"  # moves into a slot; the large copy is dropped
    assert r.get("rid-big") == b"now small" and len(r) == 2


def test_a_value_that_is_not_bytes_is_kept_as_it_is_and_replaces_either_kind():
    r = IdRecords(2, slot_bytes=64)
    frames = [b"header", memoryview(b"payload")]
    r["rid"] = b"one frame"
    r["rid"] = frames  # the slot entry goes; the list is kept as it is, not copied
    assert r.get("rid") is frames and len(r) == 1
    r["rid"] = b"one frame again"  # and back into a slot: the list goes
    assert r.get("rid") == b"one frame again" and len(r) == 1
    for k in "abc":  # bounded like the rest: the oldest list is forgotten
        r[k] = [k]
    assert "a" not in r and r.get("c") == ["c"]


def test_reply_cache_returns_the_frames_it_was_given_of_either_shape():
    from tqtx.wire.rpc import ReplyCache
    c = ReplyCache(size=4)
    c.put("one", [b"reply"])
    c.put("many", [b"head", b"frame1", b"frame2"])
    assert c.get("one") == [b"reply"] and c.get("many") == [b"head", b"frame1", b"frame2"]
    c.put("one", [b"head", b"frame"])  # a later reply of another shape wins over the first
    assert c.get("one") == [b"head", b"frame"]
    c.put("many", [b"x" * 4096])  # a one-frame reply larger than a slot
    assert c.get("many") == [b"x" * 4096] and c.get("missing") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.binary(max_size=40)), max_size=300),
       st.integers(1, 16))
def test_behaves_as_a_bounded_insertion_ordered_map(ops, capacity):
    """Against a reference model: a key is found, with its latest value, exactly while its
    latest insert is among the last ``capacity`` inserts."""
    r = IdRecords(capacity, slot_bytes=48)
    writes: list[tuple[str, bytes]] = []
    for k, v in ops:
        key = f"rid-{k}"
        r[key] = v
        writes.append((key, v))
        recent = dict(writes[-capacity:])
        latest = dict(writes)
        for k2 in range(41):
            key2 = f"rid-{k2}"
            want = latest[key2] if key2 in recent else None
            assert r.get(key2) == want
        assert len(r) == len(recent)


def test_colliding_hashes_survive_deletions():
    r = IdRecords(8, slot_bytes=32)
    rng = random.Random(7)
    writes = []
    for i in range(2000):
        key = f"k{rng.randrange(30)}"
        val = str(i).encode()
        r[key] = val
        writes.append((key, val))
        recent = dict(writes[-8:])
        assert all(r.get(f"k{j}") == recent.get(f"k{j}") for j in range(30))


def test_recording_leaves_no_object_per_entry():
    r = IdRecords(512, slot_bytes=96)
    for i in range(600):  # wrap once, so replacing is measured too
        r[f"warm-{i}"] = b"w" * 40
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(2000):
            r[f"rid-{i:032x}"] = b'{"rid": "x", "ok": true, "result": {"rows": 3}}'
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(d.count_diff for d in after.compare_to(before, "filename")
                if "id_records" in str(d.traceback))
    assert grown <= 2, grown


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        IdRecords(0)
    with pytest.raises(ValueError):
        IdRecords(4, slot_bytes=8)
