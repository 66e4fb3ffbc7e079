"""Checks on the arguments of the public API, made before anything is sent or written.

:data:`ARGUMENTS` is the table: for every function of the module API (:mod:`tqtx.api`), what
each argument accepts. :func:`check_call`, one line at the top of each function, refuses
anything else with a ``TypeError`` (wrong type) or a ``ValueError`` (right type, wrong value)
whose message names the function, the argument, what it got and what it accepts. Where
TransferQueue 0.1.11 accepts a shape it is accepted exactly (``keys``: one str or a list of
str; ``select_fields``: a str or a list of str; ``conf``: a dict or a DictConfig); anything
else is refused (docs/compatibility.md, *Arguments*). The keys of ``tq.init``'s config are
checked with the same kinds (:mod:`tqtx.arguments.kinds`) in :mod:`tqtx.deploy.initconfig`.

Torch-free (standard library and :mod:`tqtx.arguments.kinds` only).
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping

from .kinds import (Address, Choice, Config, Dict, Fields, Flag, JsonDict, Keys, Kind, Maybe, Meta,
                    Parser, PathArg, Tags, Text, is_tensordict, shown)


# --------------------------------------------------------------------------- the table
PARTITION = Text("a non-blank str")
KEY = Text("a str", blank=True)
BATCH_KEYS = Keys("a str or a non-empty list of distinct str")
ANY_KEYS = Keys("a str or a non-empty list of str", distinct=False)
DUMP_KEYS = Keys("a list (or tuple, or set) of str", one=False, empty=True, distinct=False,
                 containers=(list, tuple, set, frozenset))
FIELD_NAMES = Keys("a str or a list of str", empty=True, distinct=False,
                   containers=(list, tuple))
PATH = PathArg()
FLAG = Flag()
VIA = Choice("units", "client")


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type where TransferQueue raises ValueError: both, so an
    ``except ValueError`` written for TransferQueue still catches it."""


ARGUMENTS: dict[str, dict[str, Kind]] = {
    "init": {"conf": Maybe(Config()), "address": Maybe(Address()), "config": Maybe(Config())},
    "close": {"cancel_dumps": FLAG, "keep_buffer": FLAG},
    "get_metrics_endpoint": {},
    "get_client": {},
    "kv_put": {"key": KEY, "partition_id": PARTITION,
               "fields": Maybe(Fields("a dict or a TensorDict", ArgumentTypeError)),
               "tag": Maybe(Dict()), "data_parser": Parser()},
    "kv_batch_put": {"keys": BATCH_KEYS, "partition_id": PARTITION,
                     "fields": Maybe(Fields("a TensorDict or a dict of batched columns")),
                     "tags": Maybe(Tags()), "data_parser": Parser()},
    "kv_batch_get": {"keys": BATCH_KEYS, "partition_id": PARTITION,
                     "select_fields": Maybe(FIELD_NAMES)},
    "kv_batch_get_by_meta": {"meta": Meta(), "select_fields": Maybe(FIELD_NAMES)},
    "kv_list": {"partition_id": Maybe(PARTITION)},
    "kv_clear": {"keys": ANY_KEYS, "partition_id": PARTITION},
    "save_checkpoint": {"checkpoint_dir": PATH, "include_storage": FLAG,
                        "metadata": Maybe(JsonDict())},
    "load_checkpoint": {"checkpoint_dir": PATH},
    "dump_data_by_key": {"dump_dir": PATH, "keys": DUMP_KEYS, "partition_id": PARTITION,
                         "via": VIA, "block": FLAG},
    "load_data_by_key": {"dump_dir": PATH, "partition_id": Maybe(PARTITION), "via": VIA},
    "recover_data_load": {"dump_dir": PATH, "cancel": FLAG},
    "list_restores": {"partition_id": Maybe(PARTITION)},
    "list_lost_keys": {"partition_id": Maybe(PARTITION)},
    "read_row_index": {"dump_dir": PATH},
}


def _one_sample(where: str, args: dict) -> None:
    """kv_put: a TensorDict is one sample (batch size [] or [1])."""
    fields = args["fields"]
    if is_tensordict(fields) and tuple(fields.batch_size) not in ((), (1,)):
        raise ValueError(f"{where}: fields must be one sample (kv_put takes one sample; "
                         f"use kv_batch_put for a batch); got a TensorDict of batch size "
                         f"{list(fields.batch_size)}")


