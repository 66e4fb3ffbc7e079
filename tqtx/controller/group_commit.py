"""Group commit of the metadata journal (durability ``sync``): a request that changed the
journal is answered once that change is fsynced, and the requests of one loop turn share
that fsync.

Each change is committed at once without an fsync (``synchronous=NORMAL``: a crash of the
process loses nothing, the other requests see it at once); a request answered while the
journal holds changes not yet durable gets a deferred reply -- a read too, since it may
have seen them: a key a reader was shown must not vanish in a power loss, nor a cleared
one come back. At the end of the loop turn (every request read in it handled) one durable
cut (:meth:`MetaJournal.cut`: a commit under ``synchronous=FULL``, which fsyncs the WAL
holding every earlier commit) makes them all durable, then their replies go; if the cut
fails, each gets its error. With one writer this is the one fsync per put it always was;
with many, one per turn instead of one per request.
"""
from __future__ import annotations

import logging
from typing import Callable

from ..journal.meta import MetaJournal
from ..wire.rpc import Deferred, Server

log = logging.getLogger("tqtx.controller")


class GroupCommit:
    """Replies held until the journal changes of their requests are durable (see above)."""

    def __init__(self, server: Server, metajournal: MetaJournal):
        self.server, self.metajournal = server, metajournal
        self._waiting: list[tuple[Deferred, object]] = []
        server.turn_hooks.append(self.cut)

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` (a request handler) whose reply waits for the next cut when the journal
        holds changes that are not durable yet (its own, or ones it may have read)."""
        server, journal = self.server, self.metajournal

        def handler(body, req):
            reply = fn(body, req)
            return server.hold(req, reply, self._wait) if journal.dirty else reply
        return handler

    def _wait(self, deferred: Deferred, reply) -> None:
        self._waiting.append((deferred, reply))

    def cut(self) -> None:
        """The loop's turn hook: one fsync for every change committed so far, then the
        replies that waited for it (each gets the error if the cut failed)."""
        if not self.metajournal.dirty:
            return
        waiting, self._waiting = self._waiting, []
        error = None
        try:
            self.metajournal.cut()
        except Exception as exc:  # noqa: BLE001 - the waiting requests get it
            log.error("the metadata journal could not be made durable: %r", exc)
            error = exc
        for deferred, reply in waiting:  # this is the loop thread: sent at once
            if error is None:
                deferred.reply_on_loop(reply)
            else:
                deferred.reply_on_loop(error=error)
