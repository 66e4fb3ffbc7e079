"""The controller's metadata: partitions, keys, global indexes, fields, schemas, tags.

Held in memory; every change a client is told succeeded is also described as a
:class:`~tqtx.journal.meta.MetaChange`, which the controller writes to its journal before it
changes memory and replies (``plan_*`` methods build the change, ``apply_*`` carry it out), so
a restarted controller replays exactly what clients were told.

A key is *pending* between ALLOC and COMMIT_PUT (in memory only, never listed or read: a put
that dies half-way leaves nothing visible) and *lost* when the unit that held its row came back
without it (listed, not readable, see :class:`~tqtx.errors.RowsLostError`).

**Generations (the row fence).** Every allocated global index carries the *generation* of the
key incarnation that holds it (:attr:`Metadata.gens`): a number given once, when a key is
created at an index (ALLOC of a new key, a restore's new key, a checkpoint load), and never
given again in the state dir's life -- ``incarnation << GEN_SHIFT`` plus a counter, so a
restarted controller's generations are larger than every earlier one. Overwrites of a key
keep its generation. Units hold each row with its generation and serve, overwrite or drop a
row only for the generation a request names (docs/architecture.md, "The row fence"), so a
request that raced a clear and the index's reuse by another key can never touch that key's
row.
"""
from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from operator import itemgetter

from ..errors import KeysNotFoundError
from ..journal.meta import MetaChange
from ..routing import owner
from ..schema import check_schema_compatible, merge_schema
from .partition import Partition
from .tags import NO_TAG, merge_tag

_INDEX_OF = itemgetter(1)  # a snapshot row's global index (see Metadata.snapshot)

EMPTY: frozenset = frozenset()
# Generations are ``incarnation << GEN_SHIFT | counter``: 2**40 keys per controller
# incarnation, 2**23 incarnations of a state dir in an int64.
GEN_SHIFT = 40
# Abandoned generations remembered (a put's COMMIT_PUT follows its ALLOC within its timeout).
ABANDONED_KEPT = 65536
# A lease not used within this time is taken back (its client died or stopped putting).
LEASE_TTL = 600.0


