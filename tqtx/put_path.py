"""The put path: ALLOC (controller), PUT_ROWS (the owning units, in parallel), COMMIT_PUT.

Every row is written at the generation ALLOC gave it: a unit refuses an older generation
than the row it holds (the key was cleared and its index given to another key meanwhile),
and COMMIT_PUT refuses keys that no longer hold their generation; the put is then redone
from ALLOC, as if it had come after the clear (:mod:`tqtx.fence`).
"""
from __future__ import annotations

from . import faults
from .errors import PeerDiedError
from .fence import FENCE_ATTEMPTS, fence_pause, stale_keys_error
from .wire.rpc import new_id

# Only a controller found gone is waited for: one that is alive but slow (a timeout)
# is reported as before.
_CONTROLLER_LOST = (PeerDiedError,)


class _ControllerRestarted(Exception):
    """A put step met a new controller incarnation: the put is redone from ALLOC."""


class _StalePut(Exception):
    """Some keys of a put no longer hold the generation ALLOC gave (cleared, or cleared and
    created again, meanwhile): nothing of the put was committed; it is redone from ALLOC."""

    def __init__(self, keys):
        super().__init__(keys)
        self.keys = keys


def put_columns(client, keys: list[str], pid: str, columns: dict[str, list],
                schemas: dict[str, dict], tags: list | None) -> list[str]:
    """Store rows (columns of per-row values) for ``keys``; returns the common fields.

    ALLOC, PUT_ROWS to the units, COMMIT_PUT. If the controller goes away during the
    put, it is waited for (:meth:`Client.await_controller`): the same controller is asked
    again by request ID; a new one (which forgot the uncommitted ALLOC) gets the whole
    put once more from ALLOC with the same values, which has the same effect as one
    put. So does a put some of whose keys were cleared (or cleared and put again)
    between ALLOC and COMMIT_PUT: the rows it wrote for them are dropped and it is
    redone, as if it had come after the clear (at most FENCE_ATTEMPTS times). Unit and
    validation errors are never retried; a put that fails leaves no row of a new key
    on any unit."""
    what = f"putting {len(keys)} key(s) in partition {pid!r}"
    restarted = 0
    stale: list = []
    for attempt in range(FENCE_ATTEMPTS):
        try:
            return _put_once(client, keys, pid, columns, schemas, tags, what)
        except _ControllerRestarted:
            restarted += 1
            if restarted == 2:
                raise PeerDiedError(
                    f"the controller at {client.address} restarted twice while {what}; none "
                    f"of its keys is committed by this call: put them again") from None
        except _StalePut as exc:
            stale = exc.keys
        if attempt + 1 < FENCE_ATTEMPTS:
            fence_pause(attempt + 1)
    raise stale_keys_error(what, stale, pid)

def _put_step(client, op: str, body: dict, incarnation, what: str, outcome: str):
    """One controller request of a put, sent to controller ``incarnation``; raises
    _ControllerRestarted if the controller came back as another incarnation."""
    rid = new_id()
    try:
        return client.controller.call(op, body, rid=rid)
    except _CONTROLLER_LOST:
        topo = client.await_controller(what, outcome=outcome)
    if incarnation is None or topo.get("incarnation") != incarnation:
        raise _ControllerRestarted(op)
    try:  # the same process: its reply cache answers if it acted on the first copy
        return client.controller.call(op, body, rid=rid)
    except _CONTROLLER_LOST:
        raise _ControllerRestarted(op) from None

def _put_once(client, keys, pid, columns, schemas, tags, what) -> list[str]:
    alloc = _put_step(client, "ALLOC", {"partition_id": pid, "keys": keys, "schemas": schemas},
                           client.controller_incarnation, what,
                           "none of its keys was stored or committed")
    faults.hit("client.put.after_alloc")
    topology = alloc.get("topology")
    incarnation = None if topology is None else topology >> 32
    indexes, gens = alloc["indexes"], alloc["gens"]
    nbytes = 0
    try:
        if columns:
            per_unit: dict[int, dict] = {}
            names = list(columns)
            cols = [columns[f] for f in names]
            n = client.num_units
            for i, idx in enumerate(indexes):
                req = per_unit.get(idx % n)
                if req is None:
                    req = per_unit[idx % n] = {"rows": [], "gens": []}
                req["rows"].append([idx, {f: c[i] for f, c in zip(names, cols)}])
                req["gens"].append(gens[i])
            replies = client.fan_out("PUT_ROWS", per_unit)
            nbytes = sum(r.get("bytes", 0) for r in replies.values())
            refused = {i for r in replies.values() for i in r.get("stale", ())}
            if refused:
                raise _StalePut([k for k, i in zip(keys, indexes) if i in refused])
        faults.hit("client.put.before_commit")
        outcome = ("its rows are on the units but its commit may not have been applied: "
                   "put the keys again (the same put twice has the effect of one) or see "
                   "kv_list")
        try:
            res = _put_step(client, "COMMIT_PUT", {"partition_id": pid, "keys": keys,
                                                "fields": list(columns), "tags": tags,
                                                "gens": gens},
                                 incarnation, what, outcome)
        except KeyError:  # the partition ALLOC created is unknown
            # Sent to a controller restarted since ALLOC (the socket reconnects by
            # itself)? It forgot the uncommitted keys: then the put is redone.
            topo = client.await_controller(what, outcome=outcome)
            if incarnation is not None and topo.get("incarnation") != incarnation:
                raise _ControllerRestarted("COMMIT_PUT") from None
            raise
        if res.get("stale"):
            raise _StalePut(res["stale"])
    except _StalePut as exc:
        # Rows written for keys that moved are dropped (only where they still hold the
        # generation this put wrote); the put's other keys keep theirs for the redo.
        gone = set(exc.keys)
        client.drop_rows([(i, g) for k, i, g in zip(keys, indexes, gens) if k in gone])
        raise
    except _ControllerRestarted:
        raise
    except BaseException:
        _abandon_put(client, pid, keys, gens)
        raise
    client.count("puts", len(keys), nbytes)
    return res["fields"]

def _abandon_put(client, pid: str, keys: list[str], gens: list[int]) -> None:
    """After a put failed: the controller forgets the pending keys it created and their
    rows are dropped from the units, so nothing of it stays. Best effort: a controller
    that is gone forgot them anyway, and its successor has the units drop the rows."""
    try:
        res = client.controller.call("ABORT_PUT", {"partition_id": pid, "keys": keys,
                                                 "gens": gens}, timeout=10)
        client.drop_rows([tuple(p) for p in res["abandoned"]])
    except Exception:  # noqa: BLE001 - the put's own error is what the caller sees
        pass
