"""call_many and Peer against real in-process ZeroMQ servers: per-peer deadlines, every
reply read, failures naming only the peers that failed, dead-peer detection."""
from __future__ import annotations

import re
import socket
import threading
import time

import pytest
import zmq

from tqtx.errors import PeerDiedError, PeerTimeoutError
from tqtx.wire.peer import Peer, call_many
from tqtx.wire.rpc import Server


class _Unit:
    """A Server in a thread: ``FAST`` replies at once, ``LATE`` after ``body["s"]``
    seconds (from a worker thread), ``SILENT`` never replies."""

    def __init__(self, name: str):
        self.server = Server(name)
        self.address = self.server.address
        self.answered: list[str] = []
        srv = self.server

        def fast(body, req):
            return {"from": name, "n": body.get("n")}

        def late(body, req):
            deferred = srv.deferred(req, srv.current_ident)

            def work():
                time.sleep(body["s"])
                self.answered.append(req["rid"])
                deferred.reply({"from": name, "n": body.get("n")})
            threading.Thread(target=work, daemon=True).start()
            return deferred

        def silent(body, req):
            return srv.deferred(req, srv.current_ident)  # never replied

        srv.add("FAST", fast)
        srv.add("LATE", late)
        srv.add("SILENT", silent)
        self.thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_ms": 20},
                                       daemon=True)
        self.thread.start()

    def stop(self):
        self.server.stop()
        self.thread.join(5)


@pytest.fixture
def units():
    made = [_Unit(f"unit-{i}") for i in range(3)]
    yield made
    for u in made:
        u.stop()


def _peers(units, **kw):
    return [Peer(u.address, f"unit {i}", **kw) for i, u in enumerate(units)]


def _waited(err) -> float:
    m = re.search(r"within (\d+\.\d)s", str(err))
    assert m, str(err)
    return float(m.group(1))


def test_silent_peer_fails_alone_and_late_replies_are_read(units):
    """One peer never replies; the others reply late but within their timeout."""
    peers = _peers(units)
    try:
        results = call_many([(peers[0], "SILENT", {}),
                             (peers[1], "LATE", {"s": 0.6, "n": 1}),
                             (peers[2], "LATE", {"s": 0.3, "n": 2})],
                            timeout=1.5, raise_first=False)
        assert results[1] == {"from": "unit-1", "n": 1}
        assert results[2] == {"from": "unit-2", "n": 2}
        err = results[0]
        assert isinstance(err, PeerTimeoutError)
        assert "unit 0" in str(err) and "SILENT" in str(err)
        assert "unit 1" not in str(err) and "unit 2" not in str(err)
        assert _waited(err) >= 1.5  # the real wait, measured from its send
        assert peers[0].socket is None  # reset: its late reply can never be misread
        assert peers[1].socket is not None and peers[2].socket is not None
    finally:
        for p in peers:
            p.close()


def test_silent_peer_first_in_order_does_not_starve_the_rest(units):
    """The silent peer has the shortest timeout and comes first; a later peer with a
    longer timeout still gets its whole timeout, measured from its own send."""
    peers = [Peer(units[0].address, "unit 0", timeout=0.5),
             Peer(units[1].address, "unit 1", timeout=5.0)]
    try:
        results = call_many([(peers[0], "SILENT", {}), (peers[1], "LATE", {"s": 1.0, "n": 7})],
                            raise_first=False)
        assert results[1] == {"from": "unit-1", "n": 7}
        assert isinstance(results[0], PeerTimeoutError) and "unit 0" in str(results[0])
        assert _waited(results[0]) >= 0.5
    finally:
        for p in peers:
            p.close()


def test_raise_first_waits_for_every_peer_then_raises_the_failure(units):
    peers = _peers(units)
    try:
        with pytest.raises(PeerTimeoutError, match="unit 0") as ei:
            call_many([(peers[0], "SILENT", {}), (peers[1], "LATE", {"s": 0.8}),
                       (peers[2], "FAST", {})], timeout=1.2)
        assert "unit 1" not in str(ei.value)
        # the late reply was waited for and read before the failure was raised
        assert len(units[1].answered) == 1
        assert peers[1].header_bytes_received > 0 and peers[2].header_bytes_received > 0
    finally:
        for p in peers:
            p.close()


def test_two_requests_to_one_peer_and_one_id_to_two_peers(units):
    """Replies are matched by (peer, request ID): the second reply arriving first is not
    thrown away as stale, and one fixed ID sent to two peers gets both replies."""
    p0, p1 = _peers(units)[:2]
    try:
        results = call_many([(p0, "LATE", {"s": 0.5, "n": 1}), (p0, "FAST", {"n": 2}),
                             (p1, "FAST", {"n": 3}, "shared-id"),
                             (p0, "LATE", {"s": 0.1, "n": 4}, "shared-id")], timeout=5)
        assert [r["n"] for r in results] == [1, 2, 3, 4]
    finally:
        p0.close()
        p1.close()


