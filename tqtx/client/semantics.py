"""Which results this process's KV calls give: TransferQueue 0.1.11's (the default) or
tqtx's strict ones (opt-in, docs/compatibility.md).

Default, as TransferQueue's ``kv_batch_get``: unknown keys are left out (logged), no key
found at all is a ValueError; a field in ``select_fields`` that not every key has is left
out; keys that share no produced field are a ValueError ("Some fields are not ready");
fields come back in name order, tensor fields of one or more dimensions as jagged nested
tensors even when their shapes agree, 0-d rows as one dense tensor, other values as
``NonTensorStack``; a field that got tensor values in one put may take non-tensor values
in another (and the reverse).

Strict (``tq.init({"strict": True})``, or ``$TQTX_STRICT=1`` for a process whose init does
not say): unknown keys are a KeysNotFoundError, fields not produced for every key a
FieldsNotFoundError, tensor fields come back dense when their rows agree in shape, and a
field keeps the kind (tensor or not) of its first put (SchemaConflictError).

The mode shapes results and checks only; what is stored, the files and the wire are the
same in both. Rows that were lost raise RowsLostError in both.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("tqtx.api")

STRICT_ENV = "TQTX_STRICT"
COMPAT_MODES = {"tqtx": True, "transferqueue": False}  # init's older "compat" key
NOT_READY = "Some fields are not ready in all the requested keys!"

_configured: bool | None = None  # init's "strict"; None: $TQTX_STRICT decides


def configure(strict=None, compat=None) -> None:
    """Set this process's mode from init's ``strict`` (a bool) and ``compat`` keys."""
    global _configured
    if compat is not None and compat not in COMPAT_MODES:
        raise ValueError(f"compat must be one of {sorted(COMPAT_MODES)}, got {compat!r}")
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if strict is not None and compat is not None and COMPAT_MODES[compat] != strict:
        raise ValueError(f"strict={strict} contradicts compat={compat!r}")
    _configured = strict if strict is not None else COMPAT_MODES.get(compat)


def reset() -> None:
    global _configured
    _configured = None


def strict() -> bool:
    """Whether this process's calls are strict (see the module docstring)."""
    if _configured is not None:
        return _configured
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def mark_mixable(schemas: dict) -> dict:
    """A put's field schemas as the default mode sends them: a field may change kind."""
    if strict():
        return schemas
    return {f: {**s, "mixable": True} for f, s in schemas.items()}


def get(client, keys: list[str], pid: str, select: list[str] | None):
    """``kv_batch_get`` with TransferQueue's results (the module docstring)."""
    from . import tensors
    from ..errors import FieldsNotFoundError
    found, columns, schemas = client.get_rows(keys, pid, select, lenient=True, direct=True,
                                              alloc=tensors.result_buffer)
    try:
        if len(found) != len(keys):
            missing = sorted(set(keys) - set(found))
            log.warning("kv_batch_get: keys %s were not found in partition %r; they are "
                        "left out", missing[:20], pid)
        if not columns:
            shares_none = select is None or not client.call_controller(
                "LOOKUP", {"partition_id": pid, "keys": found, "select_fields": None,
                           "lenient": True}, what=f"looking up {len(found)} key(s)")["fields"]
            if shares_none:
                asked = f" (select_fields {select})" if select is not None else ""
                raise FieldsNotFoundError(
                    f"{NOT_READY} The keys share no produced field in partition "
                    f"{pid!r}{asked}: {found[:10]}")
            return tensors.TensorDict({}, batch_size=[0])  # TransferQueue: no field, no rows
        return _assemble(columns, schemas, len(found))
    finally:
        tensors.close_files_later(client.reply_files(columns))


def get_strict(client, keys: list[str], pid: str, select: list[str] | None):
    """``kv_batch_get`` in strict mode: every key must exist and have every selected field
    (KeysNotFoundError, FieldsNotFoundError); uniform tensor fields come back dense."""
    from . import tensors
    _, columns, schemas = client.get_rows(keys, pid, select, direct=True,
                                          alloc=tensors.result_buffer)
    try:
        return tensors.tensordict_from_columns(columns, schemas, len(keys))
    finally:
        tensors.close_files_later(client.reply_files(columns))


def read(client, keys: list[str], pid: str, fields: list[str]):
    """The rows of ``keys`` (every one must exist and have every field of ``fields``) with
    TransferQueue's result shapes: what its client's ``get_data`` returns."""
    from . import tensors
    _, columns, schemas = client.get_rows(keys, pid, sorted(fields), direct=True,
                                          alloc=tensors.result_buffer)
    try:
        return _assemble(columns, schemas, len(keys))
    finally:
        tensors.close_files_later(client.reply_files(columns))


def _assemble(columns: dict, schemas: dict, n: int):
    from . import tensors
    ordered = {f: columns[f] for f in sorted(columns)}
    return tensors.tensordict_from_columns(ordered, schemas, n, layout="transferqueue")
