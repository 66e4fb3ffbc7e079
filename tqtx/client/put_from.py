"""Same-host puts: units read the rows of a put's tensor columns out of this process's
memory (``PUT_ROWS`` with ``from``, :meth:`tqtx.wire.shm.ReplyFiles.read_from`) instead of
receiving them as ZeroMQ frames: each byte is copied once, by the units in parallel, and
the client sends a header of addresses instead of thousands of frames.

A unit's request goes this way when the client has a same-host inbox (the proof a unit
checks), the platform has ``process_vm_readv``, Yama does not restrict ptrace, the unit
has not refused before, and the request carries at least ``MIN_BYTES`` of tensor rows (a
small put is cheaper inline). A unit that refuses (another host, the kernel says no)
stores nothing; its rows then go as frames, and later puts send it frames at once.
``TQTX_PUT_FROM=off`` turns the path off.
"""
from __future__ import annotations

import logging

import numpy as np

from ..wire import shm, vmcopy
from ..wire.rpc import new_id
from ..wire.values import TensorColumn
from .tensors import TensorRows

log = logging.getLogger("tqtx.client")

MIN_BYTES = shm.MIN_BYTES
FEW_ROWS = 32


def hint(client) -> dict | None:
    """The inbox hint a same-host put names, or None if this client's puts send frames."""
    if client.put_from_off is None and not client.put_from_checked:
        client.put_from_checked = True  # once per client: a put cannot afford a file read
        client.put_from_off = vmcopy.refusal("TQTX_PUT_FROM", "reading the memory of")
    if client.put_from_off is not None:
        return None
    inbox = client.reply_inbox()
    return None if inbox is None else inbox.hint_for(new_id())


def by_address(client, unit: int, req: dict, inbox: dict, columns: dict,
               positions: list) -> dict:
    """``req`` (a PUT_ROWS of frames: the rows at ``positions`` of the put's ``columns``)
    with its TensorColumns named by address for the unit to read, if it is worth it and
    ``unit`` has not refused; else ``req`` itself."""
    if unit in client.put_from_refused:
        return req
    fields = [f for f, c in req["cols"].items() if type(c) is TensorColumn]
    # a few rows are summed one by one: a small put does no numpy work for its addresses
    few = len(positions) <= FEW_ROWS
    pos = None if few else np.asarray(positions, dtype=np.int64)
    where = {f: columns[f].where() if type(columns[f]) is TensorRows and not few else None
             for f in fields}
    nbytes = 0
    for f in fields:
        nbytes += (int(where[f][1][pos].sum()) if where[f] is not None
                   else sum(memoryview(r.data).nbytes for r in req["cols"][f].rows))
    if nbytes < MIN_BYTES:
        return req
    cols, read = dict(req["cols"]), {}
    for f in fields:
        rows = req["cols"][f].rows
        cols[f] = None  # the unit fills it in, keeping the fields' order
        read[f] = [rows[0].dtype, [r.shape for r in rows],
                   (where[f][0][pos].tobytes() if where[f] is not None
                    else vmcopy.addresses([r.data for r in rows]).tobytes())]
    return {**req, "cols": cols, "from": {"hint": inbox, "cols": read}}


def refused(client, sent: dict, replies: dict) -> dict:
    """The requests (unit -> PUT_ROWS of frames, from ``sent``) to send again because their
    unit could not read this process's memory; such a unit gets frames from now on."""
    again = {}
    for u, reply in replies.items():
        reason = reply.get("from_failed")
        if reason is not None:
            if u not in client.put_from_refused:
                log.info("puts send rows to unit %d as frames: %s", u, reason)
            client.put_from_refused[u] = reason
            again[u] = sent[u]
    return again