class Metadata:
    """All partitions plus the global index namespace (shared, freed indexes reused)."""

    def __init__(self, incarnation: int = 0):
        self.partitions: dict[str, Partition] = {}
        self.next_index = 0
        self.free: list[int] = []          # min-heap of freed indexes
        self.reserved: dict[int, str] = {}  # index -> restore_id holding it
        # index -> generation of every allocated index (visible, pending or reserved)
        self.gens: dict[int, int] = {}
        # Generations of pending keys forgotten because their put failed (ABORT_PUT): their
        # rows were never visible, so a concurrent put of the same new key may put it again.
        # A pending key that another put committed and a clear then removed is not here.
        self.abandoned: OrderedDict[int, None] = OrderedDict()
        # Indexes leased to clients for puts of new keys (see grant_lease), oldest first:
        # index -> (generation, when granted). Allocated like a pending key's, no key yet.
        self.leased: OrderedDict[int, tuple[int, float]] = OrderedDict()
        # the next_index the journal holds (None: unknown): a commit writes it when it differs
        self.journaled_next_index: int | None = None
        self.next_gen = incarnation << GEN_SHIFT
        self.gen_limit = (incarnation + 1) << GEN_SHIFT
        # Rows' field sets are frozensets, one object per distinct set (never changed in
        # place): per-row work that depends on the fields (DESCRIBE, journal encoding) is
        # done once per object.
        self._field_sets: dict[frozenset, frozenset] = {EMPTY: EMPTY}

    def share(self, fields) -> frozenset:
        """The one frozenset object equal to ``fields``."""
        fs = fields if type(fields) is frozenset else frozenset(fields)
        return self._field_sets.setdefault(fs, fs)

    def partition(self, pid: str, *, create: bool = False) -> Partition | None:
        part = self.partitions.get(pid)
        if part is None and create:
            part = self.partitions[pid] = Partition(pid, self.gens)
        return part

    def require(self, pid: str) -> Partition:
        part = self.partitions.get(pid)
        if part is None:
            raise KeyError(f"partition {pid!r} not found")
        return part

    def visible(self):
        """Partitions with at least one visible key (a partition of pending keys only is
        not listed)."""
        return [p for p in self.partitions.values() if p.keys]

    def allocate(self, n: int) -> list[int]:
        out = []
        while self.free and len(out) < n:
            out.append(heapq.heappop(self.free))
        if len(out) < n:
            start = self.next_index
            self.next_index += n - len(out)
            out.extend(range(start, self.next_index))
        return out

    def release(self, indexes) -> None:
        gens = self.gens
        for i in indexes:
            gens.pop(i, None)
            heapq.heappush(self.free, i)

    def reserve(self, restore_id: str, indexes, gens=None) -> None:
        """Hold ``indexes`` for restore ``restore_id`` until it commits or ends (invisible:
        no key holds them yet). ``gens``: their generations, for indexes taken anew (a
        restart rebuilding a committing restore's plan): they leave the free list."""
        indexes = list(indexes)
        for idx in indexes:
            self.reserved[idx] = restore_id
        if gens is None:
            return
        self.gens.update(zip(indexes, gens))
        taken = set(indexes)
        if taken:
            self.next_index = max(self.next_index, max(taken) + 1)
            self.free = [i for i in self.free if i not in taken]
            heapq.heapify(self.free)

    def unreserve(self, indexes, *, free: bool) -> None:
        """End the hold on ``indexes``: published (their keys hold them now) or, with
        ``free``, released for reuse."""
        indexes = list(indexes)
        for idx in indexes:
            self.reserved.pop(idx, None)
        if free:
            self.release(indexes)

    def take_gens(self, n: int) -> int:
        """The first of ``n`` new consecutive generations (never given before)."""
        first = self.next_gen
        if first + n > self.gen_limit:
            raise OverflowError(f"this controller incarnation gave out all its {1 << GEN_SHIFT} "
                                f"row generations; restart the controller")
        self.next_gen = first + n
        return first

    def allocate_rows(self, n: int) -> tuple[list[int], list[int]]:
        """``n`` free indexes, each with a new generation (recorded in :attr:`gens`)."""
        indexes = self.allocate(n)
        first = self.take_gens(n)
        gens = list(range(first, first + n))
        self.gens.update(zip(indexes, gens))
        return indexes, gens

    def grant_lease(self, n: int) -> tuple[list[int], list[int]]:
        """``n`` free indexes with new generations, leased to one client: it may write rows
        of keys it believes new there before it asks for anything (:meth:`take_leased` at
        its COMMIT_PUT). Leases older than LEASE_TTL are taken back first."""
        now = time.monotonic()
        stale = []
        while self.leased:
            idx, (gen, at) = next(iter(self.leased.items()))
            if now - at < LEASE_TTL:
                break
            del self.leased[idx]
            stale.append(idx)
        self.release(stale)
        indexes, gens = self.allocate_rows(n)
        for idx, gen in zip(indexes, gens):
            self.leased[idx] = (gen, now)
        return indexes, gens

    def take_leased(self, pid: str, keys: list[str], indexes, gens, schemas: dict) -> bool:
        """Make ``keys`` pending at the leased ``indexes`` (their rows are on the units) if
        every key is new and every index still leased at its generation; else take those
        leases back (their rows are the client's to drop) and return False: the client puts
        the keys again through ALLOC, which knows where an existing key lives."""
        leased = self.leased
        part = self.partition(pid)
        ok = (len(keys) == len(indexes) == len(gens) == len(set(keys))
              and all(leased.get(i, (None,))[0] == g for i, g in zip(indexes, gens))
              and (part is None or not any(k in part.keys or k in part.pending for k in keys)))
        if ok:
            try:
                self.validate_schemas(part, schemas)
            except (TypeError, ValueError):
                ok = False  # refused again, with its message, by the ALLOC of the retry
        if not ok:
            taken_back = []
            for idx, gen in zip(indexes, gens):
                if leased.get(idx, (None,))[0] == gen:
                    del leased[idx]
                    taken_back.append(idx)
            self.release(taken_back)
            return False
        part = self.partition(pid, create=True)
        part.merge_schemas(schemas)
        for key, idx in zip(keys, indexes):
            del leased[idx]
            part.pending[key] = idx
        return True

    def validate_schemas(self, part: Partition | None, schemas: dict) -> None:
        if part is None:
            return
        for field, schema in schemas.items():
            old = part.schema.get(field)
            if old is not None:
                check_schema_compatible(field, old, schema)

    def lost_rows(self) -> int:
        return sum(len(p.lost) for p in self.partitions.values())

    # ---------------------------------------------------------------- put
    def alloc(self, pid: str, keys: list[str], schemas: dict) -> tuple[list[int], list[int]]:
        """Indexes and generations of ``keys`` (new keys become pending, at new indexes
        with new generations).

        Schemas of new fields are registered now, so a concurrent put of the same field with
        another dtype is refused here, before it writes anything."""
        part = self.partition(pid, create=True)
        part.merge_schemas(schemas)
        new_keys = [k for k in dict.fromkeys(keys)
                    if k not in part.keys and k not in part.pending]
        if new_keys:
            part.pending.update(zip(new_keys, self.allocate_rows(len(new_keys))[0]))
        known, pending = part.keys, part.pending
        indexes = [known[k] if k in known else pending[k] for k in keys]
        return indexes, part.gens_of(indexes)

    def stale_keys(self, part: Partition | None, keys: list[str], gens) -> list[str]:
        """Those of ``keys`` that no longer hold the generation ``gens`` names (visible or
        pending): cleared, or cleared and created again, since ALLOC."""
        if part is None:
            return list(dict.fromkeys(keys))
        out = []
        known, pending, current = part.keys, part.pending, self.gens
        for key, gen in zip(keys, gens):
            idx = known.get(key)
            if idx is None:
                idx = pending.get(key)
            if idx is None or current.get(idx) != gen:
                out.append(key)
        return list(dict.fromkeys(out))

    def abandon_pending(self, part: Partition | None, keys: list[str], gens) -> list[list[int]]:
        """Forget the pending keys among ``keys`` that still hold ``gens`` (a put that
        failed): ``[index, generation]`` of each, its index freed."""
        if part is None:
            return []
        out = []
        for key, gen in zip(keys, gens):
            idx = part.pending.get(key)
            if idx is not None and self.gens.get(idx) == gen:
                del part.pending[key]
                out.append([idx, gen])
                self.abandoned[gen] = None
        while len(self.abandoned) > ABANDONED_KEPT:
            self.abandoned.popitem(last=False)
        self.release(idx for idx, _ in out)
        if not part.keys and not part.pending:
            del self.partitions[part.pid]
        return out

    def plan_commit(self, pid: str, keys: list[str], fields: list[str], tags) -> tuple:
        """(change, updates, common fields) of COMMIT_PUT; memory is left as it is. The
        keys must be visible or pending (see :meth:`stale_keys`)."""
        part = self.require(pid)
        change = MetaChange(next_index=None if self.next_index == self.journaled_next_index
                            else self.next_index)
        updates: dict[str, list] = {}  # key -> [idx, fields, tag, was pending]
        written = frozenset(fields)
        merged: dict[int, frozenset] = {}  # id(old field set) -> it | written, shared
        tag_memo: dict = {}  # keys given equal tags share the merged dict
        gens = self.gens
        for i, key in enumerate(keys):
            upd = updates.get(key)
            if upd is None:
                idx = part.keys.get(key)
                pending = idx is None
                if pending:
                    idx = part.pending.get(key)
                    if idx is None:
                        raise KeysNotFoundError([key], pid)
                # a lost row comes back with exactly the fields this put wrote
                base = EMPTY if pending or idx in part.lost else part.fields.get(idx, EMPTY)
                new = merged.get(id(base))
                if new is None:
                    new = merged[id(base)] = self.share(base | written)
                upd = updates[key] = [idx, new, part.tags.get(key), pending]
            if tags is not None and tags[i]:
                upd[2] = merge_tag(upd[2], tags[i], tag_memo)
        change.rows = [(pid, k, u[0], u[1], u[2] or NO_TAG, None, gens[u[0]])
                       for k, u in updates.items()]
        schema, journaled = part.schema, part.journaled
        change.schemas = [(pid, f, schema[f]) for f in dict.fromkeys(fields)
                          if f in schema and journaled.get(f) is not schema[f]]
        common = frozenset.intersection(*merged.values()) if merged else EMPTY
        return change, updates, sorted(common)

    def apply_commit(self, pid: str, updates: dict, change: MetaChange) -> None:
        """Apply a commit :meth:`plan_commit` planned, once its ``change`` is journaled."""
        part = self.require(pid)
        self._journaled(part, change)
        for key, (idx, fields, tag, pending) in updates.items():
            if pending:
                part.pending.pop(key, None)
                part.keys[key] = idx
            part.fields[idx] = fields
            part.tags[key] = tag or NO_TAG
            part.lost.pop(idx, None)

    def _journaled(self, part: Partition, change: MetaChange) -> None:
        """Note what ``change`` (journaled) wrote of ``part``'s schemas and of next_index."""
        if change.next_index is not None:
            self.journaled_next_index = change.next_index
        for _pid, f, s in change.schemas:
            part.journaled[f] = s

    # ---------------------------------------------------------------- clear
    def plan_clear(self, part: Partition, keys: list[str]) -> tuple[MetaChange, list[str]]:
        gone = [k for k in dict.fromkeys(keys) if k in part.keys]
        change = MetaChange(deleted=[(part.pid, k) for k in gone])
        if gone and len(gone) == len(part.keys) and not part.pending:
            change.dropped = [part.pid]
        return change, gone

    def apply_clear(self, part: Partition, gone: list[str]) -> None:
        """Remove ``gone`` (their indexes freed for reuse)."""
        freed = []
        for key in gone:
            idx = part.keys.pop(key)
            part.fields.pop(idx, None)
            part.tags.pop(key, None)
            part.lost.pop(idx, None)
            freed.append(idx)
        self.release(freed)
        if not part.keys and not part.pending:
            del self.partitions[part.pid]

    # ---------------------------------------------------------------- restore publish
    def plan_publish(self, pid: str, rows: list, field_schema: dict) -> tuple[MetaChange, dict]:
        """Change and new schemas of publishing a committed restore's ``rows``
        (:class:`tqtx.plan.RestoreRow`)."""
        part = self.partition(pid)
        schema = dict(part.schema) if part is not None else {}
        for field, s in field_schema.items():
            schema[field] = merge_schema(schema.get(field), s)
        change = MetaChange(next_index=self.next_index,
                            schemas=[(pid, f, schema[f]) for f in field_schema])
        tag_memo: dict = {}
        # (the key's field set or None, the row's names) -> the one union: the rows of a
        # dump share a few field lists, each decoded as a list of its own
        fields_memo: dict[tuple, frozenset] = {}
        keys, lost, held, tags = ((part.keys, part.lost, part.fields, part.tags)
                                  if part is not None else ({}, {}, {}, {}))
        out = change.rows
        for r in rows:
            key, idx, tag = r.key, r.index, r.tag
            if r.is_new or key not in keys or idx in lost:
                old, old_tag = None, None
            else:
                old, old_tag = held.get(idx, EMPTY), tags.get(key, NO_TAG)
            names = (old, tuple(r.fields))
            new_fields = fields_memo.get(names)
            if new_fields is None:
                new_fields = fields_memo[names] = self.share(
                    names[1] if old is None else old.union(names[1]))
            out.append((pid, key, idx, new_fields, merge_tag(old_tag, tag, tag_memo), None,
                        r.gen))
        return change, schema

    def apply_publish(self, pid: str, change: MetaChange, schema: dict) -> None:
        part = self.partition(pid, create=True)
        part.schema = schema
        self._journaled(part, change)
        for _pid, key, idx, fields, tag, _lost, gen in change.rows:
            part.pending.pop(key, None)
            part.keys[key] = idx
            part.fields[idx] = fields
            part.tags[key] = tag
            part.lost.pop(idx, None)
            self.gens[idx] = gen

    # ---------------------------------------------------------------- unit re-attach
    def plan_lost(self, uid: int, num_units: int, held: dict) -> MetaChange:
        """Rows unit ``uid`` should hold (produced fields) but does not list in ``held``
        (``{index: (generation, set of fields)}``) with their generation become lost on it."""
        change = MetaChange()
        gens, none = self.gens, (None, frozenset())
        for part in self.partitions.values():
            fields, lost = part.fields, part.lost
            for key, idx in part.keys.items():
                if owner(idx, num_units) != uid or idx in lost:
                    continue
                produced = fields.get(idx)
                if not produced:
                    continue
                gen, have = held.get(idx, none)
                if gen != gens[idx] or not produced <= have:
                    change.rows.append(part.row(key, lost=uid))
        return change

    def apply_lost(self, change: MetaChange) -> None:
        for pid, _key, idx, _fields, _tag, uid, _gen in change.rows:
            self.partitions[pid].lost[idx] = uid

    # ---------------------------------------------------------------- snapshots
    def snapshot(self) -> dict:
        """Visible metadata (checkpoints): rows ``[key, index, fields, tag, lost unit or
        None, generation]``."""
        gens = self.gens
        listed: dict = {}  # a field set -> its sorted list: keys share a handful of sets

        def sorted_once(fields):
            out = listed[fields] = sorted(fields)
            return out

        def rows(p):
            lost, fields, tags, known = p.lost, p.fields, p.tags, listed.get
            return [[k, i, known(fs := fields.get(i, ())) or sorted_once(fs), tags.get(k),
                     lost.get(i), gens[i]] for k, i in p.keys.items()]
        return {
            "next_index": self.next_index,
            "free": sorted(self.free),
            "partitions": {p.pid: {"schema": p.schema, "rows": rows(p)} for p in self.visible()},
        }

    def plan_replace(self, snap: dict) -> MetaChange:
        """The journal change that replaces everything with checkpoint ``snap``'s schemas
        and next index; its keys are journaled apart (see :meth:`replace`)."""
        change = MetaChange(replace=True, next_index=int(snap["next_index"]))
        for pid, data in snap["partitions"].items():
            change.schemas.extend((pid, f, s) for f, s in data["schema"].items())
        return change

    @staticmethod
    def gen_span(snap: dict) -> int:
        """How many generations :meth:`replace` with a ``gen_base`` uses for ``snap``: one
        per index below its highest."""
        top = int(snap["next_index"])
        for data in snap["partitions"].values():
            if data["rows"]:
                top = max(top, max(map(_INDEX_OF, data["rows"])) + 1)
        return top

    def drop_all(self) -> None:
        """Forget every partition, row and reserved index: the empty buffer (its owner
        ended it, or every unit lost its rows)."""
        self.replace({"next_index": 0, "partitions": {}})

    def replace(self, snap: dict, gen_base: int | None = None) -> None:
        """Load ``snap`` (a checkpoint's, or the journal's with ``free`` derived).

        The row at index ``i`` gets generation ``gen_base + i`` when ``gen_base`` is given
        (a checkpoint load: its rows get generations of this controller, the units the same
        ones), else the generation the snapshot holds (the journal's own), or a new one for
        a row that has none (written before generations existed)."""
        self.partitions.clear()
        self.reserved.clear()
        self.leased.clear()
        self.gens.clear()
        self.next_index = self.journaled_next_index = int(snap["next_index"])
        gens = self.gens
        unversioned = []
        used = []
        shared: dict[tuple, frozenset] = {}
        last_fields, fs = None, EMPTY  # rows of one put come in a row, sharing their field list
        for pid, data in snap["partitions"].items():
            part = self.partition(pid, create=True)
            part.schema = dict(data["schema"])
            part.journaled = dict(part.schema)  # the journal's, or written with the replace
            keys, fields_of, tags, lost_of = part.keys, part.fields, part.tags, part.lost
            for row in data["rows"]:
                if len(row) == 6:
                    key, idx, fields, tag, lost, gen = row
                else:
                    key, idx, fields, tag = row[:4]
                    lost, gen = (row[4] if len(row) > 4 else None), None
                keys[key] = idx
                if fields is not last_fields:
                    names = tuple(fields)
                    fs = shared.get(names)
                    if fs is None:
                        fs = shared[names] = self.share(names)
                    last_fields = fields
                fields_of[idx] = fs
                tags[key] = tag or NO_TAG
                if lost is not None:
                    lost_of[idx] = lost
                if gen_base is not None:
                    gens[idx] = gen_base + idx
                elif gen is not None:
                    gens[idx] = gen
                else:
                    unversioned.append(idx)
                used.append(idx)
        if unversioned:
            first = self.take_gens(len(unversioned))
            gens.update(zip(unversioned, range(first, first + len(unversioned))))
        if used:
            self.next_index = max(self.next_index, max(used) + 1)
        if "free" in snap:
            self.free = list(snap["free"])
        else:
            taken = set(used)
            self.free = [i for i in range(self.next_index) if i not in taken]
        heapq.heapify(self.free)
