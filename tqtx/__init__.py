"""tqtx: a transactional save/restore engine for RL data buffers.

``import tqtx as tq`` gives TransferQueue's module-level KV and checkpoint API plus
selective dump and transactional restore by key. The API (and torch) is imported
lazily, so controller and storage-unit processes start without torch.
"""
from __future__ import annotations

from . import public
from .version import TRANSFERQUEUE_API_VERSION, __version__

_API = frozenset(public.CALLS + public.ASYNC_CALLS + public.TYPES)
_ERRORS = frozenset(public.ERRORS)

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
