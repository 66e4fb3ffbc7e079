"""Request/reply over ZeroMQ, the server side: a ROUTER loop dispatching requests to handlers.

Every request is ``[header, *tensor_frames]`` where the header decodes to
``{"op", "rid", "body"}``; every reply is ``{"rid", "ok", "result"|"error"}``.
Errors travel as ``{"type", "message", "data"}`` and are re-raised client-side as
the matching exception type (:mod:`tqtx.wire.errors`). Handlers may defer their reply to a
worker thread. The client side is :mod:`tqtx.wire.peer`.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from typing import Callable

import zmq

from .. import faults
from ..errors import ControllerRecoveringError, RestorePendingError, StaleRowsError
from ..process.logutil import Throttle, log_throttled
from ..metrics import Metrics, frames_nbytes
from .codec import CodecError, decode, encode
from .errors import error_payload
from .id_records import IdRecords

log = logging.getLogger("tqtx.rpc")

DEFAULT_TIMEOUT = float(os.environ.get("TQTX_TIMEOUT", "300"))
_REPLY_CACHE_SIZE = 4096
_REPLY_SLOT_BYTES = 256  # a mutating request's usual reply header is 60-120 bytes
# A request failing with the same OSError (a full disk) is logged once per this many s.
IO_ERROR_LOG_EVERY = float(os.environ.get("TQTX_IO_ERROR_LOG_EVERY", "60"))


class ReplyCache:
    """The recorded replies of the last ``_REPLY_CACHE_SIZE`` mutating requests, by request
    ID, in an :class:`~.id_records.IdRecords` (no long-lived object per entry): a one-frame
    reply (all but a dump's index) as its bytes, a longer one as its frame list."""

    def __init__(self, size: int = _REPLY_CACHE_SIZE):
        self._records = IdRecords(size, _REPLY_SLOT_BYTES)

    def get(self, rid: str) -> list | None:
        got = self._records.get(rid)
        return got if got is None or type(got) is list else [got]

    def put(self, rid: str, frames: list) -> None:
        self._records[rid] = frames[0] if len(frames) == 1 else frames


def _context() -> zmq.Context:
    """The process's ZeroMQ context; two I/O threads so a client receiving from several
    units (or a unit serving and calling the controller) moves bytes on both cores."""
    return zmq.Context.instance(io_threads=IO_THREADS)


IO_THREADS = int(os.environ.get("TQTX_IO_THREADS", "2"))
LINGER_MS = 1000  # what a closing socket may still spend sending its last messages


def close_context() -> None:
    """Close every socket of the process's context (each sends what it still holds, up to
    LINGER_MS) and end the context: a process about to ``os._exit`` calls it so its last
    replies leave."""
    _context().destroy(linger=LINGER_MS)


def new_id() -> str:
    """A fresh request/operation ID: 128 random bits as 32 hex digits (uuid4's form without
    its version bits, at a fifth of its cost: every request makes one)."""
    return os.urandom(16).hex()


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

    def reply_on_loop(self, result=None, error: BaseException | None = None) -> None:
        """:meth:`reply` from the server's own loop thread: sent at once, without a
        wake-up and another turn of the loop."""
        self._server._deliver(self._ident, self._rid, self._op, self._cache, result, error,
                              self._timing)


# pyzmq's send_multipart / recv_multipart do flag arithmetic on IntFlag enums per frame
# (about 8 and 2 us a frame): a put of 7,680 rows is 20k frames. Plain ints instead.
_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock, frames: list) -> None:
    """Send ``frames`` as one multipart message, each without a copy (pyzmq still copies
    frames under its copy threshold)."""
    send, last = sock.send, len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, _SNDMORE if i < last else 0, copy=False)


