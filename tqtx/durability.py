"""The durability setting: what of the buffer survives which crash.

One setting means one thing for the controller's metadata and the units' rows
(docs/reliability.md, *Durability*):

``memory``
    nothing on disk; any restart starts empty.
``controller`` (default)
    metadata journaled without fsync: a controller crash with live units loses nothing;
    a whole-job crash starts empty.
``buffer``
    every unit also logs the rows it stores (and a tombstone per drop) to segment files in
    its data directory; the controller and the units fsync what they wrote every
    ``flush_interval_s``. A whole-job crash loses nothing that reached the page cache; a
    power loss loses at most the last interval.
``sync``
    as ``buffer``, but a put is acknowledged only once its rows and metadata are fsynced
    (concurrent puts share fsyncs). Nothing acknowledged is ever lost.

The values of earlier releases are still read, with a DeprecationWarning naming the new one.
"""
from __future__ import annotations

import os
import warnings

MEMORY, CONTROLLER, BUFFER, SYNC = "memory", "controller", "buffer", "sync"
DURABILITY = (MEMORY, CONTROLLER, BUFFER, SYNC)
DEFAULT = CONTROLLER
# Settings under which units log their rows.
LOGGED = (BUFFER, SYNC)
FLUSH_INTERVAL_S = 1.0

# Earlier values: "full" fsynced metadata per transaction, which protected only keys whose
# rows a whole-job crash loses anyway; "normal" is "controller"; "off" is "memory".
DEPRECATED = {"full": CONTROLLER, "normal": CONTROLLER, "off": MEMORY}

# The environment a deployment's processes read the setting from.
ENV_DURABILITY = "TQTX_DURABILITY"
ENV_FLUSH_INTERVAL = "TQTX_FLUSH_INTERVAL_S"
ENV_UNIT_DATA_DIR = "TQTX_UNIT_DATA_DIR"


def check(value: str, *, warn: bool = True) -> str:
    """The durability setting ``value`` names (an earlier value mapped to its replacement,
    with a DeprecationWarning when ``warn``); ValueError naming the choices otherwise."""
    if value in DURABILITY:
        return value
    new = DEPRECATED.get(value) if isinstance(value, str) else None
    if new is None:
        raise ValueError(f"durability {value!r}: expected one of {', '.join(DURABILITY)}")
    if warn:
        warnings.warn(f"durability {value!r} is deprecated; use {new!r} (see "
                      f"docs/reliability.md, Durability)", DeprecationWarning, stacklevel=3)
    return new


def check_interval(value) -> float:
    """``flush_interval_s`` as a float above 0 (ValueError naming it otherwise)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"flush_interval_s {value!r}: expected a number of seconds above 0") \
            from None
    if not out > 0 or out != out or out == float("inf"):
        raise ValueError(f"flush_interval_s {value!r}: expected a number of seconds above 0")
    return out


def from_env(environ=None) -> tuple[str, float]:
    """``(durability, flush_interval_s)`` a server process was started with."""
    env = os.environ if environ is None else environ
    return (check(env.get(ENV_DURABILITY) or DEFAULT, warn=False),
            check_interval(env.get(ENV_FLUSH_INTERVAL) or FLUSH_INTERVAL_S))


def unit_dir(base: str | os.PathLike, unit_id: int) -> str:
    """Unit ``unit_id``'s data directory under ``base`` (the deployment's unit data dir)."""
    return os.path.join(os.fspath(base), f"unit-{int(unit_id)}")
