"""The put path: ALLOC (controller), PUT_ROWS (the owning units, in parallel), COMMIT_PUT;
a small put of keys the client believes new skips ALLOC through its lease
(:mod:`tqtx.client.lease`).

Every row is written at the generation ALLOC gave it: a unit refuses an older generation
than the row it holds (the key was cleared and its index given to another key meanwhile),
and COMMIT_PUT refuses keys that no longer hold their generation: the put came before that
clear, and only keys that were never visible are put again from ALLOC
(:mod:`tqtx.client.fence`; :func:`_put_all` says which).
"""
from __future__ import annotations

from .. import faults, routing
from ..errors import JournalWriteError, PeerDiedError, PutPartlyAppliedError
from . import put_from
from .fence import FENCE_ATTEMPTS, fence_pause, stale_keys_error
from ..wire.rpc import new_id
from ..wire.values import TensorColumn

# What a put whose COMMIT_PUT got no reply tells its caller.
_COMMIT_UNSURE = ("its rows are on the units but its commit may not have been applied: put "
                  "the keys again (the same put twice has the effect of one) or see kv_list")
# What a put whose COMMIT_PUT the controller could not journal (a full disk) tells its
# caller: the controller rolled the commit back, and the put abandons its new keys.
_COMMIT_NOT_JOURNALED = ("not committed: no new key of it was stored; a key that existed "
                         "already reads the values this put wrote (from its PUT_ROWS on), "
                         "with its earlier tags and fields; put the keys again once the "
                         "journal can be written")
# Only a controller found gone is waited for: one that is alive but slow (a timeout)
# is reported as before.
_CONTROLLER_LOST = (PeerDiedError,)
# Sends of one COMMIT_PUT (the first included) to a controller that keeps going away;
# each waits for the controller to come back first (Client.await_controller, bounded).
COMMIT_SENDS = 8


class _ControllerRestarted(Exception):
    """An ALLOC met a new controller incarnation (which forgot it), or the controller went
    away again while it was sent once more: the put is redone from ALLOC (nothing of it is
    visible before its commit). ``args[0]``: the step (ALLOC)."""


def put_columns(client, keys: list[str], pid: str, columns: dict[str, list],
                schemas: dict[str, dict], tags: list | None, *, with_tags: bool = False):
    """Store rows (columns of per-row values) for ``keys``; returns the common fields
    (``with_tags``: and every key's tags as stored by this put, ``(fields, tags)``)."""
    fields, stored = _put_all(client, keys, pid, columns, schemas, tags, with_tags)
    if not with_tags:
        return fields
    # A key cleared while the put ran is not stored again: it gets the tag it was given.
    return fields, [stored.get(k, (tags[i] if tags else None) or {}) for i, k in enumerate(keys)]


def _put_all(client, keys, pid, columns, schemas, tags, with_tags) -> tuple[list, dict]:
    """Store rows (columns of per-row values) for ``keys``: ``(common fields, {key: tag as
    stored})`` (tags only ``with_tags``).

    ALLOC, PUT_ROWS to the units, COMMIT_PUT. A key's new value is visible from its
    PUT_ROWS on (that is the put's moment for it); the commit publishes new keys, new
    fields and the tags. Then:

    * A key that existed at ALLOC and was cleared (or cleared and put again) before the
      commit: the put came before that clear; it is not written again (its rows, if they
      were refused or became orphans, are dropped where they still hold its generation).
    * A key that was new (pending) at ALLOC and was abandoned meanwhile (a concurrent put
      of the same new key failed): its rows were never visible; the put of that key is
      redone from ALLOC (at most FENCE_ATTEMPTS times). A new key that a concurrent put of
      it committed, and a clear then removed, was visible: that clear came after this put,
      as for a key that existed.
    * The controller went away: it is waited for (:meth:`Client.await_controller`) and
      asked again by request ID. A new process that replaced it gets an ALLOC once more
      from the start; it answers a COMMIT_PUT the last one journaled with its recorded
      reply, and otherwise commits the keys that still hold their generations (their
      rows are on the units) and names the keys that were new for the put to do again
      (it never knew them: pending keys are not journaled). A COMMIT_PUT is asked again of
      each controller that comes back, never redone from ALLOC: a redo could write again
      a key that the lost commit had made visible, after other writes since.

    Unit and validation errors are never retried; a put that fails leaves no row of a new
    key on any unit. A put that committed some keys and then failed raises
    PutPartlyAppliedError naming both sets."""
    what = f"putting {len(keys)} key(s) in partition {pid!r}"
    stored: dict = {}
    fields = _put_leased(client, keys, pid, columns, schemas, tags, what, with_tags, stored)
    if fields is not None:
        return fields, stored
    todo = list(range(len(keys)))  # positions of the keys still to put
    write = None  # positions (within todo) whose rows must be written; None: all
    done: list[str] = []
    common = None
    restarted = 0
    for attempt in range(FENCE_ATTEMPTS):
        if len(todo) == len(keys):  # the whole put (no copy of its columns)
            sub_keys, sub_cols, sub_tags = keys, columns, tags
        else:
            sub_keys = [keys[i] for i in todo]
            sub_cols = {f: [c[i] for i in todo] for f, c in columns.items()}
            sub_tags = None if tags is None else [tags[i] for i in todo]
        try:
            fields, redo, nbytes = _put_once(client, sub_keys, pid, sub_cols, schemas,
                                             sub_tags, what, write, with_tags, stored)
        except _ControllerRestarted:
            restarted += 1
            if restarted == 2:
                raise _failed(PeerDiedError(
                    f"the controller at {client.address} restarted twice while {what}; none "
                    f"of its keys is committed by this call: put them again"), done, sub_keys)
            write = None  # an ALLOC's controller came back new: the whole put again
            continue
        except BaseException as exc:
            raise _failed(exc, done, sub_keys) from None
        client.count("puts", len(sub_keys) - len(redo), nbytes)
        client.lease.remember(pid, sub_keys)
        if fields is not None:  # the fields common to the keys this attempt committed
            common = set(fields) if common is None else common & set(fields)
        if not redo:
            return sorted(common or ()), stored
        done += [k for j, k in enumerate(sub_keys) if j not in set(redo)]
        todo, write = [todo[j] for j in redo], None
        if attempt + 1 < FENCE_ATTEMPTS:
            fence_pause(attempt + 1)
    raise _failed(stale_keys_error(what, [keys[i] for i in todo], pid), done,
                  [keys[i] for i in todo])


