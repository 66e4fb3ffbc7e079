"""TransferQueue compatibility beyond the module functions of :mod:`tqtx.api`.

* :mod:`.dataplane` -- the low-level client that ``tq.get_client()`` returns (verl's workers
  call it: ``get_meta``, ``get_data``, ``put``, ``clear_samples`` ...).
* :mod:`.shim` -- the opt-in ``transfer_queue`` package (``tqtx shim install``) with
  TransferQueue's ``config.yaml``.
"""