def test_a_server_that_goes_away_is_reported_dead_not_timed_out(units):
    peers = _peers(units)
    try:
        threading.Timer(0.3, units[0].stop).start()  # its socket closes mid-request
        results = call_many([(peers[0], "SILENT", {}), (peers[1], "LATE", {"s": 0.5, "n": 1})],
                            timeout=20, raise_first=False)
        assert results[1] == {"from": "unit-1", "n": 1}
        assert isinstance(results[0], PeerDiedError), results[0]
        assert "unit 0" in str(results[0]) and "connection closed" in str(results[0])
    finally:
        for p in peers:
            p.close()


def _recording_polls(monkeypatch) -> list:
    """Every poll's ready sockets, of the pollers made from now on (peer.Peer's, call_many's)."""
    from tqtx.wire import peer as peer_mod
    polls: list = []

    class Recording(zmq.Poller):
        def poll(self, timeout=None):
            ready = super().poll(timeout)
            polls.append([s for s, _ in ready])
            return ready
    monkeypatch.setattr(peer_mod.zmq, "Poller", Recording)
    return polls


def test_peer_call_notices_a_closed_connection(units, monkeypatch):
    """The wait for the reply polls the socket's monitor too: the connection's close wakes
    it (not the next of its one-second polls)."""
    polls = _recording_polls(monkeypatch)
    peer = Peer(units[0].address, "unit 0", hint="restart it")
    try:
        assert peer.call("FAST", {"n": 1}, timeout=5)["n"] == 1
        monitor = peer._monitor
        threading.Timer(0.3, units[0].stop).start()
        with pytest.raises(PeerDiedError, match=r"unit 0 .* is gone \(its connection closed.*"
                                                r"reply to SILENT. restart it"):
            peer.call("SILENT", timeout=20)
        assert polls[-1] == [monitor]  # the wait that raised woke on the monitor
    finally:
        peer.close()


def test_call_many_wakes_on_a_closed_connection(units, monkeypatch):
    """call_many polls every peer's monitor too: a peer whose server went away fails when
    its connection closes, while the others' requests go on."""
    polls = _recording_polls(monkeypatch)
    peers = _peers(units)
    try:
        for p in peers[:2]:
            assert p.call("FAST", {"n": 0}, timeout=5)["n"] == 0
        monitor = peers[0]._monitor
        threading.Timer(0.3, units[0].stop).start()
        results = call_many([(peers[0], "SILENT", {}), (peers[1], "SILENT", {})],
                            timeout=3, raise_first=False)
        assert isinstance(results[0], PeerDiedError) and "connection closed" in str(results[0])
        assert isinstance(results[1], PeerTimeoutError)
        assert [monitor] in polls  # unit 0's close woke the wait
    finally:
        for p in peers:
            p.close()


def test_connect_timeout_gives_up_on_an_address_nobody_listens_on():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = Peer(f"tcp://127.0.0.1:{port}", "unit 9", timeout=20, connect_timeout=0.5)
    try:
        with pytest.raises(PeerDiedError, match="unit 9 .*no connection within 0.5s"):
            call_many([(peer, "PING", {})])
        with pytest.raises(PeerDiedError, match="no connection"):
            peer.call("PING")
    finally:
        peer.close()
    # without connect_timeout it is a plain timeout (the old behaviour)
    peer = Peer(f"tcp://127.0.0.1:{port}", "unit 9", timeout=0.3)
    with pytest.raises(PeerTimeoutError, match="unit 9"):
        peer.call("PING")
    peer.close()


def test_watch_stops_the_wait_and_resets_the_unanswered(units):
    peers = _peers(units)[:2]
    calls = {"n": 0}

    def watch():
        calls["n"] += 1
        if calls["n"] >= 2:
            raise PeerDiedError("controller gone")

    try:
        with pytest.raises(PeerDiedError, match="controller gone"):
            call_many([(peers[0], "SILENT", {}), (peers[1], "SILENT", {})], timeout=30,
                      watch=watch)
        assert all(p.socket is None for p in peers)
    finally:
        for p in peers:
            p.close()


def test_receive_reads_a_reply_that_arrived_before_a_passed_deadline(units):
    peer = Peer(units[0].address, "unit 0")
    try:
        rid = peer.send("FAST", {"n": 5})
        # the reply is waiting in the socket (poll reads nothing)
        assert peer.socket.poll(10_000, zmq.POLLIN), "no reply within 10 s"
        assert peer.receive(rid, "FAST", time.monotonic() - 1)["n"] == 5
    finally:
        peer.close()


