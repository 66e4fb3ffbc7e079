"""A whole job killed and started again, for tests of what survives it (importable from any
test: ``tests/`` is on ``sys.path`` through the rootdir conftest)."""
from __future__ import annotations

import time

import tqtx as tq
from tqtx import api


def kill_whole_job() -> None:
    """What a SIGKILL of the whole job leaves of this process's deployment: every server
    killed, no END_BUFFER, no SHUTDOWN; the next ``tq.init`` starts on what is on disk."""
    api._deployment.stop(graceful=False)
    api._client.close()
    api._client = api._deployment = api._config = None


def wait_units_registered(timeout: float = 60.0) -> None:
    """Wait (bounded) until every unit of the deployment started again has registered."""
    client = tq.get_client()
    deadline = time.monotonic() + timeout
    while not client.controller.call("TOPOLOGY")["ready"]:
        assert time.monotonic() < deadline, "the units did not re-register"
        time.sleep(0.1)
