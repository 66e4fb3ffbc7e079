"""The public names of ``import tqtx as tq``, listed once: the package face
(``tqtx/__init__.py``) serves them lazily, :mod:`tqtx.api` defines the calls and the
types, :mod:`tqtx.errors` the errors. Imports nothing (the face loads it without torch)."""
from __future__ import annotations

# TransferQueue's module-level KV and checkpoint calls and tqtx's own (tqtx.api)
CALLS = (
    "init", "close", "kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list",
    "kv_clear", "save_checkpoint", "load_checkpoint", "dump_data_by_key", "load_data_by_key",
    "read_row_index", "recover_data_load", "list_restores", "get_client",
    "get_metrics_endpoint", "list_lost_keys",
)
# the calls that do I/O, each with an ``async_`` twin in tqtx.api
ASYNC_CALLS = tuple(f"async_{name}" for name in (
    "kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list", "kv_clear",
    "save_checkpoint", "load_checkpoint", "dump_data_by_key", "load_data_by_key",
    "recover_data_load",
))
# the types the calls return, served by tqtx.api
TYPES = ("KVBatchMeta", "DumpHandle", "BatchMeta")
# the errors a user may catch (tqtx.errors)
ERRORS = (
    "KeysNotFoundError", "RestorePendingError", "PeerTimeoutError", "PeerDiedError",
    "DumpFormatError", "StateDirInUseError", "TqtxError", "RemoteError",
    "TargetNotADumpError", "ReadOnlyDumpError", "DumpNotFoundError",
    "FieldsNotFoundError", "PartitionNotFoundError", "SchemaConflictError",
    "RowsLostError", "StaleRowsError", "PutPartlyAppliedError", "JournalWriteError",
    "NotInitializedError", "CheckpointBusyError",
)
