"""A stand-in for the server loop's ``after_reply`` in tests that call handlers directly."""
from __future__ import annotations


class AfterReply:
    """The server's after_reply as its loop runs it: queued by the handler, run once it
    has returned (:meth:`run`)."""

    def __init__(self):
        self.queued = []

    def after_reply(self, fn):
        self.queued.append(fn)

    def run(self):
        fns, self.queued = self.queued, []
        for fn in fns:
            fn()
