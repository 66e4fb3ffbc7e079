"""Tags on the wire (tqtx/client/tags.py): a put's tags encoded as encode_object would,
faster for plain ones; a reply's tags decoded back."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

from tqtx.client import tensors as T
from tqtx.client.tags import decode_tag, encode_tags
from tqtx.wire.codec import decode, encode
from tqtx.wire.values import RawTensor


def _wire(obj):
    return decode([bytes(memoryview(f)) for f in encode(obj)])


def test_decode_tag_keeps_a_plain_tag_and_decodes_one_holding_tensors():
    plain = _wire({"step": 3, "name": "a", "score": 0.5, "none": None})
    assert decode_tag(plain) is plain
    wired = _wire({"t": T.encode_object(torch.arange(3), "tag"), "xs": [1, {"y": 2}]})
    got = decode_tag(wired)
    assert torch.equal(got["t"], torch.arange(3)) and got["xs"] == [1, {"y": 2}]


_TAG_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                        st.floats(allow_nan=False), st.text(), st.binary(max_size=8),
                        st.lists(st.integers(0, 9), max_size=3))
_TAGS = st.one_of(st.none(), st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 3)),
                                             _TAG_VALUES, max_size=4))


def _encoded_or_error(fn, tag):
    try:
        return fn(tag)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TAGS, max_size=6))
def test_encode_tags_gives_what_encode_object_gives(tags):
    want = [_encoded_or_error(lambda t: T.encode_object(t or {}, "tag"), t) for t in tags]
    got = [_encoded_or_error(lambda t: encode_tags([t])[0], t) for t in tags]
    assert got == want
    assert all(type(w) is type(g) for w, g in zip(want, got) if type(w) is not tuple)


def test_encode_tags_copies_each_tag_once_and_names_bad_values():
    shared, other = {"step": 1, "s": "a"}, {"step": 1, "s": "a"}
    out = encode_tags([shared, other, shared, None])
    assert out == [shared, other, shared, {}]
    assert out[0] is out[2] and out[0] is not shared and out[1] is not out[0]
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        encode_tags([{"s": "bad\udcff"}])
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        encode_tags([{"n": 1 << 64}])
    t = encode_tags([{"x": torch.arange(2)}])[0]["x"]
    assert isinstance(t, RawTensor) and t.shape == (2,)