def recv_frames(sock, flags: int = 0) -> list:
    """Receive one multipart message as zmq Frames (``flags``: e.g. ``zmq.NOBLOCK``)."""
    recv = sock.recv
    frame = recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = recv(0, copy=False)
        frames.append(frame)
    return frames


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
        self._cache = ReplyCache()
        self._pending: dict[str, bool] = {}
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # call_soon() work for the loop
        self._after_reply: list[Callable[[], None]] = []
        # run at the end of every loop turn (and so at least every poll_ms when idle)
        self.turn_hooks: list[Callable[[], None]] = []
        self._wake_addr = f"inproc://tqtx-wake-{uuid.uuid4().hex}"
        self._wake = self.context.socket(zmq.PULL)
        self._wake.bind(self._wake_addr)
        self._wake_local = threading.local()
        self._stop = False
        role, _, suffix = name.partition("-")
        self.metrics = Metrics(role, int(suffix) if suffix.isdigit() else None)
        self.op_labels: dict[str, Callable[[dict], str]] = {}  # op -> metrics label from body
        self._timing: list | None = None
        self._io_errors = Throttle(every=IO_ERROR_LOG_EVERY)

    def add(self, op: str, fn: Callable, *, mutating: bool = False) -> None:
        self.handlers[op] = (fn, mutating)
        self.metrics.declare((op,))

    def stop(self) -> None:
        """Stop the loop at its next turn; wakes it, so a stop (SIGTERM, SHUTDOWN) does
        not wait out the loop's idle poll (up to ``poll_ms``)."""
        self._stop = True
        try:
            self._wake_up()
        except zmq.ZMQError:  # the loop already closed its wake socket
            pass

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the loop thread at its next turn, before it reads more requests.

        Callable from any thread, also before the loop starts (it runs on the first
        turn); never runs once the loop has stopped. An exception in ``fn`` is logged."""
        self._calls.put(fn)
        self._wake_up()

    def after_reply(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` (loop thread, from a handler) once the current request's reply is
        sent and before the next request is read: work whose result the caller does not
        wait for, which still sees the state exactly as the handler did. An exception in
        ``fn`` is logged."""
        self._after_reply.append(fn)

    def _run_after_reply(self) -> None:
        fns, self._after_reply = self._after_reply, []
        for fn in fns:
            try:
                fn()
            except Exception:
                log.exception("%s: after-reply call %r failed", self.name, fn)

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn = self._calls.get_nowait()
            try:
                fn()
            except Exception:
                log.exception("%s: deferred call %r failed", self.name, fn)

    # called from worker threads
    def _post(self, ident, rid, op, cache, result, error, timing=None):
        self._posted.put((ident, rid, op, cache, result, error, timing))
        self._wake_up()

    def prepare_thread(self) -> zmq.Socket:
        """This thread's socket to wake the loop with (made at its first wake-up unless
        called before: a worker thread calls it as it starts, so that what it keeps for
        its life is made then, not in the middle of a burst of rows)."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._wake_local.sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._wake_addr)
        return sock

    def _wake_up(self) -> None:
        sock = self.prepare_thread()
        try:
            # never blocks: with the loop stopped (no reader) a blocking send would hang this
            # worker, and the process's shutdown waiting for it; a full queue is awake anyway
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _send(self, ident: bytes, frames: list) -> None:
        try:
            send_frames(self.socket, [ident, *frames])
        except zmq.ZMQError as exc:  # peer gone; nothing to do
            log.debug("%s: reply not sent: %s", self.name, exc)

    def remember_reply(self, rid: str, result) -> None:
        """Answer a later copy of mutating request ``rid`` with ``result`` (a reply an
        earlier process serving this address recorded durably, as the controller's
        journal does for CLEAR and COMMIT_PUT)."""
        self._cache.put(rid, self._reply_frames(rid, result, None))

    def _reply_frames(self, rid, result, error) -> list:
        if error is not None:
            return encode({"rid": rid, "ok": False, "error": error_payload(error)})
        try:
            return encode({"rid": rid, "ok": True, "result": result})
        except TypeError as exc:
            return encode({"rid": rid, "ok": False, "error": error_payload(exc)})

    def _finish(self, ident, rid, op, cache, result, error, timing=None) -> None:
        frames = self._reply_frames(rid, result, error)
        self._unpend(rid)
        if cache and rid:
            self._cache.put(rid, frames)
        if timing is not None:  # recorded before the reply leaves: a caller sees its own request
            self._record(timing, frames, error is not None)
        self._send(ident, frames)

    def _unpend(self, rid: str) -> None:
        pending = self._pending
        pending.pop(rid, None)
        if not pending:
            # an empty dict keeps its table, made wherever the last deferred call's insert
            # found room: that would pin its pymalloc pool (docs/performance.md, *Unit memory*)
            pending.clear()

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
                cached = self._cache.get(rid)
                if cached is not None:
                    self._send(ident, cached)
                    if timing is not None:
                        self._record(timing, cached, False)
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
                    self._cache.put(rid, self._reply_frames(rid, result, None))
                raise
            self._finish(ident, rid, op, mutating, result, None, timing)
        except faults.DropReply:
            log.warning("%s: fault point dropped the reply to %s%s", self.name, op, _ids(body))
            if timing is not None:
                self._record(timing, None, False)
        except Exception as exc:  # every failure becomes an error reply; the loop keeps serving
            if isinstance(exc, OSError) and exc.errno is not None:
                # the disk, not the code: one line (a full disk fails every put; its
                # traceback each time would fill the log, on that same disk, too)
                log_throttled(log, self._io_errors, (op, type(exc).__name__, exc.errno),
                              logging.ERROR, "%s: %s failed%s: %s: %s", self.name, op,
                              _ids(body), type(exc).__name__, exc)
            elif not isinstance(exc, (ValueError, TypeError, KeyError, RestorePendingError,
                                      ControllerRecoveringError, StaleRowsError)):
                log.exception("%s: %s failed%s", self.name, op, _ids(body))
            self._finish(ident, rid, op, False, None, exc, timing)

    def _deliver(self, ident, rid, op, cache, result, error, timing) -> None:
        """Send a deferred reply (on the loop thread)."""
        if error is None:
            try:
                faults.hit(f"{self.name.split('-')[0]}.reply.{op}")
            except faults.DropReply as exc:
                if cache and rid:  # the outcome is recorded; only this reply is lost
                    self._cache.put(rid, self._reply_frames(rid, result, None))
                error = exc
            except Exception as exc:
                result, error = None, exc
        if isinstance(error, faults.DropReply):
            self._unpend(rid)
            if timing is not None:
                self._record(timing, None, False)
            return
        self._finish(ident, rid, op, cache, result, error, timing)

    def deferred(self, request: dict, ident: bytes) -> Deferred:
        op = request["op"]
        return Deferred(self, ident, str(request.get("rid") or ""), op, self.handlers[op][1])

    def hold(self, request: dict | None, reply, until: Callable[[Deferred, object], None]):
        """A handler's ``reply`` to the current ``request`` left to ``until(deferred,
        reply)``, which sends it later; returned as is when already deferred, or made for
        a call outside a request (``request`` None)."""
        if request is None or type(reply) is Deferred:
            return reply
        deferred = self.deferred(request, self.current_ident)
        until(deferred, reply)
        return deferred

    def serve_forever(self, poll_ms: int = 200) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        while not self._stop:
            events = dict(poller.poll(poll_ms))
            woken, readable = self._wake in events, self.socket in events
            # Nothing made in one turn may live into the next: made beside its predecessor,
            # each turn's object would land in the same pymalloc pool, and that pool (with its
            # arena) could never empty (docs/performance.md, *Unit memory*).
            events = None
            if woken:
                while True:
                    try:
                        self._wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                self._run_calls()
            while True:
                try:
                    posted = self._posted.get_nowait()
                except queue.Empty:
                    break
                self._deliver(*posted)
            # else the last deferred reply (a dump's index) outlives it
            posted = None
            if readable:
                for _ in range(64):
                    if not self._calls.empty():
                        # a call_soon made before this request was sent runs before it is
                        # read, even when its wake-up reached the poller after the request
                        self._run_calls()
                    try:
                        msg = recv_frames(self.socket, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    ident = self.current_ident = msg[0].bytes  # read by a Deferred
                    self._handle([ident, *msg[1:]])
                    # else the last request's timing, sender and frames stay alive until
                    # the next one
                    self._timing = self.current_ident = ident = msg = None
                    if self._after_reply:
                        self._run_after_reply()
            for hook in self.turn_hooks:
                try:
                    hook()
                except Exception:
                    log.exception("%s: turn hook %r failed", self.name, hook)
        self.socket.close(linger=LINGER_MS)
        self._wake.close(linger=0)
