"""A server does not keep a request's frames alive once it has handled it; work a handler
leaves for after its reply, and work queued with call_soon, runs before the next request."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _serving(server: Server, peers: int):
    """Run ``server``'s loop in a thread; yield ``peers`` connections to it."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 50}, daemon=True)
    thread.start()
    conns = [Peer(server.address, f"{server.name} ({i})", timeout=30) for i in range(peers)]
    try:
        yield conns
    finally:
        server.stop()
        thread.join(10)
        for c in conns:
            c.close()


def test_handled_request_frames_are_released():
    server = Server("unit-0")
    seen = []
    server.add("TAKE", lambda body, req: seen.append(len(body["rows"])) or {"ok": True})
    with _serving(server, 1) as (peer,):
        rows = [RawTensor("uint8", (SIZE,), bytes([i]) * SIZE) for i in range(50)]
        assert peer.call("TAKE", {"rows": rows}) == {"ok": True}
        assert seen == [50]
        deadline = time.monotonic() + 10
        while _frames_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        # the 50 tensor frames of the handled request are gone although no request came
        # after it
        assert _frames_alive() == 0


def test_after_reply_runs_once_the_reply_is_sent_and_before_the_next_request():
    server = Server("controller")
    state = {"value": 0, "snapshot": None}
    replied = threading.Event()
    log = []

    def look(body, req):  # replies at once; reads the state it describes after the reply
        def later():
            replied.wait(10)  # the caller already has its reply while this runs
            log.append("after_reply")
            state["snapshot"] = state["value"]
        server.after_reply(later)
        log.append("look")
        return {"ok": True}

    def change(body, req):
        log.append("change")
        state["value"] += 1
        return {"snapshot": state["snapshot"]}

    server.add("LOOK", look)
    server.add("CHANGE", change, mutating=True)
    with _serving(server, 2) as peers:
        assert peers[0].call("CHANGE", {}) == {"snapshot": None}
        # LOOK's reply arrives while its after-reply work is still waiting
        assert peers[1].call("LOOK", {}, timeout=5) == {"ok": True}
        pending_change = peers[0].start("CHANGE", {})  # sent while that work still waits
        time.sleep(0.2)
        replied.set()
        # the second CHANGE was read after LOOK's after-reply work, which saw the state as
        # LOOK did (one change), not as the second CHANGE left it
        assert pending_change.wait() == {"snapshot": 1}
        assert log == ["change", "look", "after_reply", "change"]


def test_after_reply_runs_before_a_request_already_queued_behind():
    server = Server("controller")
    go, blocking = threading.Event(), threading.Event()
    state = {"value": 0, "seen": []}

    def block(body, req):  # holds the loop while the next two requests queue up
        blocking.set()
        go.wait(10)
        return {"ok": True}

    def look(body, req):
        server.after_reply(lambda: state["seen"].append(state["value"]))
        return {"ok": True}

    def change(body, req):
        state["value"] += 1
        return {"seen": list(state["seen"])}

    server.add("BLOCK", block)
    server.add("LOOK", look)
    server.add("CHANGE", change, mutating=True)
    with _serving(server, 2) as (blocker, peer):
        pending_block = blocker.start("BLOCK", {})
        assert blocking.wait(10)  # the loop is inside BLOCK
        looked = peer.start("LOOK", {})  # one connection: read in this order, in one batch
        changed = peer.start("CHANGE", {})
        time.sleep(0.2)
        go.set()
        assert pending_block.wait() == {"ok": True}
        assert looked.wait() == {"ok": True}
        assert changed.wait() == {"seen": [0]}  # LOOK's after-reply work ran first


def test_call_soon_runs_before_a_request_sent_after_it():
    # the loop is busy inside a turn (BLOCK) when the call is queued and the next request
    # sent, so that request is readable in the same turn, before the wake-up is polled
    server = Server("unit-0")
    go, blocking = threading.Event(), threading.Event()
    state = {"called": False}

    server.add("BLOCK", lambda body, req: (blocking.set(), go.wait(10))[1] and {"ok": True})
    server.add("CHECK", lambda body, req: {"called": state["called"]})
    with _serving(server, 2) as (blocker, peer):
        pending_block = blocker.start("BLOCK", {})
        assert blocking.wait(10)  # the loop is inside BLOCK, within a turn
        server.call_soon(lambda: state.update(called=True))
        checked = peer.start("CHECK", {})
        time.sleep(0.2)
        go.set()
        assert pending_block.wait() == {"ok": True}
        assert checked.wait() == {"called": True}
