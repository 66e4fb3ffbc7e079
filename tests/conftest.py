"""Shared fixtures: real deployments (controller + units as child processes)."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid

import pytest

os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")


def _compile_tqtx() -> None:
    """The suite starts servers thousands of times, each importing tqtx from its sources.
    Where bytecode is not written (PYTHONDONTWRITEBYTECODE, set by many CI and container
    images) each start would compile them again, about 0.1 s of CPU a process: compile
    them once (into the gitignored __pycache__ dirs; a stale file is never used, Python
    checks each against its source)."""
    import sys
    if sys.dont_write_bytecode:
        import compileall
        import tqtx
        compileall.compile_dir(os.path.dirname(tqtx.__file__), quiet=1)


_compile_tqtx()

# No test may use the user's default state dir (~/.local/state/tqtx/default): every bare
# tq.init() of this run, in this process and in the processes it starts, shares one
# temporary state dir instead, removed at the end of the session. Each xdist worker makes
# its own (it inherits the dir the main process made, marked by _TQTX_TEST_STATE_DIR):
# two workers' bare inits on one state dir would refuse each other.
_OWN_STATE_DIR = None
if not os.environ.get("TQTX_STATE_DIR") or \
        os.environ.get("_TQTX_TEST_STATE_DIR") == os.environ["TQTX_STATE_DIR"]:
    _OWN_STATE_DIR = tempfile.mkdtemp(prefix="tqtx-test-state-")
    os.environ["TQTX_STATE_DIR"] = os.environ["_TQTX_TEST_STATE_DIR"] = _OWN_STATE_DIR


def pytest_sessionfinish(session, exitstatus):
    if _OWN_STATE_DIR is not None:
        shutil.rmtree(_OWN_STATE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _strict_mode(request, monkeypatch):
    """Tests marked ``strict`` assert tqtx's opt-in strict mode (docs/compatibility.md):
    they run with ``TQTX_STRICT=1``, as do the processes they start; every other test runs
    with the default, TransferQueue's semantics."""
    if request.node.get_closest_marker("strict") is not None:
        monkeypatch.setenv("TQTX_STRICT", "1")
    else:
        monkeypatch.delenv("TQTX_STRICT", raising=False)


@pytest.fixture
def tq_start(tmp_path):
    """``start(num_units=2, **config)`` (re)starts this process's embedded deployment.

    Each start gets a fresh state dir unless ``state_dir`` is given; the deployment
    is closed at the end of the test.
    """
    import tqtx as tq

    counter = {"n": 0}

    def start(num_units: int = 2, **config):
        tq.close()
        counter["n"] += 1
        config.setdefault("state_dir", str(tmp_path / f"state{counter['n']}"))
        return tq.init({"num_units": num_units, **config})

    yield start
    tq.close()


@pytest.fixture(scope="session")
def _shared_state_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("shared-state"))


_shared_cfg: dict = {}


@pytest.fixture
def tq_shared(_shared_state_dir):
    """A 3-unit deployment reused by consecutive tests; use :func:`pid` partitions.

    Tests that start their own deployment (``tq_start``) close it; the next test
    asking for ``tq_shared`` then starts a fresh shared one.
    """
    import tqtx as tq
    from tqtx import api

    if api._client is None or api._config is not _shared_cfg.get("cfg"):
        tq.close()
        import shutil
        shutil.rmtree(_shared_state_dir, ignore_errors=True)
        tq.init({"num_units": 3, "state_dir": _shared_state_dir})
        _shared_cfg["cfg"] = api._config
    return dict(api._config)


@pytest.fixture
def no_lease(monkeypatch):
    """Clients made in this test put every key through ALLOC (no lease: see
    tqtx/client/lease.py), for tests of that path's interleavings and index reuse."""
    monkeypatch.setenv("TQTX_PUT_LEASE", "0")
    from tqtx import api
    if api._client is not None:  # a deployment shared with earlier tests
        monkeypatch.setattr(api._client.lease, "enabled", False)


@pytest.fixture
def inbox(tmp_path):
    """A same-host client inbox (tqtx.wire.shm.GetInbox) made in ``tmp_path``."""
    from tqtx.wire import shm
    box = shm.GetInbox(str(tmp_path))
    yield box
    box.close()


@pytest.fixture
def pid():
    """A partition id unique to the test."""
    return f"p-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def point_reached(monkeypatch):
    """``point_reached(point)``: a threading.Event set when fault point ``point`` is hit.

    Wraps ``tqtx.faults.hit`` in this process (the configured fault still runs after the
    event is set) until the end of the test.
    """
    from tqtx import faults

    def watch(point: str) -> threading.Event:
        reached = threading.Event()
        hit = faults.hit

        def spy(name):
            if name == point:
                reached.set()
            hit(name)

        monkeypatch.setattr(faults, "hit", spy)
        return reached

    return watch
