"""``KVBatchMeta``: what a put returns and ``kv_batch_get_by_meta`` takes, with the
attributes and methods of TransferQueue 0.1.11's class of that name (torch-free)."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

log = logging.getLogger("tqtx.kvmeta")

_ATOMIC = frozenset({str, int, float, bool, bytes, type(None)})


def copy_tags(tags: list) -> list:
    """``copy.deepcopy(tags)``, with the usual tag (a dict of str keys and atomic values)
    copied as a plain dict: 7,680 tags took 19 ms through deepcopy. As deepcopy does, a
    tag object met twice is copied once and stays shared."""
    memo: dict = {}
    out = []
    for tag in tags:
        got = memo.get(id(tag))
        if got is None:
            if type(tag) is dict and all(type(k) is str and type(v) in _ATOMIC
                                         for k, v in tag.items()):
                got = memo[id(tag)] = dict(tag)
            else:
                got = copy.deepcopy(tag, memo)
        out.append(got)
    return out


@dataclass
class KVBatchMeta:
    """Keys of one partition with their tags (one dict per key), the fields they share and
    free-form batch-level ``extra_info``. Keys must be distinct; ``tags`` left empty means
    one empty tag per key."""
    keys: list = field(default_factory=list)
    tags: list = field(default_factory=list)
    partition_id: str | None = None
    fields: list | None = None  # None: whatever the keys have (TransferQueue's default)
    extra_info: dict | None = field(default_factory=dict)

    def __post_init__(self):
        self.keys = list(self.keys)
        self.tags = copy_tags(self.tags) if self.tags else [{} for _ in self.keys]
        self._check()
        self.extra_info = copy.deepcopy(self.extra_info)

    def _check(self) -> None:
        if len(self.tags) != len(self.keys):
            raise ValueError(f"keys and tags must have the same length, got {len(self.keys)} "
                             f"keys and {len(self.tags)} tags")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("KVBatchMeta keys must be distinct")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError("KVBatchMeta fields must be distinct")

    @classmethod
    def _of_own_tags(cls, keys: list, tags: list, *, partition_id: str | None,
                     fields: list | None) -> "KVBatchMeta":
        """A batch (no ``extra_info``) of ``keys`` (a list of its own) whose ``tags`` are
        objects made for it alone (decoded from a reply): kept without the copies made of
        what a caller hands in."""
        meta = object.__new__(cls)
        meta.keys, meta.tags, meta.partition_id = keys, tags, partition_id
        meta.fields, meta.extra_info = fields, {}
        meta._check()
        return meta

    def __len__(self):
        return len(self.keys)

    @property
    def size(self) -> int:
        """Number of keys."""
        return len(self.keys)

    def _with(self, keys: list, tags: list) -> "KVBatchMeta":
        return KVBatchMeta(keys=keys, tags=tags, partition_id=self.partition_id,
                           fields=None if self.fields is None else list(self.fields),
                           extra_info=self.extra_info)

    def select_keys(self, keys_to_select: list) -> "KVBatchMeta":
        """A new batch of ``keys_to_select`` (in that order) with their tags.
        ValueError for duplicates, RuntimeError for keys not in this batch."""
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError("select_keys: duplicate keys")
        where = {k: i for i, k in enumerate(self.keys)}
        absent = [k for k in keys_to_select if k not in where]
        if absent:
            raise RuntimeError(f"select_keys: keys {absent} are not in this batch")
        return self._with(list(keys_to_select), [self.tags[where[k]] for k in keys_to_select])

    def reorder(self, indexes: list) -> None:
        """Put keys (and tags) in the order ``indexes`` gives, in place."""
        if len(indexes) != self.size:
            raise ValueError(f"reorder: {len(indexes)} indexes for a batch of {self.size}")
        if len(set(indexes)) != len(indexes):
            raise ValueError("reorder: duplicate indexes")
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list["KVBatchMeta"]:
        """``chunks`` consecutive batches whose sizes differ by at most one (the first ones
        larger); some are empty when there are fewer keys than chunks."""
        return [self._with(self.keys[a:b], self.tags[a:b])
                for a, b in chunk_bounds(self.size, chunks, "KVBatchMeta", "keys")]

    @classmethod
    def concat(cls, data: list["KVBatchMeta"]) -> "KVBatchMeta":
        """One batch of the non-empty ``data`` batches, in order. They must share the
        partition and the field set; ``extra_info`` is merged (a key with two different
        values is a ValueError)."""
        data = [d for d in (data or []) if d is not None and d.size > 0]
        if not data:
            return cls()
        first = data[0]
        fields = set(first.fields or ())
        extra: dict = {}
        for d in data:
            if d.fields is not None and set(d.fields) != fields:
                raise ValueError("KVBatchMeta.concat: field names do not match")
            if d.partition_id != first.partition_id:
                raise ValueError("KVBatchMeta.concat: partitions do not match")
            for k, v in (d.extra_info or {}).items():
                if k in extra and not _same(extra[k], v):
                    raise ValueError(f"KVBatchMeta.concat: extra_info key {k!r} has "
                                     f"conflicting values")
                extra.setdefault(k, v)
        return cls(keys=[k for d in data for k in d.keys], tags=[t for d in data for t in d.tags],
                   partition_id=first.partition_id, fields=first.fields,
                   extra_info=extra or None)


def _same(a, b) -> bool:
    try:
        eq = a == b
        return bool(eq.all()) if hasattr(eq, "all") else bool(eq)
    except Exception:  # values that do not compare (e.g. tensors of other shapes)
        return a is b


def chunk_bounds(size: int, chunks: int, what: str, items: str) -> list[tuple[int, int]]:
    """``chunks`` consecutive ``(start, end)`` ranges over ``size`` items whose lengths differ
    by at most one, the first ones longer (TransferQueue's chunking of a batch); warns when
    some are empty."""
    if size < chunks:
        log.warning("%s.chunk: %d chunks of %d %s, some are empty", what, chunks, size, items)
    base, extra = divmod(size, chunks)
    out, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out
