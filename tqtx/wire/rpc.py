"""Request/reply over ZeroMQ: a ROUTER server loop and DEALER peers with timeouts.

Every request is ``[header, *tensor_frames]`` where the header decodes to
``{"op", "rid", "body"}``; every reply is ``{"rid", "ok", "result"|"error"}``.
Errors travel as ``{"type", "message", "data"}`` and are re-raised client-side as
the matching exception type. Handlers may defer their reply to a worker thread.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from .. import faults
from ..errors import (DumpFormatError, DumpNotFoundError, FieldsNotFoundError, KeysNotFoundError,
                      PartitionNotFoundError, PeerDiedError, PeerTimeoutError, RemoteError,
                      RestorePendingError, SchemaConflictError)
from ..metrics import Metrics, frames_nbytes
from .codec import CodecError, decode, encode

log = logging.getLogger("tqtx.rpc")

DEFAULT_TIMEOUT = float(os.environ.get("TQTX_TIMEOUT", "300"))
_REPLY_CACHE_SIZE = 4096


def _context() -> zmq.Context:
    """The process's ZeroMQ context; two I/O threads so a client receiving from several
    units (or a unit serving and calling the controller) moves bytes on both cores."""
    return zmq.Context.instance(io_threads=IO_THREADS)


IO_THREADS = int(os.environ.get("TQTX_IO_THREADS", "2"))


def new_id() -> str:
    """A fresh request/operation ID."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------- error mapping
def error_payload(exc: BaseException) -> dict:
    data = {}
    if isinstance(exc, RestorePendingError):
        data = exc.to_dict()
        kind = "RestorePendingError"
    elif isinstance(exc, KeysNotFoundError):
        data = {"keys": exc.keys, "partition_id": exc.partition_id}
        kind = "KeysNotFoundError"
    else:
        kind = type(exc).__name__
    if isinstance(exc, KeysNotFoundError):
        message = exc.message
    elif isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        message = exc.args[0]  # str(KeyError) would quote it, and again on the client
    else:
        message = str(exc)
    if isinstance(exc, DumpNotFoundError) and exc.filename is not None:
        data = {"filename": exc.filename}
    return {"type": kind, "message": message, "data": data}


_BUILTIN = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
            "FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError,
            "PermissionError": PermissionError, "NotADirectoryError": NotADirectoryError,
            "OSError": OSError, "RuntimeError": RuntimeError, "TimeoutError": TimeoutError,
            "CodecError": ValueError, "DumpFormatError": DumpFormatError,
            "FieldsNotFoundError": FieldsNotFoundError,
            "PartitionNotFoundError": PartitionNotFoundError,
            "SchemaConflictError": SchemaConflictError,
            "IllegalTransition": RuntimeError, "InjectedFault": RuntimeError}


def raise_remote(err: dict, peer: str):
    kind, message, data = err.get("type"), err.get("message", ""), err.get("data") or {}
    if kind == "RestorePendingError":
        units = {int(k) if str(k).isdigit() else k: v for k, v in (data.get("units") or {}).items()}
        raise RestorePendingError(message, restore_id=data.get("restore_id"),
                                  dump_dir=data.get("dump_dir"), reason=data.get("reason"),
                                  units=units, partition_id=data.get("partition_id"))
    if kind == "KeysNotFoundError":
        raise KeysNotFoundError(data.get("keys", []), data.get("partition_id"))
    if kind == "DumpNotFoundError":
        raise DumpNotFoundError(message, data.get("filename"))
    cls = _BUILTIN.get(kind)
    if cls is not None:
        raise cls(message)
    raise RemoteError(f"{peer}: {kind}: {message}")


def _ids(body) -> str:
    """`` (restore R, unit U)`` for log lines about a request, so one grep finds them."""
    if not isinstance(body, dict):
        return ""
    parts = [f"{k.split('_')[0]} {body[k]}" for k in ("restore_id", "dump_id", "unit_id")
             if body.get(k) is not None]
    return f" ({', '.join(parts)})" if parts else ""


