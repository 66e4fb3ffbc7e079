"""Copy byte buffers between this process and another one on the same host (Linux
``process_vm_writev`` / ``process_vm_readv``): a unit writes a same-host get's rows into
the client's result and reads a same-host put's rows out of the client's tensors (see
:mod:`tqtx.wire.shm`).

One system call moves up to ``IOV_MAX`` (:mod:`tqtx.layout.fsutil`) buffers, each to or from
its own address, straight from or into the buffers' memory: no staging copy, and the kernel
faults fresh pages in as it copies. The kernel allows it when the caller may ptrace the
other process (same user, and Yama's ``ptrace_scope`` or a seccomp profile may still
refuse: :func:`write` and :func:`read` then raise ``PermissionError``).
"""
from __future__ import annotations

import ctypes
import os
from array import array

from ..layout.fsutil import IOV_MAX
from ..layout import libc
from ..layout.switches import switched_off


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


def _copy_call(name: str):
    return libc.function(name, ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                                 ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong])


# One array type for every call: ctypes caches a new type per length asked for, and a unit
# that made one while it held rows would keep the memory around it after a clear
# (docs/performance.md, *Unit memory*).
_Views = _PyBuffer * IOV_MAX

_WRITEV = _copy_call("process_vm_writev")
_READV = _copy_call("process_vm_readv")
_PyBUF_SIMPLE, _PyBUF_WRITABLE = 0, 1
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def available() -> bool:
    """Whether this platform has ``process_vm_writev`` and ``process_vm_readv`` (and
    64-bit iovecs)."""
    return None not in (_WRITEV, _READV) and ctypes.sizeof(ctypes.c_void_p) == 8


def refusal(env: str, units_may: str) -> str | None:
    """Why units may not ``units_may`` (e.g. "write into") this process on this host, or
    None: ``env`` (e.g. ``TQTX_GET_INTO``) set off, no ``process_vm_writev`` /
    ``process_vm_readv`` here, or Yama restricting ptrace (:func:`ptrace_restricted`)."""
    if switched_off(env):
        return f"{env} is off"
    if not available():
        return "no process_vm_writev / process_vm_readv on this platform"
    if ptrace_restricted():
        return f"Yama's ptrace_scope keeps units from {units_may} this process"
    return None


def ptrace_restricted() -> bool:
    """True if Yama limits ptrace to a process's descendants or further (``ptrace_scope``
    >= 1): units, which a client starts or finds, then may not write into it."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0) >= 1
    except (OSError, ValueError):
        return False


def write(pid: int, address: int, rows: list) -> None:
    """Copy each ``(offset, buffer)`` of ``rows`` (contiguous byte buffers) to ``address +
    offset`` in process ``pid``. OSError (PermissionError when refused) if the kernel does
    not move every byte."""
    for i in range(0, len(rows), IOV_MAX):
        _move(_WRITEV, _PyBUF_SIMPLE, pid, address, rows[i:i + IOV_MAX])


def read(pid: int, rows: list) -> None:
    """Fill each ``(address, buffer)`` of ``rows`` (writable contiguous byte buffers) with
    as many bytes from ``address`` in process ``pid``. OSError (PermissionError when
    refused, EFAULT for an address that is not mapped there) if the kernel does not move
    every byte."""
    for i in range(0, len(rows), IOV_MAX):
        _move(_READV, _PyBUF_WRITABLE, pid, 0, rows[i:i + IOV_MAX])


def addresses(buffers: list) -> array:
    """The address of each of ``buffers`` (contiguous byte buffers) in this process, as
    unsigned 64-bit words: where a unit that shares the host reads them (:func:`read`)."""
    out = array("Q", bytes(8 * len(buffers)))
    view, get, release = _PyBuffer(), _get_buffer, _release_buffer
    for i, buf in enumerate(buffers):
        get(buf, view, _PyBUF_SIMPLE)
        out[i] = view.buf or 0
        release(view)
    return out


def _move(fn, flags: int, pid: int, address: int, rows: list) -> None:
    """One ``process_vm_writev`` / ``process_vm_readv`` (``fn``) of up to IOV_MAX ``(offset
    or address, local buffer)`` pairs: the remote side of a pair is ``address`` + its first
    item."""
    k = len(rows)
    views = _Views()
    # iovec arrays as (base, length) pairs of 64-bit words: no ctypes field access per row
    local, remote = array("Q", bytes(16 * k)), array("Q", bytes(16 * k))
    held = total = 0
    get = _get_buffer
    try:
        for i, (at, buf) in enumerate(rows):
            view = views[i]
            get(buf, view, flags)  # contiguous bytes, held until the call is done
            held += 1
            n = view.len
            j = 2 * i
            local[j], local[j + 1] = view.buf, n
            remote[j], remote[j + 1] = address + at, n
            total += n
        moved = fn(pid, local.buffer_info()[0], k, remote.buffer_info()[0], k, 0)
        if moved != total:
            err = ctypes.get_errno() if moved < 0 else 0
            what = "process_vm_writev into" if fn is _WRITEV else "process_vm_readv from"
            raise OSError(err, f"{what} pid {pid}: "
                               f"{os.strerror(err) if err else f'{moved} of {total} bytes'}")
    finally:
        for i in range(held):
            _release_buffer(views[i])
