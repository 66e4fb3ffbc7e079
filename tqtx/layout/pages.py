"""Huge pages for large fresh memory: a unit's read regions and a client's get results.

Fresh anonymous memory costs a page fault and a zeroing per page on first touch. With 2 MiB
pages (transparent huge pages, asked for with ``MADV_HUGEPAGE``) one fault makes what 512
faults of 4 KiB pages make: on the reference machine, reading 64 MiB from tmpfs into fresh
memory took 17.5 ms that way against 34.5 ms with 4 KiB pages (16 ms into a reused
buffer), and a get of 64 KiB rows into results of huge pages ran 1.4-1.9x faster.

Not on a virtual machine that hands freed memory back to its host (virtio-balloon free
page reporting): there a huge page made of a block freed more than a moment ago is
faulted in from the host again, and on the reference machine (a Firecracker VM) first
touching 256 MiB of huge pages took 295-690 ms three seconds after the last free against
27-39 ms right after it, and 141-167 ms with 4 KiB pages either way. A restore three
seconds after a clear took 191-331 ms with huge pages against 155-171 ms without, a get
of 256 MiB three seconds after the last 76-257 ms against 70-105 ms: fast only in loops
that free and reuse at once, as benchmarks do. So by default (``TQTX_HUGE_PAGES`` unset
or ``auto``) tqtx asks for huge pages unless a balloon device offers free page reporting;
``on`` asks for them anyway, ``off`` never. The kernel ignores the advice where
transparent huge pages are off (``/sys/kernel/mm/transparent_hugepage/enabled`` =
``never``). Read in each process: the units take the setting from the environment they
start with. Torch-free, stdlib only.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os

from . import libc
from .switches import switched_off, switched_on

HUGE_PAGE = 2 << 20
# A batch of reads of at least fsutil.FRESH_MIN bytes each goes into one shared region
# once they add up to this (see fresh_region); a get's result buffer of at least
# RESULT_MIN bytes is advised (see advise_huge), which holds at least one whole huge page.
REGION_MIN = HUGE_PAGE
RESULT_MIN = 2 * HUGE_PAGE
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


_libc_madvise = libc.function("madvise", ctypes.c_int,
                              [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]) \
    if _MADV_HUGEPAGE is not None else None


VIRTIO_BALLOON = "/sys/bus/virtio/drivers/virtio_balloon"
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING: the guest reports free pages to the host


def wanted() -> bool:
    """Whether tqtx asks for huge pages: ``TQTX_HUGE_PAGES`` ``on`` / ``off``, else
    (``auto``) unless freed memory goes back to a hypervisor (the module docstring)."""
    if switched_off("TQTX_HUGE_PAGES"):
        return False
    return switched_on("TQTX_HUGE_PAGES") or not free_pages_reported()


@functools.lru_cache(maxsize=1)
def free_pages_reported() -> bool:
    """Whether a virtio balloon device of this machine takes free page reports (its
    ``features`` bits, one character each in sysfs, have VIRTIO_BALLOON_F_REPORTING)."""
    try:
        devices = os.listdir(VIRTIO_BALLOON)
    except OSError:
        return False
    for name in devices:
        try:
            with open(os.path.join(VIRTIO_BALLOON, name, "features")) as f:
                bits = f.read().strip()
        except OSError:  # not a device (the driver's own files)
            continue
        if len(bits) > _F_REPORTING and bits[_F_REPORTING] == "1":
            return True
    return False


def fresh_region(size: int) -> memoryview:
    """``size`` bytes of fresh memory for a batch of reads to fill, one slice each: one
    anonymous mapping the kernel may back with huge pages. The slices share it: it goes back
    to the OS when the last view of it goes (a unit copies live rows out of a mostly dead
    one, see :class:`tqtx.storage.rows.SharedViews`)."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _MADV_HUGEPAGE is not None and wanted():
        try:
            region.madvise(_MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages
            pass
    return memoryview(region)


def advise_huge(address: int, nbytes: int) -> bool:
    """Ask for huge pages under the whole 2 MiB pages of ``nbytes`` of not yet touched
    memory at ``address`` (another allocator's, e.g. torch's: only the pages' kind changes,
    never their owner or contents). Whether the kernel took the advice."""
    start = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (address + nbytes) & ~(HUGE_PAGE - 1)
    if end <= start or _libc_madvise is None or not wanted():
        return False
    return _libc_madvise(start, end - start, _MADV_HUGEPAGE) == 0
