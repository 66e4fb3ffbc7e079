"""The C library, loaded once, for the few calls Python has no binding of: copies between
processes (``process_vm_readv`` / ``writev``), ``madvise`` of another allocator's memory,
malloc's trim and statistics. Torch-free, stdlib only."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=None)
def load():
    """The C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def function(name: str, restype, argtypes: list):
    """The C library's function ``name`` with its types set, or None where the library or
    the function is missing."""
    lib = load()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None:
        fn.restype, fn.argtypes = restype, argtypes
    return fn
