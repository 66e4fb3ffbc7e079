"""verl 0.9.1's own code on tqtx. The package must be installed (`.ci/run` installs
``verl==0.9.1`` without its dependencies, plus the ``verl-test`` extra); these tests are
skipped where it is not.

``import transfer_queue`` resolves to tqtx through the shim (``tqtx shim install``), put in a
temporary directory at the front of ``sys.path`` before verl is first imported (verl binds
a stand-in of its own when ``import transfer_queue`` fails), and on the ``PYTHONPATH`` of
every process the tests start (``verl_rig.process_pythonpath``).
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent
VERL = importlib.util.find_spec("verl") is not None
SHIM_DIR = tempfile.mkdtemp(prefix="tqtx-verl-shim-")

if VERL:
    from tqtx.compat import shim
    shim.install(SHIM_DIR)
    sys.path.insert(0, SHIM_DIR)
    sys.path.insert(0, str(HERE))


def pytest_collection_modifyitems(items):
    for item in items:  # every test here starts real processes and imports verl: slow
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.slow)
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group("verl"))


def pytest_sessionfinish(session, exitstatus):
    import shutil
    shutil.rmtree(SHIM_DIR, ignore_errors=True)
