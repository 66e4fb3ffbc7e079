"""A server does not keep a request's frames alive once it has handled it."""
from __future__ import annotations

import gc
import threading
import time

import zmq

from tqtx.wire.peer import Peer
from tqtx.wire.rpc import Server
from tqtx.wire.values import RawTensor


SIZE = 6007  # a row size no other test's frames have: the count sees only this test's


def _frames_alive() -> int:
    return sum(1 for o in gc.get_objects()
               if isinstance(o, zmq.Frame) and len(o.buffer) == SIZE)


def test_handled_request_frames_are_released():
    server = Server("unit-0")
    seen = []
    server.add("TAKE", lambda body, req: seen.append(len(body["rows"])) or {"ok": True})
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 50}, daemon=True)
    thread.start()
    peer = Peer(server.address, "unit 0", timeout=30)
    try:
        rows = [RawTensor("uint8", (SIZE,), bytes([i]) * SIZE) for i in range(50)]
        assert peer.call("TAKE", {"rows": rows}) == {"ok": True}
        assert seen == [50]
        deadline = time.monotonic() + 10
        while _frames_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        # the 50 tensor frames of the handled request are gone although no request came
        # after it
        assert _frames_alive() == 0
    finally:
        server.stop()
        thread.join(10)
        peer.close()
