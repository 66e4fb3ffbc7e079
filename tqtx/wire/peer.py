"""The client side of request/reply: a DEALER :class:`Peer` per server, and :func:`call_many`
to wait on requests to several servers at once.

A monitor on each peer's socket tells when the server's connection closes; the wait for a
reply polls it too, so a request in flight fails as soon as that is seen (a server that
exited: at once on this host) instead of at its timeout.
"""
from __future__ import annotations

import os
import time
import uuid
from array import array
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import PeerDiedError, PeerTimeoutError
from .codec import decode, encode
from .errors import raise_remote
from .rpc import DEFAULT_TIMEOUT, _context, new_id, recv_frames, send_frames

CONNECT_TIMEOUT = float(os.environ.get("TQTX_CONNECT_TIMEOUT", "5"))
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Peer:
    """A DEALER connection to one server; not thread-safe (use one per thread).

    A monitor on the socket tells when the server's connection closes (its process
    exited or restarted); a wait for a reply wakes on it, so a request in flight fails
    then instead of at its timeout. ``connect_timeout`` (None: wait for the timeout)
    gives up on a server no connection could be made to within that many seconds of
    sending. ``hint`` is appended to the PeerDiedError message (what to do next).
    """

    def __init__(self, address: str, name: str, *, timeout: float = DEFAULT_TIMEOUT,
                 context=None, liveness: Callable[[], str | None] | None = None, curve=None,
                 connect_timeout: float | None = None, hint: str = ""):
        self.address, self.name, self.timeout = address, name, timeout
        self.context = context or _context()
        self.liveness = liveness
        self.curve = curve
        self.connect_timeout = connect_timeout
        self.hint = hint
        self.socket = None
        self._monitor = None
        self.poller = None  # polls the socket and its monitor (one made per request: ~5 us)
        self.connected = False  # handshake done and the connection has not closed since
        self._lost = False      # a connection closed since the last request was sent
        # The numbers a long-lived peer (a unit's heartbeat) updates at every request live in
        # arrays: a new int or float kept until the next request would be made beside the
        # last one, in the same pymalloc pool, so that pool could never empty (a unit's
        # memory after a clear; docs/performance.md, *Unit memory*).
        self._counts = array("q", bytes(8 * 3))  # payload frames, payload bytes, header bytes
        self._sent = array("d", [0.0])

    frames_received = property(lambda self: self._counts[0], doc="tensor frames received")
    bytes_received = property(lambda self: self._counts[1],
                              doc="tensor frame bytes (payload) received")
    header_bytes_received = property(lambda self: self._counts[2])
    _sent_at = property(lambda self: self._sent[0],
                        doc="time.monotonic() when the last request was sent")

    def _sock(self):
        if self.socket is None:
            s = self.context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve(s)
            self._monitor = s.get_monitor_socket(_LINK_EVENTS,
                                                 addr=f"inproc://tqtx-link-{uuid.uuid4().hex}")
            self._monitor.setsockopt(zmq.LINGER, 0)
            s.connect(self.address)
            self.socket = s
            self.poller = zmq.Poller()
            self.poller.register(s, zmq.POLLIN)
            self.poller.register(self._monitor, zmq.POLLIN)
            self.connected = self._lost = False
        return self.socket

    def _link_events(self) -> None:
        """Read the monitor: handshake done (connected) or connection closed (lost)."""
        mon = self._monitor
        while mon is not None and mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(mon.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._lost = self._lost or self.connected
                self.connected = False

    def reset(self) -> None:
        """Drop the connection so a late reply to an abandoned request is never read."""
        if self.socket is not None:
            self.poller = None
            mon, self._monitor = self._monitor, None
            try:
                self.socket.disable_monitor()
            except zmq.ZMQError:
                pass
            if mon is not None:
                mon.close(linger=0)
            self.socket.close(linger=0)
            self.socket = None
            self.connected = self._lost = False

    def close(self) -> None:
        self.reset()

    def send(self, op: str, body: dict | None = None, rid: str | None = None) -> str:
        rid = rid or new_id()
        frames = encode({"op": op, "rid": rid, "body": body or {}})
        sock = self._sock()
        self._link_events()
        self._lost = False  # only a close after this request means the server lost it
        self._sent[0] = time.monotonic()
        send_frames(sock, frames)
        return rid

    def receive(self, rid: str, op: str, deadline: float, sent_at: float | None = None):
        """Wait for the reply to ``rid``; raise on timeout, a dead peer or a remote error."""
        sock = self._sock()
        poller = self.poller
        waited_from = time.monotonic() if sent_at is None else sent_at
        while True:
            remaining = deadline - time.monotonic()
            # poll even when the deadline has passed: a reply already here is read; the
            # monitor wakes it when the connection closes
            ready = poller.poll(max(0.0, min(remaining, 1.0)) * 1000)
            if not any(s is sock for s, _ in ready):
                self._check_alive(op)
                if time.monotonic() < deadline:
                    continue
                self.reset()
                raise PeerTimeoutError(
                    f"{self.name} at {self.address} did not reply to {op} within "
                    f"{time.monotonic() - waited_from:.1f}s")
            frames = recv_frames(sock)
            reply = self._decode(frames)
            if reply.get("rid") != rid:
                continue  # a stale reply to an earlier, abandoned request
            if not reply.get("ok"):
                raise_remote(reply.get("error") or {}, self.name)
            return reply.get("result")

    def _decode(self, frames):
        counts = self._counts
        counts[0] += len(frames) - 1
        counts[1] += sum(len(f.buffer) for f in frames[1:])
        counts[2] += len(frames[0].buffer)
        return decode([f.buffer for f in frames])

    def gone(self) -> str | None:
        """Why the server cannot answer the last request sent, or None if it still may:
        its process exited (``liveness``), its connection closed after the request was
        sent, or no connection was made within ``connect_timeout`` of sending it.

        ``liveness`` (the process this client started at that address) is asked only
        while no connection is up: a server that took over the address (a controller
        restarted by hand on the same state dir and port) answers requests sent to it,
        whatever became of the process that was there first."""
        if self.socket is not None:
            self._link_events()
            if self._lost:
                return ((self.liveness() if self.liveness is not None else None)
                        or "its connection closed: the process exited or restarted")
            if self.connected:
                return None
        if self.liveness is not None:
            why = self.liveness()
            if why:
                return why
        if self.socket is None:
            return None
        if (not self.connected and self.connect_timeout is not None
                and time.monotonic() - self._sent_at > self.connect_timeout):
            keys = ", or it refused our keys" if self.curve is not None else ""
            return (f"no connection within {self.connect_timeout:g}s: nothing accepts "
                    f"connections there{keys}")
        return None

    def died(self, why: str, op: str) -> PeerDiedError:
        """The PeerDiedError saying the server is gone (``why``) while waiting on ``op``."""
        hint = f". {self.hint}" if self.hint else ""
        return PeerDiedError(f"{self.name} at {self.address} is gone ({why}) while waiting "
                             f"for the reply to {op}{hint}")

    def _check_alive(self, op):
        why = self.gone()
        if why:
            self.reset()
            raise self.died(why, op)

    def start(self, op: str, body: dict | None = None, rid: str | None = None) -> "Pending":
        """Send one request now; its reply is read later (:meth:`Pending.wait`)."""
        return Pending(self, op, self.send(op, body, rid))

    def call(self, op: str, body: dict | None = None, *, timeout: float | None = None,
             rid: str | None = None):
        """Send one request and wait for its reply."""
        return self.start(op, body, rid).wait(timeout)


class Pending:
    """A request :meth:`Peer.start` sent, whose reply has not been read yet."""

    __slots__ = ("peer", "op", "rid", "sent_at")

    def __init__(self, peer: Peer, op: str, rid: str):
        self.peer, self.op, self.rid, self.sent_at = peer, op, rid, peer._sent_at

    def wait(self, timeout: float | None = None):
        """The reply, waited for until ``timeout`` (else the peer's) after the request was
        sent; raises as :meth:`Peer.receive` does."""
        t = self.peer.timeout if timeout is None else timeout
        return self.peer.receive(self.rid, self.op, self.sent_at + t, self.sent_at)


def call_many(calls: list[tuple], *, timeout: float | None = None,
              raise_first: bool = True, watch: Callable[[], None] | None = None,
              after_send: Callable[[], None] | None = None) -> list:
    """Send every request at once, then wait on all their sockets at once.

    ``calls`` are ``(peer, op, body[, rid])``; a fixed ``rid`` makes a retry idempotent.
    Each request has its own deadline: ``timeout`` (else its peer's) from when it was
    sent. Every reply that arrives is read, so a slow or dead peer costs the others
    nothing; a failure names only its own peer, with the time really waited. Waits for
    every request before raising the first failure, so a caller's cleanup never races a
    peer still working; with ``raise_first=False`` exceptions are returned in place of
    results. ``watch`` runs about once a second while waiting; if it raises, waiting
    stops, the unanswered peers are reset and its exception propagates. ``after_send`` runs
    once every request is sent, before waiting (the caller's own work while the peers work;
    the replies queue meanwhile); an Exception from it is raised once every request is
    answered, in place of the results.
    """
    if len(calls) == 1 and watch is None:
        return _call_one(calls[0], timeout, raise_first, after_send)
    results: list = [None] * len(calls)
    waiting: dict[tuple, list] = {}  # (id(peer), rid) -> [peer, op, sent_at, deadline, positions]
    for pos, call in enumerate(calls):
        peer, op, body = call[:3]
        try:
            rid = peer.send(op, body, call[3] if len(call) > 3 else None)
        except Exception as exc:  # e.g. a body that cannot be encoded: that request fails
            results[pos] = exc
            continue
        t = peer.timeout if timeout is None else timeout
        entry = waiting.setdefault((id(peer), rid), [peer, op, peer._sent_at, 0.0, []])
        entry[3] = peer._sent_at + t
        entry[4].append(pos)
    own_error = _own_work(after_send)
    peers = {id(w[0]): w[0] for w in waiting.values()}
    if len(peers) == 1:  # a request to one server (a small put or get): its own poller
        poller = next(iter(peers.values())).poller
    else:
        poller = zmq.Poller()
        for peer in peers.values():
            poller.register(peer.socket, zmq.POLLIN)
            poller.register(peer._monitor, zmq.POLLIN)
    by_socket = {peer.socket: peer for peer in peers.values()}
    by_monitor = {peer._monitor: peer for peer in peers.values()}
    linked: set[int] = set()  # peers whose monitor spoke in this poll: checked at once
    broken: dict[int, object] = {}  # peers to reset once nothing else waits on them

    def settle(key, result):
        for pos in waiting.pop(key)[4]:
            results[pos] = result

    def read(peer):
        while True:
            try:
                frames = recv_frames(peer.socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = peer._decode(frames)
            key = (id(peer), reply.get("rid") if isinstance(reply, dict) else None)
            if key not in waiting:
                continue  # a stale reply to an earlier, abandoned request
            result = reply.get("result")
            if not reply.get("ok"):
                try:
                    raise_remote(reply.get("error") or {}, peer.name)
                except Exception as exc:
                    result = exc
            settle(key, result)

    next_check = time.monotonic() + 1.0
    try:
        while waiting:
            wake = min(next_check, min(w[3] for w in waiting.values()))
            linked.clear()
            for sock, _ in poller.poll(max(0.0, wake - time.monotonic()) * 1000):
                if sock in by_socket:
                    read(by_socket[sock])
                else:  # a monitor: its events are read at once (one of a peer no longer
                    # waited on would keep the poll awake), and its peer checked
                    peer = by_monitor[sock]
                    peer._link_events()
                    linked.add(id(peer))
            now = time.monotonic()
            checking = now >= next_check
            for key, (peer, op, sent_at, deadline, _pos) in list(waiting.items()):
                if key not in waiting or not (checking or now >= deadline
                                              or id(peer) in linked):
                    continue
                why = peer.gone()
                if why is None and now >= deadline:
                    read(peer)  # a reply may have landed since the poll
                    if key not in waiting:
                        continue
                    why = ""
                if why is None:
                    continue
                broken[id(peer)] = peer
                settle(key, peer.died(why, op) if why else PeerTimeoutError(
                    f"{peer.name} at {peer.address} did not reply to {op} within "
                    f"{now - sent_at:.1f}s"))
            if checking:
                next_check = now + 1.0
                if watch is not None and waiting:
                    watch()
    except BaseException:
        for peer, *_ in waiting.values():  # abandoned: their late replies must never be read
            broken[id(peer)] = peer
        raise
    finally:
        for peer in broken.values():
            peer.reset()
    if own_error is not None:
        raise own_error
    if raise_first:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results


def _call_one(call: tuple, timeout: float | None, raise_first: bool, after_send) -> list:
    """:func:`call_many` of one request (a small put or get has one unit): the same
    results and errors, through :meth:`Peer.receive` (a late reply to a request abandoned
    by an exception is never read: receive skips replies to other request IDs)."""
    peer, op, body = call[:3]
    try:
        pending = peer.start(op, body, call[3] if len(call) > 3 else None)
    except Exception as exc:  # e.g. a body that cannot be encoded: that request fails
        result = exc
    else:
        own_error = _own_work(after_send)
        try:
            result = pending.wait(timeout)
        except Exception as exc:  # its error, a dead or silent peer: that request fails
            result = exc
        if own_error is not None:
            raise own_error
    if raise_first and isinstance(result, BaseException):
        raise result
    return [result]


def _own_work(after_send) -> Exception | None:
    """Run the caller's ``after_send`` (if any) while the servers work: its Exception, to
    raise once they have answered, or None."""
    if after_send is not None:
        try:
            after_send()
        except Exception as exc:  # noqa: BLE001 -- raised once the servers have answered
            return exc
    return None
