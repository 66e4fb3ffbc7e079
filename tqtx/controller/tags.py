"""Tags held by the controller's metadata, shared by the keys with equal tags.

A put of 10k keys with one tag value sends 10k equal dicts; kept apart they cost about
0.2 KiB a key, most of what the metadata holds per key. Tag dicts held by the metadata are
never changed in place (a change stores a new dict), so keys may share one.
"""
from __future__ import annotations

from math import copysign

# The tag of every key stored without one.
NO_TAG: dict = {}
_ATOMS = (str, int, bool, type(None), bytes)


def tag_form(tag: dict):
    """A hashable form of ``tag``, equal for tags that are equal with the same value types
    (``1``, ``True`` and ``1.0`` differ, so do ``0.0`` and ``-0.0``); None when a name is
    not a str or a value not a str, int, bool, float, bytes or None (not shared)."""
    form = []
    for k, v in tag.items():
        t = type(v)
        if type(k) is not str:
            return None
        if t is float:
            form.append((k, t, v, copysign(1.0, v)))
        elif t in _ATOMS:
            form.append((k, t, v))
        else:
            return None
    return tuple(form)


def merge_tag(old: dict | None, new: dict | None, memo: dict) -> dict:
    """``{**old, **new}`` as a new dict, or ``old`` when ``new`` is empty; equal merges
    within one request (``memo``, kept for the request) give one shared dict. ``old`` must
    stay alive while ``memo`` does (it is keyed by identity)."""
    if not new:
        return old or NO_TAG
    form = tag_form(new)
    if form is None:
        return {**(old or NO_TAG), **new}
    key = (id(old), form)
    out = memo.get(key)
    if out is None:
        out = memo[key] = {**(old or NO_TAG), **new}
    return out