def test_a_deferred_reply_after_the_loop_stopped_does_not_block_its_worker():
    """A worker finishing after the server loop stopped must not hang on the wake-up
    send (it did: a unit being stopped then waited forever for its I/O pool)."""
    from concurrent.futures import ThreadPoolExecutor

    srv = Server("unit-7")
    pool = ThreadPoolExecutor(max_workers=1)  # one worker thread: it keeps its wake socket
    release = threading.Event()

    def work(deferred, wait):
        if wait:
            release.wait(10)
        deferred.reply({"ok": True})
        return "replied"

    def slow(body, req):
        deferred = srv.deferred(req, srv.current_ident)
        futures.append(pool.submit(work, deferred, body["wait"]))
        return deferred

    futures: list = []
    srv.add("SLOW", slow)
    loop = threading.Thread(target=srv.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    loop.start()
    peer = Peer(srv.address, "unit 7")
    try:
        assert peer.call("SLOW", {"wait": False}, timeout=5) == {"ok": True}
        peer.send("SLOW", {"wait": True})
        deadline = time.monotonic() + 5
        while len(futures) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        srv.stop()
        loop.join(5)
        assert not loop.is_alive()
        release.set()  # the worker now replies to a server whose loop is gone
        assert futures[1].result(timeout=5) == "replied"
    finally:
        release.set()
        peer.close()
        pool.shutdown(wait=False)


def test_after_send_runs_while_the_peers_work_and_its_error_waits_for_them(units):
    peers = _peers(units)
    try:
        seen = []

        def own_work():  # every request is out: the late one finishes while this runs
            deadline = time.monotonic() + 5
            while not units[1].answered and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(len(units[1].answered))

        results = call_many([(peers[0], "FAST", {"n": 0}), (peers[1], "LATE", {"s": 0.2, "n": 1})],
                            timeout=5, after_send=own_work)
        assert [r["n"] for r in results] == [0, 1] and seen == [1]

        def failing():
            raise OSError("the caller's own write failed")

        with pytest.raises(OSError, match="own write failed"):
            call_many([(peers[1], "LATE", {"s": 0.4, "n": 2}), (peers[2], "FAST", {})],
                      timeout=5, after_send=failing)
        assert len(units[1].answered) == 2  # the late reply was waited for before raising
    finally:
        for p in peers:
            p.close()


def test_one_request_is_answered_as_one_among_many(units):
    """call_many of a single request (a small put or get: one unit) takes a shorter path;
    its results, errors and deadlines are those of a request among many."""
    peer = _peers(units)[0]
    try:
        assert call_many([(peer, "FAST", {"n": 3})]) == [{"from": "unit-0", "n": 3}]
        # an error of the server's is the request's result, or raised
        (err,) = call_many([(peer, "NO_SUCH_OP", {})], raise_first=False)
        assert isinstance(err, ValueError) and "unknown request type" in str(err)
        with pytest.raises(ValueError, match="unknown request type"):
            call_many([(peer, "NO_SUCH_OP", {})])
        # a silent server: a timeout naming the peer and the time waited
        t0 = time.monotonic()
        (err,) = call_many([(peer, "SILENT", {})], timeout=0.3, raise_first=False)
        assert isinstance(err, PeerTimeoutError) and "unit 0" in str(err)
        assert 0.3 <= _waited(err) < 2 and time.monotonic() - t0 < 2
        # the late reply of an abandoned request is never taken for a later one's
        (err,) = call_many([(peer, "LATE", {"s": 0.4, "n": 1})], timeout=0.1,
                           raise_first=False)
        assert isinstance(err, PeerTimeoutError)
        time.sleep(0.5)
        assert call_many([(peer, "FAST", {"n": 2})]) == [{"from": "unit-0", "n": 2}]
        # the caller's own work between send and wait: its error comes once answered
        answered = len(units[0].answered)
        with pytest.raises(RuntimeError, match="own work failed"):
            call_many([(peer, "LATE", {"s": 0.2, "n": 4})],
                      after_send=lambda: (_ for _ in ()).throw(RuntimeError("own work failed")))
        assert len(units[0].answered) == answered + 1  # answered before the error came
        assert call_many([(peer, "FAST", {"n": 5})]) == [{"from": "unit-0", "n": 5}]
        # a body that cannot be encoded fails that request alone, before anything is sent
        (err,) = call_many([(peer, "FAST", {"x": object()})], raise_first=False)
        assert isinstance(err, TypeError)
    finally:
        peer.close()
