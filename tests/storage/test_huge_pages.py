"""Large fresh memory asks for huge pages: a unit's read regions and a client's get result
buffers carry the kernel's huge-page advice (``hg`` in the mapping's VmFlags) where the
kernel has transparent huge pages, unless ``TQTX_HUGE_PAGES=off``, or, by default, the
machine hands freed memory back to its hypervisor (virtio-balloon free page reporting)."""
from __future__ import annotations

import os

import pytest

from tqtx.client import tensors
from tqtx.layout import pages

# the kernel takes MADV_HUGEPAGE only where it has transparent huge pages
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _address(view: memoryview) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_read_region_is_advised_huge(monkeypatch):
    monkeypatch.setenv("TQTX_HUGE_PAGES", "on")
    view = pages.fresh_region(pages.REGION_MIN * 3)
    assert view.nbytes == pages.REGION_MIN * 3 and not view.readonly
    assert bytes(view[:16]) == bytes(16)  # fresh: zeros
    view[-3:] = b"abc"
    assert bytes(view[-3:]) == b"abc"
    assert ("hg" in _vm_flags(_address(view))) == THP


def test_a_large_result_buffer_is_advised_huge_and_a_small_one_is_not(monkeypatch):
    monkeypatch.setenv("TQTX_HUGE_PAGES", "yes")
    big, address, view = tensors.result_buffer(pages.RESULT_MIN + 12345)
    middle = (address + pages.RESULT_MIN // 2) & ~(pages.HUGE_PAGE - 1)
    assert ("hg" in _vm_flags(middle)) == THP
    view[:] = 7  # still an ordinary tensor of the caller's
    assert int(big.sum()) == 7 * (pages.RESULT_MIN + 12345)
    small, address, _ = tensors.result_buffer(pages.RESULT_MIN - 1)
    assert not pages.advise_huge(address, pages.HUGE_PAGE - 1)  # holds no whole huge page


@pytest.mark.parametrize("value", ["off", "0", "false", "no", " OFF "])
def test_tqtx_huge_pages_off_asks_for_none(monkeypatch, value):
    monkeypatch.setenv("TQTX_HUGE_PAGES", value)
    view = pages.fresh_region(pages.REGION_MIN * 2)
    assert "hg" not in _vm_flags(_address(view))
    _, address, _ = tensors.result_buffer(pages.RESULT_MIN * 2)
    assert not pages.advise_huge(address, pages.RESULT_MIN * 2)


def _balloon(root, features: str | None) -> None:
    """A fake sysfs virtio_balloon driver directory: its own files and one device."""
    root.mkdir()
    (root / "uevent").write_text("DRIVER=virtio_balloon\n")
    if features is not None:
        (root / "virtio0").mkdir()
        (root / "virtio0" / "features").write_text(features + "\n")


@pytest.mark.parametrize("features,reported", [
    ("0110010100000000" + "0" * 48, True),    # VIRTIO_BALLOON_F_REPORTING (bit 5) offered
    ("0110000100000000" + "0" * 48, False),   # a balloon without free page reporting
    (None, False),                            # the driver, no device
])
def test_by_default_huge_pages_follow_free_page_reporting(monkeypatch, tmp_path, features,
                                                          reported):
    """Where freed memory goes back to the hypervisor, a huge page made after a pause is
    faulted in from the host (10-20x slower than right after a free on the reference
    machine): by default tqtx then asks for none; ``on`` still does."""
    root = tmp_path / "virtio_balloon"
    _balloon(root, features)
    monkeypatch.setattr(pages, "VIRTIO_BALLOON", str(root))
    pages.free_pages_reported.cache_clear()
    try:
        assert pages.free_pages_reported() is reported
        for value in (None, "auto", ""):
            if value is None:
                monkeypatch.delenv("TQTX_HUGE_PAGES", raising=False)
            else:
                monkeypatch.setenv("TQTX_HUGE_PAGES", value)
            assert pages.wanted() is not reported
            view = pages.fresh_region(pages.REGION_MIN * 2)
            assert ("hg" in _vm_flags(_address(view))) == (THP and not reported)
        monkeypatch.setenv("TQTX_HUGE_PAGES", "on")
        assert pages.wanted()
    finally:
        pages.free_pages_reported.cache_clear()


def test_no_balloon_driver_reports_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(pages, "VIRTIO_BALLOON", str(tmp_path / "absent"))
    pages.free_pages_reported.cache_clear()
    try:
        assert not pages.free_pages_reported()
    finally:
        pages.free_pages_reported.cache_clear()