# ---------------------------------------------------------------- server
class Deferred:
    """Returned by a handler that will reply later from another thread via ``reply``."""

    def __init__(self, server: "Server", ident: bytes, rid: str, op: str, cache: bool):
        self._server, self._ident, self._rid, self._op, self._cache = server, ident, rid, op, cache
        self._timing = server._timing  # [op label, receive time, request bytes] or None

    def reply(self, result=None, error: BaseException | None = None) -> None:
        self._server._post(self._ident, self._rid, self._op, self._cache, result, error,
                           self._timing)


class Server:
    """A single-threaded ROUTER loop dispatching ``op`` to handlers.

    ``handlers[op] = (fn, mutating)``; ``fn(body, request) -> result | Deferred``.
    Replies to mutating requests are cached by request ID, so a retried request
    (lost reply) gets the recorded outcome instead of acting twice.
    """

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, *, context=None,
                 curve=None):
        self.name = name
        self.context = context or _context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if curve is not None:
            curve(self.socket)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
        else:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.handlers: dict[str, tuple[Callable, bool]] = {}
        self._cache: OrderedDict[str, list] = OrderedDict()
        self._pending: dict[str, bool] = {}
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_addr = f"inproc://tqtx-wake-{uuid.uuid4().hex}"
        self._wake = self.context.socket(zmq.PULL)
        self._wake.bind(self._wake_addr)
        self._wake_local = threading.local()
        self._stop = False
        role, _, suffix = name.partition("-")
        self.metrics = Metrics(role, int(suffix) if suffix.isdigit() else None)
        self.op_labels: dict[str, Callable[[dict], str]] = {}  # op -> metrics label from body
        self._timing: list | None = None

    def add(self, op: str, fn: Callable, *, mutating: bool = False) -> None:
        self.handlers[op] = (fn, mutating)

    def stop(self) -> None:
        self._stop = True

    # called from worker threads
    def _post(self, ident, rid, op, cache, result, error, timing=None):
        self._posted.put((ident, rid, op, cache, result, error, timing))
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._wake_local.sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._wake_addr)
        try:
            # never blocks: with the loop stopped (no reader) a blocking send would hang this
            # worker, and the process's shutdown waiting for it; a full queue is awake anyway
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _send(self, ident: bytes, frames: list) -> None:
        try:
            self.socket.send_multipart([ident, *frames], copy=False)
        except zmq.ZMQError as exc:  # peer gone; nothing to do
            log.debug("%s: reply not sent: %s", self.name, exc)

    def _reply_frames(self, rid, result, error) -> list:
        if error is not None:
            return encode({"rid": rid, "ok": False, "error": error_payload(error)})
        try:
            return encode({"rid": rid, "ok": True, "result": result})
        except TypeError as exc:
            return encode({"rid": rid, "ok": False, "error": error_payload(exc)})

    def _finish(self, ident, rid, op, cache, result, error, timing=None) -> None:
        frames = self._reply_frames(rid, result, error)
        self._pending.pop(rid, None)
        if cache and rid:
            self._cache[rid] = frames
            while len(self._cache) > _REPLY_CACHE_SIZE:
                self._cache.popitem(last=False)
        if timing is not None:  # recorded before the reply leaves: a caller sees its own request
            self._record(timing, frames, error is not None)
        self._send(ident, frames)

    def _record(self, timing: list, frames, error: bool) -> None:
        """Count one request: receive-to-reply time, request and reply frame bytes."""
        label, t0, nin = timing
        self.metrics.record(label, time.perf_counter() - t0, nin,
                            frames_nbytes(frames) if frames else 0, error)

    def _handle(self, msg: list) -> None:
        ident, frames = msg[0], msg[1:]
        rid, op, body = "", "?", None
        timing = None
        if self.metrics.enabled:
            timing = ["?", time.perf_counter(), frames_nbytes(frames)]
        self._timing = timing
        try:
            request = decode(frames)
            if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                raise CodecError("request is not a {op, rid, body} map")
            op, rid, body = request["op"], str(request.get("rid") or ""), request.get("body") or {}
            entry = self.handlers.get(op)
            if entry is None:
                raise ValueError(f"{self.name}: unknown request type {op!r}")
            if timing is not None:
                labeller = self.op_labels.get(op)
                timing[0] = op if labeller is None else labeller(body)
            fn, mutating = entry
            if mutating and rid:
                if rid in self._cache:
                    self._send(ident, self._cache[rid])
                    if timing is not None:
                        self._record(timing, self._cache[rid], False)
                    return
                if rid in self._pending:
                    return  # the first copy's reply will come; ignore the duplicate
            role = self.name.split("-")[0]
            faults.hit(f"{role}.request.{op}")
            result = fn(body, request)
            if isinstance(result, Deferred):
                if mutating and rid:
                    self._pending[rid] = True
                return
            try:
                faults.hit(f"{role}.reply.{op}")
            except faults.DropReply:
                if mutating and rid:  # the outcome is recorded; only this reply is lost
                    self._cache[rid] = self._reply_frames(rid, result, None)
                raise
            self._finish(ident, rid, op, mutating, result, None, timing)
        except faults.DropReply:
            log.warning("%s: fault point dropped the reply to %s%s", self.name, op, _ids(body))
            if timing is not None:
                self._record(timing, None, False)
        except Exception as exc:  # every failure becomes an error reply; the loop keeps serving
            if not isinstance(exc, (ValueError, TypeError, KeyError, RestorePendingError)):
                log.exception("%s: %s failed%s", self.name, op, _ids(body))
            self._finish(ident, rid, op, False, None, exc, timing)

    def deferred(self, request: dict, ident: bytes) -> Deferred:
        op = request["op"]
        return Deferred(self, ident, str(request.get("rid") or ""), op, self.handlers[op][1])

    def serve_forever(self, poll_ms: int = 200) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        while not self._stop:
            events = dict(poller.poll(poll_ms))
            if self._wake in events:
                while True:
                    try:
                        self._wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while True:
                try:
                    ident, rid, op, cache, result, error, timing = self._posted.get_nowait()
                except queue.Empty:
                    break
                if error is None:
                    try:
                        faults.hit(f"{self.name.split('-')[0]}.reply.{op}")
                    except faults.DropReply as exc:
                        if cache and rid:  # the outcome is recorded; only this reply is lost
                            self._cache[rid] = self._reply_frames(rid, result, None)
                        error = exc
                    except Exception as exc:
                        result, error = None, exc
                if isinstance(error, faults.DropReply):
                    self._pending.pop(rid, None)
                    if timing is not None:
                        self._record(timing, None, False)
                    continue
                self._finish(ident, rid, op, cache, result, error, timing)
            if self.socket in events:
                for _ in range(64):
                    try:
                        msg = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.current_ident = msg[0].bytes
                    self._handle([msg[0].bytes, *msg[1:]])
                    msg = None  # else the last request's frames stay alive until the next one
        self.socket.close(linger=1000)
        self._wake.close(linger=0)


