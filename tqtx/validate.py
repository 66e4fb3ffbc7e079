"""Checks on user input made before anything is sent: keys, partition IDs and UTF-8 strings.

A torch-free leaf module (standard library only), so the API, the client and the dump
writer share one set of messages.
"""
from __future__ import annotations


def check_utf8(what: str, values) -> None:
    """ValueError naming the first str of ``values`` that is not valid UTF-8 (a lone
    surrogate such as ``"\\udcff"``, e.g. from ``os.fsdecode`` of a non-UTF-8 file name),
    so it is refused before anything is sent instead of failing inside msgpack."""
    if isinstance(values, str):
        values = (values,)
    try:
        "".join(values).encode("utf-8")  # one pass; surrogates never pair across a join
        return
    except UnicodeEncodeError:
        pass
    for v in values:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what}: {v!r} is not valid UTF-8 ({exc.reason}: "
                             f"{v[exc.start]!r} at position {exc.start})") from None


def check_keys(keys, what: str = "keys") -> list[str]:
    """``keys`` as a list: one str is one key (as in TransferQueue); a non-empty list of
    distinct str otherwise."""
    if isinstance(keys, str):
        keys = [keys]
    keys = list(keys)
    if not keys:
        raise ValueError(f"{what} must not be empty")
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{what} must be str; got {type(bad[0]).__name__} {bad[0]!r}")
    check_utf8(what, keys)
    if len(set(keys)) != len(keys):
        seen, dups = set(), []
        for k in keys:
            if k in seen:
                dups.append(k)
            seen.add(k)
        raise ValueError(f"duplicate keys in one call: {dups[:10]}")
    return keys


def check_partition(pid) -> str:
    """``pid`` if it is a non-empty, valid UTF-8 str; TypeError or ValueError otherwise."""
    if not isinstance(pid, str) or not pid:
        raise TypeError(f"partition_id must be a non-empty str, got {pid!r}")
    check_utf8("partition_id", pid)
    return pid
