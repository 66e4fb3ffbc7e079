"""Exception types raised by tqtx (importable without torch)."""
from __future__ import annotations


class TqtxError(Exception):
    """Base class for tqtx-specific errors."""


class KeysNotFoundError(KeyError, ValueError, RuntimeError):
    """Some requested keys do not exist in the partition (also a RuntimeError, which
    TransferQueue's dump raises for unknown keys)."""

    def __init__(self, keys, partition_id=None):
        self.keys = list(keys)
        self.partition_id = partition_id
        shown = ", ".join(repr(k) for k in self.keys[:20])
        more = f" (and {len(self.keys) - 20} more)" if len(self.keys) > 20 else ""
        where = f" in partition {partition_id!r}" if partition_id is not None else ""
        self.message = f"keys not found{where}: {shown}{more}"
        super().__init__(self.message)

    def __str__(self):
        return self.message


class RowsLostError(KeyError, TqtxError):
    """Rows of these keys were lost: the unit that held them restarted without them.

    A KeyError. ``kv_list`` leaves the keys out (``tq.list_lost_keys()`` names them, with
    their tags, so they can be produced again); a put of new values, a restore of a dump
    holding them, or ``kv_clear`` settles them.
    Attributes: ``keys``, ``fields`` ({key: [field, ...]}), ``units`` ({key: unit}),
    ``partition_id``.
    """

    def __init__(self, keys, partition_id=None, *, fields=None, units=None):
        self.keys = list(keys)
        self.partition_id = partition_id
        self.fields = {k: list(v) for k, v in (fields or {}).items()}
        self.units = dict(units or {})
        shown = []
        for k in self.keys[:20]:
            where = f" on unit {self.units[k]}" if k in self.units else ""
            fields_of = self.fields.get(k)
            what = f" (fields {', '.join(fields_of)})" if fields_of else ""
            shown.append(f"{k!r}{what}{where}")
        more = f" (and {len(self.keys) - 20} more)" if len(self.keys) > 20 else ""
        where = f" in partition {partition_id!r}" if partition_id is not None else ""
        self.message = (f"rows lost{where}: {', '.join(shown)}{more}: the storage unit that "
                        f"held them restarted without them. Put them again, restore a dump "
                        f"that holds them, or kv_clear them (kv_list leaves them out; "
                        f"tq.list_lost_keys() names them)")
        super().__init__(self.message)

    def __str__(self):
        return self.message

    def to_dict(self) -> dict:
        return {"keys": self.keys, "partition_id": self.partition_id, "fields": self.fields,
                "units": [[k, u] for k, u in self.units.items()]}


class StaleRowsError(TqtxError):
    """A unit holds no row of the generation a request named at some global indexes: the
    key there was cleared, or its index reused by another key, since the controller
    answered (see docs/architecture.md, "The row fence"). The unit serves none of the
    request; the client asks the controller again and retries, so callers never see this.
    ``indexes``: the stale global indexes."""

    def __init__(self, message: str = "", indexes=()):
        self.indexes = list(indexes)
        super().__init__(message or f"stale rows at global indexes {self.indexes[:20]}")

    def to_dict(self) -> dict:
        return {"indexes": self.indexes}


class PutPartlyAppliedError(TqtxError):
    """A put stored some of its keys, then failed for the others (e.g. a restore began in
    the partition while a key the put was creating had to be created again). ``stored``
    and ``failed`` name them; put the failed ones again."""

    def __init__(self, message: str = "", *, stored=(), failed=()):
        super().__init__(message)
        self.stored = list(stored)
        self.failed = list(failed)


class _MessageError(TqtxError):
    """A tqtx error whose ``str`` is its message, unquoted even when it is a KeyError."""

    def __str__(self):
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class FieldsNotFoundError(_MessageError, KeyError, ValueError):
    """``select_fields`` names a field that was not produced for every requested key.

    A ValueError as in TransferQueue; also a KeyError, as tqtx raised before."""


class PartitionNotFoundError(_MessageError, KeyError, RuntimeError):
    """A partition named by a dump request does not exist (a RuntimeError in TransferQueue)."""


class SchemaConflictError(_MessageError, ValueError, RuntimeError):
    """New rows of a field do not match its schema (kind, dtype or number of dimensions).

    A ValueError for puts; also the RuntimeError TransferQueue raises on load."""


