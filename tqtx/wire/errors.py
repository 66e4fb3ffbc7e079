"""Errors across the wire: an exception becomes ``{"type", "message", "data"}`` in a reply
(:func:`error_payload`) and is raised again on the caller's side as the matching type
(:func:`raise_remote`); a type it does not know arrives as :class:`~tqtx.errors.RemoteError`.
"""
from __future__ import annotations

from ..errors import (CheckpointBusyError, ControllerRecoveringError, DumpFormatError,
                      DumpNotFoundError,
                      FieldsNotFoundError, JournalWriteError, KeysNotFoundError,
                      PartitionNotFoundError, RemoteError, RestorePendingError, RowsLostError,
                      SchemaConflictError, StaleRowsError)


def error_payload(exc: BaseException) -> dict:
    """The ``{"type", "message", "data"}`` an error reply carries for ``exc``."""
    data = {}
    if isinstance(exc, (RestorePendingError, RowsLostError, StaleRowsError)):
        data = exc.to_dict()
        kind = type(exc).__name__
    elif isinstance(exc, KeysNotFoundError):
        data = {"keys": exc.keys, "partition_id": exc.partition_id}
        kind = "KeysNotFoundError"
    else:
        kind = type(exc).__name__
    if isinstance(exc, (KeysNotFoundError, RowsLostError)):
        message = exc.message
    elif isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        message = exc.args[0]  # str(KeyError) would quote it, and again on the client
    else:
        message = str(exc)
    if isinstance(exc, DumpNotFoundError) and exc.filename is not None:
        data = {"filename": exc.filename}
    elif isinstance(exc, OSError) and exc.errno is not None:
        # the caller gets the same errno, text and path (a full disk names its file)
        data = {"errno": exc.errno, "strerror": exc.strerror,
                "filename": None if exc.filename is None else str(exc.filename)}
    return {"type": kind, "message": message, "data": data}


_BUILTIN = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
            "FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError,
            "PermissionError": PermissionError, "NotADirectoryError": NotADirectoryError,
            "OSError": OSError, "RuntimeError": RuntimeError, "TimeoutError": TimeoutError,
            "CodecError": ValueError, "DumpFormatError": DumpFormatError,
            "FieldsNotFoundError": FieldsNotFoundError,
            "PartitionNotFoundError": PartitionNotFoundError,
            "SchemaConflictError": SchemaConflictError,
            "IllegalTransition": RuntimeError, "InjectedFault": RuntimeError,
            "ControllerRecoveringError": ControllerRecoveringError,
            "JournalWriteError": JournalWriteError, "IsADirectoryError": IsADirectoryError,
            "CheckpointBusyError": CheckpointBusyError}


def raise_remote(err: dict, peer: str):
    """Raise the exception an error reply from ``peer`` describes (``error_payload`` reversed)."""
    kind, message, data = err.get("type"), err.get("message", ""), err.get("data") or {}
    if kind == "RestorePendingError":
        units = {int(k) if str(k).isdigit() else k: v for k, v in (data.get("units") or {}).items()}
        raise RestorePendingError(message, restore_id=data.get("restore_id"),
                                  dump_dir=data.get("dump_dir"), reason=data.get("reason"),
                                  units=units, partition_id=data.get("partition_id"))
    if kind == "KeysNotFoundError":
        raise KeysNotFoundError(data.get("keys", []), data.get("partition_id"))
    if kind == "RowsLostError":
        raise RowsLostError(data.get("keys", []), data.get("partition_id"),
                            fields=data.get("fields"), units=dict(data.get("units") or []))
    if kind == "StaleRowsError":
        raise StaleRowsError(message, data.get("indexes") or ())
    if kind == "DumpNotFoundError":
        raise DumpNotFoundError(message, data.get("filename"))
    cls = _BUILTIN.get(kind)
    if cls is not None and issubclass(cls, OSError) and data.get("errno") is not None:
        args = [data["errno"], data.get("strerror") or message]
        if data.get("filename") is not None:
            args.append(data["filename"])
        raise cls(*args)
    if cls is not None:
        raise cls(message)
    if data.get("errno") is not None:  # another OSError subclass: an OSError still
        raise OSError(data["errno"], f"{peer}: {kind}: {data.get('strerror') or message}",
                      *([data["filename"]] if data.get("filename") is not None else []))
    raise RemoteError(f"{peer}: {kind}: {message}")
