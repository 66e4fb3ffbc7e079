"""A library's internal constructor, taken only where it gives what the public call gives.

Building a get's result goes through torch's and tensordict's public calls, which check and
normalise what the client already knows to be right: for a one-row get that is a third of
the time spent on the result. Their internal constructors skip it, but are no API: a new
release may change them. A :class:`Shortcut` therefore checks at its first call that the
internal constructor gives what the public call gives on the versions installed; only then,
and only while it does not raise, is it taken (:mod:`tqtx.client.nested`,
:mod:`tqtx.client.batches`).
"""
from __future__ import annotations

from typing import Callable


class Shortcut:
    """``shortcut(*args)``: ``direct(*args)`` if ``agree(direct, public)`` held at the first
    call, else (or if ``direct`` raises) ``public(*args)``, whose result or error the caller
    gets. ``taken``: None before the first call, then whether ``direct`` is used."""

    __slots__ = ("direct", "public", "agree", "taken")

    def __init__(self, direct: Callable, public: Callable,
                 agree: Callable[[Callable, Callable], bool]):
        self.direct, self.public, self.agree = direct, public, agree
        self.taken: bool | None = None

    def usable(self) -> bool:
        """Whether ``direct`` gives what ``public`` gives here (False if the check raises)."""
        try:
            return bool(self.agree(self.direct, self.public))
        except Exception:
            return False

    def __call__(self, *args):
        if self.taken is None:
            self.taken = self.usable()
        if self.taken:
            try:
                return self.direct(*args)
            except Exception:
                pass  # the public call then succeeds or raises the error the caller should see
        return self.public(*args)