def _failed(exc: BaseException, done: list[str], failed: list[str]) -> BaseException:
    """``exc``, or PutPartlyAppliedError if keys of the put were committed before it."""
    if not done:
        return exc
    return PutPartlyAppliedError(
        f"kv_batch_put: keys {done[:10]} were stored, but storing {failed[:10]} then failed: "
        f"{type(exc).__name__}: {exc}", stored=done, failed=failed)


def _put_step(client, op: str, body: dict, incarnation, what: str, outcome: str):
    """One controller request of a put, sent to controller ``incarnation``; raises
    _ControllerRestarted if an ALLOC's controller came back as another incarnation (or
    went away twice). A COMMIT_PUT is sent again, with its request ID, to every controller
    that comes back (COMMIT_SENDS sends in all, then PeerDiedError saying ``outcome``),
    never given up for a redo of the put."""
    rid = new_id()
    try:
        return client.controller.call(op, body, rid=rid)
    except _CONTROLLER_LOST:
        topo = client.await_controller(what, outcome=outcome)
    except JournalWriteError as exc:
        if op != "COMMIT_PUT":
            raise
        raise JournalWriteError(exc.errno, f"{exc.strerror}; {what}: {_COMMIT_NOT_JOURNALED}",
                                exc.filename) from None
    if op != "COMMIT_PUT":
        if incarnation is None or topo.get("incarnation") != incarnation:
            raise _ControllerRestarted(op)
        try:  # the same process: its reply cache answers if it acted on the first copy
            return client.controller.call(op, body, rid=rid)
        except _CONTROLLER_LOST:
            raise _ControllerRestarted(op) from None
    # Whether a controller that went away applied the commit is known only to the journal:
    # a new one answers a COMMIT_PUT the last one journaled with that reply
    # (tqtx.journal.meta); else it commits the keys still at their generations, and names
    # the keys that were new (pending keys are not journaled) for the put to do again
    # (COMMIT_PUT's redo). A redo of the put from ALLOC instead could write a key that the
    # lost commit had made visible a second time, after writes made since (a checkpoint
    # load, a put of another client): so the commit is asked again until a controller
    # answers it.
    for sent in range(2, COMMIT_SENDS + 1):
        try:
            return client.controller.call(op, body, rid=rid)
        except _CONTROLLER_LOST:
            if sent == COMMIT_SENDS:
                raise PeerDiedError(f"the controller at {client.address} went away {sent} "
                                    f"times while {what}; {outcome}") from None
            client.await_controller(what, outcome=outcome)


def _put_once(client, keys, pid, columns, schemas, tags, what, write, with_tags,
              stored: dict) -> tuple:
    """One ALLOC, PUT_ROWS (of the rows at positions ``write``, None: all), COMMIT_PUT;
    returns ``(common fields, positions to redo, bytes written)``; with ``with_tags`` the
    committed keys' tags go into ``stored``."""
    body = {"partition_id": pid, "keys": keys, "schemas": schemas}
    want = client.lease.wanted()
    if want:
        body["lease"] = want
    alloc = _put_step(client, "ALLOC", body, client.controller_incarnation, what,
                      "none of its keys was stored or committed")
    faults.hit("client.put.after_alloc")
    topology = alloc.get("topology")
    incarnation = None if topology is None else topology >> 32
    if alloc.get("lease"):
        client.lease.add(alloc["lease"], incarnation)
    indexes, gens, pending = alloc["indexes"], alloc["gens"], alloc["pending"]
    try:
        nbytes, refused = _write_rows(client, indexes, gens, columns, write)
        faults.hit("client.put.before_commit")
        res = _put_step(client, "COMMIT_PUT", {"partition_id": pid, "keys": keys,
                                               "fields": list(columns), "tags": tags,
                                               "gens": gens, "want_tags": with_tags},
                        incarnation, what, _COMMIT_UNSURE)
    except BaseException:
        _abandon_put(client, pid, keys, gens)
        raise
    stored.update(res.get("tags") or {})
    stale = set(res.get("stale") or ())
    if refused:  # a unit held a newer key at the index: the key had moved (see above)
        stale.update(k for k, i in zip(keys, indexes) if i in refused)
    if not stale:
        return res["fields"], [], nbytes
    # Rows written for keys that moved are dropped (only where they still hold the
    # generation this put wrote); keys that were new and whose creation was abandoned
    # (never visible) are put again. A new key that a concurrent put of it committed was
    # visible with this put's rows, so a clear since came after this put: not put again.
    client.drop_rows([(i, g) for k, i, g in zip(keys, indexes, gens) if k in stale])
    redo = set(res.get("redo") or ())
    committed = len(set(keys) - stale) > 0
    return (res["fields"] if committed else None,
            [j for j, k in enumerate(keys) if k in redo and pending[j]], nbytes)


