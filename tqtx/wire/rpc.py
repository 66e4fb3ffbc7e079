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

from .. import faults
from ..errors import (DumpFormatError, KeysNotFoundError, PeerDiedError, PeerTimeoutError,
                      RemoteError, RestorePendingError)
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
    message = exc.message if isinstance(exc, KeysNotFoundError) else str(exc)
    return {"type": kind, "message": message, "data": data}


_BUILTIN = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
            "FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError,
            "PermissionError": PermissionError, "NotADirectoryError": NotADirectoryError,
            "OSError": OSError, "RuntimeError": RuntimeError, "TimeoutError": TimeoutError,
            "CodecError": ValueError, "DumpFormatError": DumpFormatError,
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
        sock.send(b"")

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
        self.socket.close(linger=1000)
        self._wake.close(linger=0)


# ---------------------------------------------------------------- client side
class Peer:
    """A DEALER connection to one server; not thread-safe (use one per thread)."""

    def __init__(self, address: str, name: str, *, timeout: float = DEFAULT_TIMEOUT,
                 context=None, liveness: Callable[[], str | None] | None = None, curve=None):
        self.address, self.name, self.timeout = address, name, timeout
        self.context = context or _context()
        self.liveness = liveness
        self.curve = curve
        self.socket = None
        self.bytes_received = 0    # tensor frame bytes (payload)
        self.frames_received = 0   # tensor frames
        self.header_bytes_received = 0

    def _sock(self):
        if self.socket is None:
            s = self.context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve(s)
            s.connect(self.address)
            self.socket = s
        return self.socket

    def reset(self) -> None:
        """Drop the connection so a late reply to an abandoned request is never read."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def close(self) -> None:
        self.reset()

    def send(self, op: str, body: dict | None = None, rid: str | None = None) -> str:
        rid = rid or new_id()
        frames = encode({"op": op, "rid": rid, "body": body or {}})
        self._sock().send_multipart(frames, copy=False)
        return rid

    def receive(self, rid: str, op: str, deadline: float):
        """Wait for the reply to ``rid``; raise on timeout or on a remote error."""
        sock = self._sock()
        waited_from = time.monotonic()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(min(remaining, 1.0) * 1000):
                if time.monotonic() < deadline:
                    self._check_alive(op)
                    continue
                self._check_alive(op)
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

    def _check_alive(self, op):
        if self.liveness is not None:
            why = self.liveness()
            if why:
                self.reset()
                raise PeerDiedError(f"{self.name} at {self.address} is gone ({why}) while waiting "
                                    f"for the reply to {op}")

    def call(self, op: str, body: dict | None = None, *, timeout: float | None = None,
             rid: str | None = None):
        """Send one request and wait for its reply."""
        timeout = self.timeout if timeout is None else timeout
        rid = self.send(op, body, rid)
        return self.receive(rid, op, time.monotonic() + timeout)


def call_many(calls: list[tuple], *, timeout: float | None = None,
              raise_first: bool = True) -> list:
    """Send every request at once, then wait for all replies (one round trip per peer).

    Waits for every peer before raising the first failure, so a caller's cleanup never
    races a peer that is still working. With ``raise_first=False`` exceptions are
    returned in place of results.
    """
    sent = []
    for call in calls:
        peer, op, body = call[:3]
        rid = call[3] if len(call) > 3 else None  # a fixed ID makes a retry idempotent
        sent.append((peer, op, peer.send(op, body, rid)))
    results: list = []
    start = time.monotonic()
    for peer, op, rid in sent:
        t = peer.timeout if timeout is None else timeout
        try:
            results.append(peer.receive(rid, op, start + t))
        except Exception as exc:  # collected; raised after every peer answered
            results.append(exc)
    if raise_first:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results
