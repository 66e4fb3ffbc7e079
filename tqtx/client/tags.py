"""Tags on the wire: a put's tags encoded for it, and tags of a reply decoded back.

A tag is usually a small dict of str names and plain values (a step, a status), given for
thousands of keys at once, often as one object repeated: such a tag is checked in one pass
and encoded once. Anything else goes through :func:`~tqtx.client.tensors.encode_object`,
which converts tensors and names what it refuses.
"""
from __future__ import annotations

from .tensors import NEEDS_DECODING, decode_object, encode_object


def encode_tags(tags: list) -> list:
    """:func:`encode_object` of each tag of a put (None: an empty one). A tag of str names
    and plain values (str, int, float, bool, None, bytes), the usual kind, is checked in
    one pass and copied; a tag object given for several keys is encoded once."""
    done: dict[int, dict] = {}
    out = []
    for tag in tags:
        enc = done.get(id(tag))
        if enc is None:
            enc = _plain_tag(tag)
            if enc is None:
                enc = encode_object(tag or {}, "tag")
            done[id(tag)] = enc
        out.append(enc)
    return out


_PLAIN_VALUES = frozenset({float, bool, type(None), bytes})


def _plain_tag(tag) -> dict | None:
    """A copy of ``tag`` if it is a dict of str names and plain values that msgpack
    stores as they are (valid UTF-8, ints of 64 bits); None otherwise, for
    :func:`encode_object` to convert or to name what it refuses."""
    if type(tag) is not dict:
        return None
    strs = []
    for k, v in tag.items():
        t = type(v)
        if type(k) is not str:
            return None
        strs.append(k)
        if t is str:
            strs.append(v)
        elif t is int:
            if not -(1 << 63) <= v < (1 << 64):
                return None
        elif t not in _PLAIN_VALUES:
            return None
    try:
        "".join(strs).encode("utf-8")
    except UnicodeEncodeError:
        return None
    return dict(tag)


def decode_tag(tag: dict) -> dict:
    """:func:`decode_object` of a tag decoded from a message (so the caller's own): the
    dict itself when no value needs decoding (no tensor, list or dict), which a listing
    of a million keys' tags mostly holds."""
    if type(tag) is not dict:
        return decode_object(tag)
    for v in tag.values():
        if isinstance(v, NEEDS_DECODING):
            return decode_object(tag)
    return tag
