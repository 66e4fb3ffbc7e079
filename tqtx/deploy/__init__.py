"""Starting a deployment and attaching to one (no torch).

* :mod:`.local` -- :class:`LocalDeployment`: one controller and N storage-unit processes as
  children of this one, started, watched and stopped.
* :mod:`.owner` -- create-or-attach: the creation lock ``init.lock`` and the owner record
  ``deployment.json`` that lets every process of a job share one deployment.
* :mod:`.initconfig` -- the config ``tq.init(config)`` takes (tqtx's or TransferQueue's).

The process plumbing the servers share with this package (command lines, the ready
announcement, the parent watch) is :mod:`tqtx.process.servers`; Ray placement is
:mod:`tqtx.placement`.
"""
from __future__ import annotations

from .local import LocalDeployment

__all__ = ["LocalDeployment"]