# ---------------------------------------------------------------- client side
CONNECT_TIMEOUT = float(os.environ.get("TQTX_CONNECT_TIMEOUT", "5"))
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Peer:
    """A DEALER connection to one server; not thread-safe (use one per thread).

    A monitor on the socket tells when the server's connection closes (its process
    exited or restarted), so a request in flight fails within a second instead of at
    its timeout. ``connect_timeout`` (None: wait for the timeout) gives up on a server
    no connection could be made to within that many seconds of sending. ``hint`` is
    appended to the PeerDiedError message (what to do next).
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
        self.connected = False  # handshake done and the connection has not closed since
        self._lost = False      # a connection closed since the last request was sent
        self._sent_at = 0.0
        self.bytes_received = 0    # tensor frame bytes (payload)
        self.frames_received = 0   # tensor frames
        self.header_bytes_received = 0

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
        self._sent_at = time.monotonic()
        sock.send_multipart(frames, copy=False)
        return rid

    def receive(self, rid: str, op: str, deadline: float, sent_at: float | None = None):
        """Wait for the reply to ``rid``; raise on timeout, a dead peer or a remote error."""
        sock = self._sock()
        waited_from = time.monotonic() if sent_at is None else sent_at
        while True:
            remaining = deadline - time.monotonic()
            # poll even when the deadline has passed: a reply already here is read
            if not sock.poll(max(0.0, min(remaining, 1.0)) * 1000):
                self._check_alive(op)
                if time.monotonic() < deadline:
                    continue
                self.reset()
                raise PeerTimeoutError(
                    f"{self.name} at {self.address} did not reply to {op} within "
                    f"{time.monotonic() - waited_from:.1f}s")
            frames = sock.recv_multipart(copy=False)
            reply = self._decode(frames)
            if reply.get("rid") != rid:
                continue  # a stale reply to an earlier, abandoned request
            if not reply.get("ok"):
                raise_remote(reply.get("error") or {}, self.name)
            return reply.get("result")

    def _decode(self, frames):
        self.frames_received += len(frames) - 1
        self.bytes_received += sum(len(f.buffer) for f in frames[1:])
        self.header_bytes_received += len(frames[0].buffer)
        return decode([f.buffer for f in frames])

    def gone(self) -> str | None:
        """Why the server cannot answer the last request sent, or None if it still may:
        its process exited (``liveness``), its connection closed after the request was
        sent, or no connection was made within ``connect_timeout`` of sending it."""
        if self.liveness is not None:
            why = self.liveness()
            if why:
                return why
        if self.socket is None:
            return None
        self._link_events()
        if self._lost:
            return "its connection closed: the process exited or restarted"
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

    def call(self, op: str, body: dict | None = None, *, timeout: float | None = None,
             rid: str | None = None):
        """Send one request and wait for its reply."""
        timeout = self.timeout if timeout is None else timeout
        rid = self.send(op, body, rid)
        return self.receive(rid, op, self._sent_at + timeout, self._sent_at)


def call_many(calls: list[tuple], *, timeout: float | None = None,
              raise_first: bool = True, watch: Callable[[], None] | None = None) -> list:
    """Send every request at once, then wait on all their sockets at once.

    ``calls`` are ``(peer, op, body[, rid])``; a fixed ``rid`` makes a retry idempotent.
    Each request has its own deadline: ``timeout`` (else its peer's) from when it was
    sent. Every reply that arrives is read, so a slow or dead peer costs the others
    nothing; a failure names only its own peer, with the time really waited. Waits for
    every request before raising the first failure, so a caller's cleanup never races a
    peer still working; with ``raise_first=False`` exceptions are returned in place of
    results. ``watch`` runs about once a second while waiting; if it raises, waiting
    stops, the unanswered peers are reset and its exception propagates.
    """
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
    peers = {id(w[0]): w[0] for w in waiting.values()}
    poller = zmq.Poller()
    for peer in peers.values():
        poller.register(peer.socket, zmq.POLLIN)
    by_socket = {peer.socket: peer for peer in peers.values()}
    broken: dict[int, object] = {}  # peers to reset once nothing else waits on them

    def settle(key, result):
        for pos in waiting.pop(key)[4]:
            results[pos] = result

    def read(peer):
        while True:
            try:
                frames = peer.socket.recv_multipart(zmq.NOBLOCK, copy=False)
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
            for sock, _ in poller.poll(max(0.0, wake - time.monotonic()) * 1000):
                read(by_socket[sock])
            now = time.monotonic()
            checking = now >= next_check
            for key, (peer, op, sent_at, deadline, _pos) in list(waiting.items()):
                if key not in waiting or not (checking or now >= deadline):
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
    if raise_first:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results
