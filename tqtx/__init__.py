"""tqtx: a transactional save/restore engine for RL data buffers.

``import tqtx as tq`` gives TransferQueue's module-level KV and checkpoint API plus
selective dump and transactional restore by key. The API (and torch) is imported
lazily, so controller and storage-unit processes start without torch.
"""
from __future__ import annotations

from .version import TRANSFERQUEUE_API_VERSION, __version__

_API = {
    "init", "close", "kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list",
    "kv_clear", "save_checkpoint", "load_checkpoint", "dump_data_by_key", "load_data_by_key",
    "read_row_index", "recover_data_load", "list_restores", "get_client", "KVBatchMeta",
    "DumpHandle", "get_metrics_endpoint", "list_lost_keys", "BatchMeta",
    "async_kv_put", "async_kv_batch_put", "async_kv_batch_get", "async_kv_batch_get_by_meta",
    "async_kv_list", "async_kv_clear", "async_save_checkpoint", "async_load_checkpoint",
    "async_dump_data_by_key", "async_load_data_by_key", "async_recover_data_load",
}
_ERRORS = {"KeysNotFoundError", "RestorePendingError", "PeerTimeoutError", "PeerDiedError",
           "DumpFormatError", "StateDirInUseError", "TqtxError", "RemoteError",
           "TargetNotADumpError", "ReadOnlyDumpError", "DumpNotFoundError",
           "FieldsNotFoundError", "PartitionNotFoundError", "SchemaConflictError",
           "RowsLostError", "StaleRowsError", "PutPartlyAppliedError", "JournalWriteError",
           "NotInitializedError"}

__all__ = sorted(_API | _ERRORS) + ["__version__", "TRANSFERQUEUE_API_VERSION"]


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    if name in _ERRORS:
        from . import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'tqtx' has no attribute {name!r}")


def __dir__():
    return __all__