def _write_rows(client, indexes, gens, columns, write) -> tuple[int, set]:
    """PUT_ROWS of the rows at positions ``write`` (None: all) to their units: ``(bytes
    written, indexes a unit refused as stale)``. A tensor field's rows travel under one
    header per unit (TensorColumn), or a unit on this host reads them from this process's
    memory (:mod:`tqtx.client.put_from`)."""
    if not columns:
        return 0, set()
    tensor = {f: TensorColumn.of_rows(c) is not None for f, c in columns.items()}
    per_unit: dict[int, dict] = {}
    positions: dict[int, list] = {}
    for u, pos in routing.by_owner(indexes, client.num_units).items():
        if write is not None:
            pos = [i for i in pos if i in write]
            if not pos:
                continue
        positions[u] = pos
        cols = {}
        for f, c in columns.items():
            rows = [c[i] for i in pos]
            cols[f] = TensorColumn(rows[0].dtype, rows) if tensor[f] else rows
        per_unit[u] = {"idx": [indexes[i] for i in pos], "cols": cols,
                       "gens": [gens[i] for i in pos]}
    if not per_unit:
        return 0, set()
    where = put_from.hint(client) if any(tensor.values()) else None
    sent = per_unit if where is None else {
        u: put_from.by_address(client, u, req, where, columns, positions[u])
        for u, req in per_unit.items()}
    try:
        replies = client.fan_out("PUT_ROWS", sent)
    except BaseException:
        if where is not None:  # a unit that timed out may still be reading these rows
            client.unsettled_results.append(columns)
        raise
    again = put_from.refused(client, per_unit, replies) if where is not None else None
    if again:
        replies.update(client.fan_out("PUT_ROWS", again))
    return (sum(r.get("bytes", 0) for r in replies.values()),
            {i for r in replies.values() for i in r.get("stale", ())})


def _put_leased(client, keys, pid, columns, schemas, tags, what, with_tags, stored):
    """The put of ``keys`` through the client's lease (:mod:`tqtx.client.lease`): PUT_ROWS
    at leased indexes, then COMMIT_PUT naming them. Returns the common fields, or None when
    the put must go through ALLOC instead (no lease for it, or the controller refused it:
    a key exists, or the lease is gone); the rows it wrote are dropped first."""
    if client.controller.gone():  # ALLOC's path fails first, saying nothing was stored
        return None
    lease = client.lease.take(pid, keys, client.controller_incarnation)
    if lease is None:
        return None
    indexes, gens = lease
    rows = list(zip(indexes, gens))
    try:
        try:
            nbytes, refused = _write_rows(client, indexes, gens, columns, None)
        except PeerDiedError:
            # A unit gone, or restarted at another address: ALLOC's reply carries the
            # topology to follow (and the same error if the unit stays gone). Nothing is
            # committed: the rows written elsewhere are dropped.
            _drop_quietly(client, rows)
            return None
        if refused:  # a checkpoint load replaced the rows: the lease is gone
            client.drop_rows(rows)
            return None
        faults.hit("client.put.before_commit")
        res = _put_step(client, "COMMIT_PUT", {
            "partition_id": pid, "keys": keys, "fields": list(columns), "tags": tags,
            "gens": gens, "want_tags": with_tags, "leased": [indexes, gens],
            "schemas": schemas}, None, what, _COMMIT_UNSURE)
    except BaseException:
        _abandon_put(client, pid, keys, gens)
        raise
    if res.get("lease_refused"):
        client.drop_rows(rows)
        return None
    if res.get("stale"):  # cleared (or created again) since the commit made them pending:
        # impossible in the one turn of the controller that commits them, but never wrong
        client.drop_rows([(i, g) for k, i, g in zip(keys, indexes, gens) if k in res["stale"]])
        return None
    stored.update(res.get("tags") or {})
    client.count("puts", len(keys), nbytes)
    client.lease.remember(pid, keys)
    return res["fields"]


def _drop_quietly(client, rows) -> None:
    try:
        client.drop_rows(rows)
    except Exception:  # noqa: BLE001 - best effort: a unit gone holds nothing to drop
        pass


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
