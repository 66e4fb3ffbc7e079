"""The controller's KV requests: ALLOC, COMMIT_PUT, LOOKUP, LIST, CLEAR, DESCRIBE, checkpoints,
the end of the buffer.

Each request that changes metadata builds its :class:`~tqtx.journal.meta.MetaChange` first,
writes it to the journal (:meth:`KVRequests.journal_meta`), then changes memory and replies:
a reply that says "done" always follows a committed journal transaction, and a failed write
leaves memory as it was.

:class:`tqtx.controller.server.Controller` owns one :class:`KVRequests` and registers its
handlers. A partition an unresolved restore loads into refuses new keys and clears: KV
requests ask the restores through :class:`RestoreGate` only.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from itertools import repeat
from typing import Callable, Protocol

from .. import faults
from .. import states as st
from ..errors import FieldsNotFoundError, KeysNotFoundError, PartitionNotFoundError
from ..journal.meta import (CHECKPOINT_GEN_BASE, CHECKPOINT_KEYS, CHECKPOINT_LOAD,
                            CHECKPOINT_PLAN, MetaChange, MetaJournal)
from ..journal.controller import ControllerJournal
from ..plan import checkpoint_save_requests
from ..process.gcpause import gc_paused
from ..wire import codec
from ..wire.columns import pack_int64
from .lost import lost_keys
from .metadata import EMPTY, GEN_SHIFT, Metadata
from .tags import NO_TAG
from .units import UnitPeers

log = logging.getLogger("tqtx.controller")

# Fault points around every metadata write: controller.meta.<op>.<stage> (checkpoint_keys,
# written after its load's reply, has no before_reply)
META_OPS = ("commit_put", "clear", "checkpoint_replace", "checkpoint_keys", "restore_publish",
            "unit_lost", "end_buffer")
META_STAGES = ("before_commit", "after_commit", "before_reply")
MAX_LEASE = 256  # indexes one ALLOC may lease to a client


def _tag_columns(keys: list[str], key_tags) -> dict:
    """``{"keys", "tags", "tag_of"}`` of LIST's columnar reply, numbering the tag objects by
    identity in C-level passes (they are alive in the metadata, so their ids are theirs)."""
    objs = list(key_tags)
    ids = list(map(id, objs))
    distinct = dict(zip(ids, objs))  # first-seen order
    number = {i: n for n, i in enumerate(distinct)}
    return {"keys": keys, "tags": list(distinct.values()),
            "tag_of": pack_int64(map(number.__getitem__, ids))}


class HeldTags:
    """Tags a background dump's DESCRIBE held by reference, until its thread takes them.

    In memory only: a controller restart in between loses them, and that dump fails
    (unpublished) when it asks. Bounded: at most ``limit`` holds, none older than ``ttl`` s.
    """

    def __init__(self, limit: int = 64, ttl: float = 3600.0):
        self.limit, self.ttl = limit, ttl
        self._held: OrderedDict[str, tuple[float, list]] = OrderedDict()

    def hold(self, dump_id: str, tags: list) -> None:
        now = time.monotonic()
        self._held.pop(dump_id, None)
        self._held[dump_id] = (now, tags)
        while self._held:
            oldest_id, (since, _) = next(iter(self._held.items()))
            if len(self._held) <= self.limit and now - since <= self.ttl:
                break
            del self._held[oldest_id]
            log.warning("dump %s: dropped its held tags (not taken within %.0f s, or over "
                        "%d holds)", oldest_id, self.ttl, self.limit)

    def take(self, dump_id: str) -> list:
        held = self._held.pop(dump_id, None)
        if held is None:
            raise KeyError(f"the controller holds no tags for background dump {dump_id} "
                           f"(it restarted since the dump began, or the hold expired); "
                           f"the dump is not published")
        return held[1]

    def __len__(self) -> int:
        return len(self._held)


class RestoreGate(Protocol):
    """What KV requests ask of the restores (:class:`~tqtx.controller.restores.RestoreCoordinator`)."""

    def loading_into(self, pid: str) -> bool:
        """Whether an unresolved restore loads into partition ``pid``."""

    def refuse(self, what: str, pid: str | None = None) -> None:
        """RestorePendingError refusing ``what`` while a restore into ``pid`` (any when None)
        is unresolved."""


def _checkpoint_rows(snap: dict, gen_base: int) -> list:
    """The meta_keys rows of checkpoint ``snap``'s keys, the row at index ``i`` taking
    generation ``gen_base + i`` (as :meth:`Metadata.replace` gives them)."""
    rows = []
    for pid, data in snap["partitions"].items():
        for row in data["rows"]:
            key, idx, fields, tag = row[:4]
            rows.append((pid, key, idx, fields, tag or {}, row[4] if len(row) > 4 else None,
                         gen_base + idx))
    return rows


class CheckpointPlan:
    """A checkpoint load's read plan as journaled: ``[[unit, LOAD_CHECKPOINT body], ...]``,
    packed. Read only when a unit re-registers before it switched (it restarted and
    reads its rows again), so it is decoded then, not on every load."""

    def __init__(self, packed: bytes):
        self.packed = packed
        self._by_unit: dict[int, dict] | None = None

    def for_unit(self, uid: int) -> dict | None:
        if self._by_unit is None:
            self._by_unit = {int(u): load for u, load in codec.unpackb(self.packed)}
        return self._by_unit.get(uid)


class KVRequests:
    """Request handlers for keys and their metadata (no payload), and the checkpoint load
    in progress.

    ``require_units(what)`` raises while a replayed buffer waits for its units;
    ``topology()`` is the current topology incarnation; ``after_reply(fn)`` runs ``fn`` on
    the server's loop once the reply being built has left."""

    def __init__(self, *, meta: Metadata, journal: ControllerJournal, metajournal: MetaJournal,
                 units: UnitPeers, num_units: int, incarnation: int, restores: RestoreGate,
                 require_units: Callable[[str], None], topology: Callable[[], int],
                 after_reply: Callable[[Callable[[], None]], None]):
        self.meta, self.journal, self.metajournal = meta, journal, metajournal
        self.units, self.num_units, self.incarnation = units, num_units, incarnation
        self.restores, self.require_units = restores, require_units
        self.topology, self.after_reply = topology, after_reply
        self.held_tags = HeldTags()
        # a load_checkpoint whose switch is open: (load ID, its rows' generation base)
        self.checkpoint_load: tuple[str, int] | None = None
        # and each unit's LOAD_CHECKPOINT body of it: a unit that restarted before it
        # switched reads its rows again (None: the client sent none)
        self.checkpoint_plan: CheckpointPlan | None = None
        self.replace_epoch = 0  # buffer replacements (checkpoint loads, ends) so far
        # the decided checkpoint load whose keys the journal holds as one blob so far:
        # (its metadata, its generation base)
        self.checkpoint_keys: tuple[dict, int] | None = None

    def journal_meta(self, op: str, change: MetaChange) -> None:
        """Write ``change`` (one transaction) with the ``controller.meta.<op>.*`` points;
        a change of keys, schemas or the next index comes after the keys of a checkpoint
        load (:meth:`journal_checkpoint_keys`), one replacing everything instead of them."""
        if self.checkpoint_keys is not None:
            if change.replace:
                self.checkpoint_keys = None  # the blob goes with every other row
            elif change.changes_keys():
                self.journal_checkpoint_keys()
        faults.hit(f"controller.meta.{op}.before_commit")
        self.metajournal.write(change)
        faults.hit(f"controller.meta.{op}.after_commit")

    @gc_paused  # a row tuple per key, no cycles
    def journal_checkpoint_keys(self) -> None:
        """Write the keys of the checkpoint load decided last to meta_keys, one row per key,
        and drop the blob that held them (a no-op when there are none to write).

        The load's decision journals its metadata as one blob (CHECKPOINT_KEYS): writing
        thousands of rows takes longer than the load's other controller work together, so
        it is done after the reply (or by the startup replay). Any later change of keys
        comes after it (:meth:`journal_meta`; a restore's publish through
        :meth:`RestoreCoordinator.before_publish`), so a journal holding the blob holds
        no other key."""
        pending = self.checkpoint_keys
        if pending is None:
            return
        self.checkpoint_keys = None
        try:
            self.journal_meta("checkpoint_keys", MetaChange(
                rows=_checkpoint_rows(*pending), blobs={CHECKPOINT_KEYS: None}))
        except BaseException:
            self.checkpoint_keys = pending  # written before the next change of keys
            raise

    def alloc(self, body, req):
        """Resolve keys to indexes after validating schemas; new keys become pending (not
        visible until COMMIT_PUT)."""
        pid, keys, schemas = body["partition_id"], body["keys"], body.get("schemas") or {}
        self.require_units("ALLOC")
        part = self.meta.partition(pid)
        self.meta.validate_schemas(part, schemas)
        if self.restores.loading_into(pid) and (part is None or any(
                k not in part.keys and k not in part.pending for k in keys)):
            self.restores.refuse(f"creating keys in partition {pid!r}", pid)
        indexes, gens = self.meta.alloc(pid, keys, schemas)
        visible = self.meta.partitions[pid].keys
        out = {"indexes": indexes, "gens": gens, "pending": [k not in visible for k in keys],
               "topology": self.topology()}
        want = body.get("lease")
        if want:  # indexes for the client's next puts of new keys (see commit_put)
            out["lease"] = list(self.meta.grant_lease(min(int(want), MAX_LEASE)))
        return out

    def commit_put(self, body, req):
        """Publish the fields (and merge the tags) of rows the units now hold.

        The fields' schemas were validated and merged by ALLOC, before any unit wrote. With
        ``gens`` (the generations ALLOC gave), keys that no longer hold their generation
        (cleared, or cleared and created again, since ALLOC) are not committed and come back
        as ``stale`` (see :func:`tqtx.client.put_path.put_columns`); those among them that
        were pending and never visible (abandoned, or pending under an earlier controller)
        also as ``redo``: only those may be put again.
        A pending key that a concurrent put of it committed was visible, rows of this put
        included, so its clear came after this put.
        """
        pid, keys, tags = body["partition_id"], body["keys"], body.get("tags")
        gens, stale, redo = body.get("gens"), [], []
        leased = body.get("leased")
        if leased is not None and not self._take_lease(pid, keys, leased, body):
            return {"lease_refused": True}
        if gens is not None:
            stale = self.meta.stale_keys(self.meta.partition(pid), keys, gens)
            if stale:
                moved = set(stale)
                abandoned, mine = self.meta.abandoned, self.incarnation
                # never visible: abandoned here, or pending under a controller that died
                # (pending keys are not journaled, so this one never knew them)
                redo = list(dict.fromkeys(k for k, g in zip(keys, gens) if k in moved and (
                    g in abandoned or g >> GEN_SHIFT != mine)))
                keep = [i for i, k in enumerate(keys) if k not in moved]
                keys = [keys[i] for i in keep]
                tags = None if tags is None else [tags[i] for i in keep]
                if not keys:
                    return {"fields": [], "stale": stale, "redo": redo}
        back = body.get("want_tags") and self._tags_to_send(pid, keys)
        change, updates, common = self.meta.plan_commit(
            pid, keys, body.get("fields") or [], tags)
        out = {"fields": common}
        if stale:
            out["stale"], out["redo"] = stale, redo
        self._record_reply(change, req, out)  # without the tags: they may be large
        self.journal_meta("commit_put", change)
        self.meta.apply_commit(pid, updates, change)
        faults.hit("controller.meta.commit_put.before_reply")
        if back:  # the stored (merged) tags of the keys committed that the client lacks
            out["tags"] = {k: updates[k][2] or {} for k in back}
        return out

    def _tags_to_send(self, pid: str, keys: list[str]) -> list[str]:
        """The keys of a put whose stored tags its client does not know: a key put once
        that held no tag stores the tag this put gave it (the client answers with its
        own, as for a key the reply leaves out), so only the others travel back."""
        part = self.meta.partition(pid)
        if len(set(keys)) != len(keys):
            return keys
        if part is None:
            return []
        tags = part.tags
        return [k for k in keys if tags.get(k)]

    def _take_lease(self, pid: str, keys: list[str], leased, body) -> bool:
        """A put that wrote the rows of keys it believed new at indexes leased by an
        earlier ALLOC (``leased``: their indexes and generations), without an ALLOC of its
        own: the keys become pending there, as ALLOC would have made them, if ALLOC would
        have (all keys new, schemas compatible, no restore loading into the partition) and
        the lease holds; else nothing changes and the client puts them through ALLOC."""
        self.require_units("COMMIT_PUT")
        if self.restores.loading_into(pid):
            return False
        indexes, gens = leased
        return self.meta.take_leased(pid, keys, indexes, gens, body.get("schemas") or {})

    @staticmethod
    def _record_reply(change: MetaChange, req, reply: dict) -> None:
        """Journal ``reply`` with ``change``: a copy of this request resent to the
        controller that replaces this one (its reply lost with this process) is answered
        with it, not applied again after what came since (tqtx.journal.meta)."""
        rid = req.get("rid") if isinstance(req, dict) else None
        if rid:
            change.answered = (rid, codec.packb(reply))

    def abort_put(self, body, req):
        """A put that failed after ALLOC: forget the pending keys it created (those still
        at the generations ALLOC gave), so nothing of it stays; returns their ``[index,
        generation]`` pairs for the client to drop on the units. In memory only (pending
        keys are never journaled)."""
        part = self.meta.partition(body["partition_id"])
        return {"abandoned": self.meta.abandon_pending(part, body["keys"], body["gens"])}

    def lookup(self, body, req):
        """Indexes, fields and schemas of ``keys``. With ``lenient`` (TransferQueue's
        results): unknown keys and fields not produced for every key are left out. Lost rows
        raise RowsLostError either way."""
        pid, keys, select = body["partition_id"], body["keys"], body.get("select_fields")
        lenient = bool(body.get("lenient"))
        if self.checkpoint_load:  # units still switching to a checkpoint: rows not final yet
            self.require_units("LOOKUP")
        part = self.meta.partition(pid)
        if part is None or (lenient and not any(k in part.keys for k in keys)):
            raise KeysNotFoundError(keys, pid)
        if lenient:
            keys = [k for k in keys if k in part.keys]
            if select is not None:
                select = [f for f in select
                          if all(f in part.fields.get(part.keys[k], ()) for k in keys)]
        indexes = part.indexes_of(keys)
        part.check_readable(keys, indexes)
        if select is None:
            common = None
            for idx in indexes:
                f = part.fields.get(idx, set())
                common = set(f) if common is None else common & f
            fields = sorted(common or ())
            fields = [f for f in part.schema if f in set(fields)]
        else:
            fields = list(select)
            for f in fields:
                lacking = [k for k, i in zip(keys, indexes) if f not in part.fields.get(i, ())]
                if lacking:
                    shown = ", ".join(repr(k) for k in lacking[:10])
                    raise FieldsNotFoundError(
                        f"select_fields: field {f!r} not found: it was not produced for keys "
                        f"{shown} in partition {pid!r}")
        return {"indexes": indexes, "gens": part.gens_of(indexes), "fields": fields,
                "keys": keys, "schemas": {f: part.schema[f] for f in fields},
                "num_units": self.num_units, "topology": self.topology()}

    def list_keys(self, body, req):
        """Visible keys with their tags, per partition; keys whose rows were lost are left
        out (``lost``: only those, see :mod:`tqtx.controller.lost`). With ``columnar``:
        ``{"columnar": True, "partitions": {pid: {"keys", "tags", "tag_of"}}}``, each
        distinct tag object once in ``tags`` and ``tag_of`` (packed int64) numbering the
        keys' tags in it (keys given equal tags share one object, Metadata)."""
        pid = body.get("partition_id")
        parts = self.meta.visible()
        if pid is not None:
            parts = [p for p in parts if p.pid == pid]
        if body.get("lost"):
            return lost_keys(parts)
        columnar = bool(body.get("columnar"))
        out = {}
        for p in parts:
            lost, tags = p.lost, p.tags
            keys = [k for k, i in p.keys.items() if i not in lost] if lost else list(p.keys)
            if not keys:
                continue
            key_tags = map(tags.get, keys, repeat(NO_TAG))
            out[p.pid] = _tag_columns(keys, key_tags) if columnar else \
                dict(zip(keys, key_tags))
        return {"columnar": True, "partitions": out} if columnar else out

    def clear(self, body, req):
        pid = body["partition_id"]
        self.restores.refuse(f"clearing partition {pid!r}", pid)
        part = self.meta.partition(pid)
        if part is None:
            return {"freed": [], "gens": []}
        change, gone = self.meta.plan_clear(part, body["keys"])
        freed = part.indexes_of(gone)  # and the generations they held: the reply
        reply = {"freed": freed, "gens": part.gens_of(freed)}
        if gone:
            self._record_reply(change, req, reply)
            self.journal_meta("clear", change)
        self.meta.apply_clear(part, gone)
        faults.hit("controller.meta.clear.before_reply")
        return reply

    # ---------------------------------------------------------------- dump
    def describe_rows(self, body, req):
        """Per key (in request order): global index, produced fields and tag, plus the
        fields' schemas. No payload. Columnar: ``fields_of[i]`` indexes ``field_sets``;
        with ``packed`` both columns are packed (:mod:`tqtx.wire.columns`). With ``hold_tags`` (a dump ID)
        the tags stay here for TAKE_DUMP_TAGS."""
        pid, keys = body["partition_id"], body["keys"]
        part = self.meta.partition(pid)
        if part is None or not part.keys:
            if not keys:
                return {"indexes": [], "gens": [], "field_sets": [], "fields_of": [],
                        "tags": [], "field_schema": {}, "num_units": self.num_units,
                        "topology": self.topology()}
            raise PartitionNotFoundError(f"partition {pid!r} does not exist (not found)")
        indexes = part.indexes_of(keys)
        part.check_readable(keys, indexes)  # a dump must not promise rows no unit holds
        # Field sets are shared frozensets (Metadata.share, hashes cached): C-level passes
        # over the rows, Python work per distinct set only.
        objs = list(map(part.fields.get, indexes, repeat(EMPTY)))
        set_ids = dict.fromkeys(objs)  # distinct by value, in first-seen order
        field_sets: list[list[str]] = []
        for sid, obj in enumerate(set_ids):
            set_ids[obj] = sid
            field_sets.append(sorted(obj))
        used = sorted(set().union(*field_sets)) if field_sets else []
        gens = map(part.gens.__getitem__, indexes)
        if body.get("packed"):  # int64 columns as raw bytes: no per-row msgpack work
            indexes, gens = pack_int64(indexes), pack_int64(gens)
            fields_of = bytes(8 * len(objs)) if len(set_ids) == 1 else \
                pack_int64(map(set_ids.__getitem__, objs))  # one set: all zero
        else:
            gens = list(gens)
            fields_of = [0] * len(objs) if len(set_ids) == 1 else \
                list(map(set_ids.__getitem__, objs))
        out = {"indexes": indexes, "gens": gens, "field_sets": field_sets, "fields_of": fields_of,
               "field_schema": {f: part.schema[f] for f in used}, "num_units": self.num_units,
               "topology": self.topology()}
        hold = body.get("hold_tags")
        if hold:
            # A background dump takes the tags later (TAKE_DUMP_TAGS), off the call path; they
            # are read right after this reply leaves, before any other request can change
            # them (tag dicts are replaced, never changed in place).
            self.after_reply(
                lambda: self.held_tags.hold(hold, list(map(part.tags.get, keys))))
        else:
            out["tags"] = [t or {} for t in map(part.tags.get, keys)]
        return out

    def take_dump_tags(self, body, req):
        """The tags DESCRIBE_ROWS_BY_KEY held for background dump ``dump_id`` (once)."""
        return {"tags": [t or {} for t in self.held_tags.take(body["dump_id"])]}

    def record_dump(self, body, req):
        self.journal.record_dump(incarnation_id=self.incarnation, **body)
        log.info("dump %s: recorded (%s keys, %s bytes, %s shards) for partition %r at %s",
                 body.get("dump_id"), body.get("keys"), body.get("bytes"), body.get("shards"),
                 body.get("partition_id"), body.get("dump_dir"))
        return {"ok": True}

    # ---------------------------------------------------------------- checkpoint
    @gc_paused  # a row list per key, no cycles
    def checkpoint_snapshot(self, body, req):
        """The metadata a checkpoint saves, refused while a restore is unresolved: packed as
        the checkpoint's controller file (``metadata_packed``: the client writes it as is)
        with each unit's SAVE_CHECKPOINT rows (``units``: ``[unit, columns]`` pairs), so
        the client neither decodes nor re-encodes the metadata of every key.
        ``{"check_only": true}``: only the refusal (a checkpoint load asks before it
        stages anything)."""
        self.restores.refuse("save_checkpoint")
        if body.get("check_only"):
            return {}
        meta = self.meta.snapshot()
        return {"metadata_packed": codec.packb(meta), "num_units": self.num_units,
                "epoch": [self.incarnation, self.replace_epoch],
                "keys": sum(len(p["rows"]) for p in meta["partitions"].values()),
                "units": [[u, r] for u, r in
                          checkpoint_save_requests(meta, self.num_units).items()]}

    def checkpoint_check(self, body, req):
        """For a save whose units no longer held some rows at the snapshot's generation:
        whether the buffer was replaced since (a checkpoint load, or a new controller: the
        save starts again), and which of ``rows`` (``[partition, key, generation]``) are
        still there at that generation (their rows were lost: a unit restarted)."""
        if body["epoch"] != [self.incarnation, self.replace_epoch]:
            return {"replaced": True, "lost": []}
        lost = []
        for pid, key, gen in body["rows"]:
            part = self.meta.partition(pid)
            idx = None if part is None else part.keys.get(key)
            if idx is not None and self.meta.gens.get(idx) == gen:
                lost.append([pid, key])
        return {"replaced": False, "lost": lost}

    @gc_paused  # the checkpoint's metadata, decoded: no cycles
    def checkpoint_replace(self, body, req):
        """Replace all metadata with a checkpoint's; with ``load_id`` (the units staged that
        checkpoint) also switch the units to it.

        The checkpoint's rows get generations of this controller: the row at index ``i``
        takes ``gen_base + i``, here and on its unit (APPLY_CHECKPOINT carries the base).
        The journaled metadata, with a ``checkpoint_load`` marker and the units' read plan
        (``unit_loads``: ``[[unit, LOAD_CHECKPOINT body], ...]``), is the decision; then the
        units switch (APPLY_CHECKPOINT) and the marker goes. A controller restarted in
        between finds the marker and rolls the switch forward as units re-register
        (:meth:`Controller.register_unit`); a unit that restarted too, and so holds the load
        neither staged nor applied, reads its rows again by the plan. The decision holds
        the keys as the checkpoint's controller file packs them; they are written row by
        row once the reply has left (:meth:`journal_checkpoint_keys`)."""
        self.restores.refuse("load_checkpoint")
        self.require_units("load_checkpoint")
        # the metadata as the checkpoint's controller file holds it
        packed_meta, load_id = bytes(body["metadata_packed"]), body.get("load_id")
        snap = codec.unpackb(packed_meta)
        gen_base = self.meta.take_gens(self.meta.gen_span(snap))
        change = self.meta.plan_replace(snap)
        change.blobs = {CHECKPOINT_KEYS: codec.packb([gen_base, packed_meta])}
        plan = None
        if load_id:
            change.markers = {CHECKPOINT_LOAD: load_id, CHECKPOINT_GEN_BASE: gen_base}
            # the client packs the plan once (``unit_loads_packed``); it is journaled as is
            packed = body.get("unit_loads_packed")
            if packed is not None:
                plan = CheckpointPlan(bytes(packed))
                change.blobs[CHECKPOINT_PLAN] = plan.packed
            st.check(st.CHECKPOINT_LOAD, st.STAGING, st.DECIDED, subject=f"checkpoint load {load_id}")
        self.journal_meta("checkpoint_replace", change)
        if self.metajournal.enabled:
            self.checkpoint_keys = (snap, gen_base)
            self.after_reply(self.journal_checkpoint_keys)
        if load_id:  # durable before any unit switches (and logs that it did)
            self.metajournal.make_durable()
        self.meta.replace(snap, gen_base)
        self.replace_epoch += 1
        if load_id:
            self.checkpoint_load, self.checkpoint_plan = (load_id, gen_base), plan
            self._switch_units()
        faults.hit("controller.meta.checkpoint_replace.before_reply")
        return {"ok": True}

    def _switch_units(self) -> None:
        """APPLY_CHECKPOINT on every unit; the marker goes once all have switched."""
        load_id, gen_base = self.checkpoint_load
        uids = [u for u in range(self.num_units) if u in self.units]
        results = self.units.call([(u, "APPLY_CHECKPOINT", {"load_id": load_id,
                                                            "gen_base": gen_base})
                                   for u in uids], timeout=60)
        failed = {u: r for u, r in zip(uids, results) if isinstance(r, BaseException)}
        failed.update({u: "not registered" for u in range(self.num_units)
                       if u not in self.units})
        if failed:
            raise RuntimeError(
                "load_checkpoint: the checkpoint's metadata is in place but unit(s) "
                f"{sorted(failed)} did not switch to its rows ({next(iter(failed.values()))}); "
                "their rows are named lost (RowsLostError) when they re-register")
        self.checkpoint_switched()

    def checkpoint_switched(self) -> None:
        """Every unit switched to the open checkpoint load: its marker goes."""
        st.check(st.CHECKPOINT_LOAD, st.DECIDED, st.SWITCHED,
                 subject=f"checkpoint load {self.checkpoint_load[0]}")
        self.journal_meta("checkpoint_replace", MetaChange(
            markers={CHECKPOINT_LOAD: None, CHECKPOINT_GEN_BASE: None},
            blobs={CHECKPOINT_PLAN: None}))
        self.checkpoint_load = self.checkpoint_plan = None

    # ---------------------------------------------------------------- end of the buffer
    def end_buffer(self, body, req):
        """The deployment's owner is closing it: forget every key, here and in the journal."""
        self.restores.refuse("closing the buffer")
        self.journal_meta("end_buffer", MetaChange(replace=True))
        self.meta.drop_all()
        self.replace_epoch += 1
        log.info("buffer ended by its owner: metadata discarded")
        faults.hit("controller.meta.end_buffer.before_reply")
        return {"ok": True}