class NotInitializedError(TqtxError, RuntimeError):
    """A call that needs a deployment before ``tq.init()`` (a RuntimeError, as in
    TransferQueue)."""


class PeerTimeoutError(TqtxError, TimeoutError):
    """A request got no reply in time; the message names the peer."""


class PeerDiedError(TqtxError, ConnectionError):
    """A controller or storage unit process is gone."""


class ControllerRecoveringError(TqtxError, ConnectionError):
    """The controller just restarted and waits for its units to re-register before it hands
    out new rows (so a unit's report of what it holds cannot race a new put); retry shortly.
    The client does so by itself."""


class RemoteError(TqtxError):
    """An error raised inside a controller or unit that maps to no builtin type."""


class DumpFormatError(TqtxError, ValueError):
    """A dump is corrupt, truncated, of an unknown version or otherwise unreadable."""


class DumpNotFoundError(DumpFormatError, FileNotFoundError):
    """A dump's or checkpoint's directory or one of its files is missing; names the path
    (``filename``). A FileNotFoundError, as TransferQueue raises."""

    def __init__(self, message: str = "", filename=None):
        super().__init__(message)
        if filename is not None:
            self.filename = str(filename)

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class JournalWriteError(TqtxError, OSError):
    """A journal (the controller's ``journal.sqlite``, a dump's ``<dump>.journal.sqlite``)
    could not be written: ``errno`` (ENOSPC for a full disk, EIO, EROFS ...) and
    ``filename`` (the journal's path), as any OSError. Nothing of the failed request was
    recorded; once the cause is gone (space freed) the next request writes again."""


class JournalBusyError(TqtxError, TimeoutError):
    """A journal stayed locked by another process past SQLite's busy timeout (30 s): a
    writer in a long transaction, or a stuck process holding it. The file is not damaged."""


class CheckpointBusyError(TqtxError, RuntimeError):
    """A unit holds as many staged checkpoint loads as it keeps, each of a
    ``load_checkpoint`` still in progress: this load changed nothing. ``load_checkpoint``
    tries again a few times before raising it; a caller may try again later."""


class StateDirInUseError(TqtxError, RuntimeError):
    """Another live controller owns the state directory."""


class TargetNotADumpError(TqtxError, FileExistsError):
    """A dump or checkpoint target path holds something tqtx did not make (a user's
    directory, file or symlink); tqtx refuses to replace it. ``path`` names it."""

    def __init__(self, message: str, *, path=None):
        super().__init__(message)
        self.path = path


class ReadOnlyDumpError(TqtxError, PermissionError):
    """A dump or checkpoint cannot be published at a path on read-only storage."""

    def __init__(self, message: str, *, path=None):
        super().__init__(message)
        self.path = path


class RestorePendingError(RuntimeError):
    """An unresolved restore blocks the requested operation.

    Attributes: ``restore_id``, ``dump_dir``, ``reason`` (e.g. "unit_running",
    "lost_reply", "unknown_restore", "in_progress") and ``units`` ({unit_id: state}).
    """

    def __init__(self, message: str = "", *, restore_id=None, dump_dir=None, reason=None,
                 units=None, partition_id=None):
        self.restore_id = restore_id
        self.dump_dir = dump_dir
        self.reason = reason
        self.units = dict(units or {})
        self.partition_id = partition_id
        if not message:
            message = self.describe()
        super().__init__(message)

    def describe(self) -> str:
        units = ", ".join(f"unit {u}: {s}" for u, s in sorted(self.units.items())) or "none"
        return (f"restore {self.restore_id} of dump {self.dump_dir!r} into partition "
                f"{self.partition_id!r} is unresolved (reason: {self.reason}; units: {units}). "
                f"Settle it with tqtx.recover_data_load({self.dump_dir!r}) once its units have "
                f"reported, or tqtx.recover_data_load({self.dump_dir!r}, cancel=True) to abandon it.")

    def to_dict(self) -> dict:
        return {"restore_id": self.restore_id, "dump_dir": self.dump_dir, "reason": self.reason,
                "units": {str(k): v for k, v in self.units.items()},
                "partition_id": self.partition_id, "message": str(self)}
