"""The user side of the wire: the :class:`Client` that talks to the controller (metadata) and
the units (payload), its request paths, and the conversions and result types of the API.

* :mod:`.client` -- :class:`Client`: routing, fan-out, following a restarted peer.
* :mod:`.put_path`, :mod:`.get_path`, :mod:`.fence` -- a put, a get, and their retries when
  a row moved; :mod:`.result_layout` -- where a same-host get's rows land.
* :mod:`.tensors` -- torch/tensordict batches to and from the wire values (imports torch;
  nothing else here does at import time, so ``import tqtx.client`` stays torch-free);
  :mod:`.semantics` -- which results the KV calls give.
* :mod:`.kvmeta`, :mod:`.batchmeta` -- TransferQueue's ``KVBatchMeta`` and ``BatchMeta``.

Nothing here imports :mod:`tqtx.api`; the API, the dump/restore paths and the tools build on
this package, and the servers never import it.
"""
from __future__ import annotations

from .client import Client, Column, KVBatchMeta, unpack_column

__all__ = ["Client", "Column", "KVBatchMeta", "unpack_column"]
