"""What the row log's queue holds besides batches of changes (:mod:`tqtx.storage.rowlog`):
waiters for an fsync, a checkpoint's cut, the end of a compaction's batch."""
from __future__ import annotations

import threading


class Compacted:
    """A queue marker after the batch that re-logged the live rows of file ``key``: from
    there on the file holds nothing live (unless ``failed``: the loop could not queue
    them, and the file stays)."""

    __slots__ = ("key", "failed")

    def __init__(self, key: tuple, failed: bool = False):
        self.key, self.failed = key, failed


class Waiter:
    """Waits in the queue for the fsync that covers every change queued before it (a
    deferred reply's stand-in for a caller that blocks)."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def reply(self, result=None, error=None) -> None:
        self.error = error
        self.done.set()

    def wait(self, timeout: float, what: str) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"the row log did not reach {what} in {timeout}s")
        if self.error is not None:
            raise self.error


class Cut(Waiter):
    """A queue marker: seal the open segment here and fsync; :meth:`wait` then gives the
    number of the segment opened after it (every change queued before the cut is in the
    files numbered below it)."""

    def __init__(self):
        super().__init__()
        self.next_segment = 0

    def wait(self, timeout: float = 120.0, what: str = "a checkpoint's cut") -> int:
        super().wait(timeout, what)
        return self.next_segment


def answer(waiter, on_loop: bool, result=None, error=None) -> None:
    """Reply through ``waiter``: from the loop thread at once where it is a request's."""
    reply = getattr(waiter, "reply_on_loop", None) if on_loop else None
    (reply or waiter.reply)(result, error=error)