def _column_problem(value, n: int) -> str | None:
    """Why one value of kv_batch_put's dict of columns is not a column of ``n`` rows."""
    if getattr(value, "is_nested", False):  # a jagged tensor has no shape, only rows
        return None if value.size(0) == n else f"a nested tensor of {value.size(0)} rows"
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (str, bytes)):
        return None if len(shape) >= 1 and shape[0] == n else f"shape {list(shape)}"
    if isinstance(value, (list, tuple)):
        return None if len(value) == n else f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        return "a nested dict (flatten it, or pass a TensorDict)"
    if isinstance(value, numbers.Number):
        return f"one {type(value).__name__} (a column holds one value per key)"
    return None  # a str, bytes, None or object: one value for every row (tensordict's rule)


def _batch_per_key(where: str, args: dict) -> None:
    """kv_batch_put: the fields hold one row per key, the tags one tag per key."""
    keys, fields, tags = args["keys"], args["fields"], args["tags"]
    n = 1 if isinstance(keys, str) else len(keys)
    if is_tensordict(fields) and tuple(fields.batch_size)[:1] != (n,):
        raise ValueError(f"{where}: fields must be a batch of {n} rows (one per key); got "
                         f"a TensorDict of batch size {list(fields.batch_size)}")
    if isinstance(fields, Mapping) and not is_tensordict(fields):  # its batch_size says it
        for name, value in fields.items():
            why = _column_problem(value, n)
            if why:
                raise ValueError(f"{where}: fields must be columns of {n} rows (one per key); "
                                 f"got {why} for field {name!r}")
    if tags is not None and len(tags) != n:
        raise ValueError(f"{where}: tags must be one per key ({n}); got {len(tags)} tags")


# Checks that relate arguments to each other, run once each argument passed on its own.
RELATIONS = {"kv_put": (_one_sample,), "kv_batch_put": (_batch_per_key,)}


def check_call(function: str, args: dict) -> None:
    """Check the arguments ``args`` (the function's ``locals()`` at its first line) of API
    function ``function`` against :data:`ARGUMENTS` and :data:`RELATIONS`; raise on the
    first refused one."""
    where = f"{function}()"
    for name, kind in ARGUMENTS[function].items():
        kind.check(where, name, args[name])
    for relation in RELATIONS.get(function, ()):
        relation(where, args)


# --------------------------------------------------------------------------- files
def check_snapshot_names(snapshot, source: str) -> None:
    """A metadata snapshot read from a file (a checkpoint's ``controller.msgpack``) names
    its partitions and keys with str, as every path that creates them does: else
    DumpFormatError naming ``source`` and the first that is not (a checkpoint written by a
    tqtx that let ``load_data_by_key(partition_id=5)`` through)."""
    from ..errors import DumpFormatError
    parts = snapshot.get("partitions") if isinstance(snapshot, Mapping) else None
    if not isinstance(parts, Mapping):
        raise DumpFormatError(f"{source}: no partitions map in the metadata")
    for pid, data in parts.items():
        if PARTITION.refuse_quietly(pid):
            raise DumpFormatError(f"{source}: partition id {shown(pid)} is not a non-blank "
                                  f"str; this tqtx keeps partition ids as str only")
        rows = data.get("rows") if isinstance(data, Mapping) else None
        keys = [row[0] if isinstance(row, list) and row else None
                for row in (rows if isinstance(rows, list) else ())]
        try:
            "".join(keys)  # one C-level pass: join takes only str
        except TypeError:
            key = next(k for k in keys if not isinstance(k, str))
            raise DumpFormatError(f"{source}: partition {pid!r}: key {shown(key)} is not "
                                  f"a str; this tqtx keeps keys as str only") from None


# --------------------------------------------------------------------------- helpers
def as_key_list(keys) -> list[str]:
    """Checked ``keys`` as a list: one str is one key."""
    return [keys] if isinstance(keys, str) else list(keys)


def check_keys(where: str, keys, kind: Keys = BATCH_KEYS) -> list[str]:
    """``keys`` checked against ``kind`` (TypeError or ValueError naming ``where``), as a
    list: one str is one key (as in TransferQueue)."""
    kind.check(where, "keys", keys)
    return as_key_list(keys)


def check_partition(pid) -> str:
    """``pid`` if it is a non-blank, valid UTF-8 str; TypeError or ValueError otherwise."""
    PARTITION.check("tqtx", "partition_id", pid)
    return pid
