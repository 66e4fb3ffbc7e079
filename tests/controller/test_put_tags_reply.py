"""Which stored tags a COMMIT_PUT sends back (``want_tags``): only those its client cannot
know, i.e. of keys that held a tag before this put (or that the put names twice); every
other key stores exactly the tag the client sent (no processes)."""
from __future__ import annotations

from tqtx.controller.kv import KVRequests
from tqtx.controller.metadata import Metadata

from after_reply import AfterReply


class _NoJournal:
    enabled = False

    def write(self, change):
        pass

    def make_durable(self):
        pass


class _Controller(KVRequests):
    def __init__(self):
        self.server = AfterReply()
        super().__init__(meta=Metadata(), journal=None, metajournal=_NoJournal(), units={},
                         num_units=2, incarnation=0, restores=None, require_units=None,
                         topology=lambda: 7, after_reply=self.server.after_reply)

    def put(self, keys, tags):
        """ALLOC's pending keys, then COMMIT_PUT with want_tags: (reply, stored tags)."""
        part = self.meta.partition("p", create=True)
        part.schema.setdefault("a", {"kind": "tensor"})
        for k in keys:
            if k not in part.keys and k not in part.pending:
                part.pending[k] = self.meta.allocate_rows(1)[0][0]
        out = self.commit_put({"partition_id": "p", "keys": keys, "fields": ["a"],
                               "tags": tags, "want_tags": True}, {"rid": ""})
        return out, {k: part.tags[k] for k in keys}


def test_new_keys_get_no_tags_back():
    ctl = _Controller()
    out, stored = ctl.put(["k0", "k1"], [{"s": 1}, {"s": 2}])
    assert "tags" not in out
    assert stored == {"k0": {"s": 1}, "k1": {"s": 2}}


def test_keys_with_earlier_tags_get_the_merged_tags_back():
    ctl = _Controller()
    ctl.put(["old", "bare"], [{"s": 1, "keep": "x"}, None])
    out, stored = ctl.put(["old", "bare", "new"], [{"s": 2}, {"t": 3}, {"u": 4}])
    assert out["tags"] == {"old": {"s": 2, "keep": "x"}}
    assert stored == {"old": {"s": 2, "keep": "x"}, "bare": {"t": 3}, "new": {"u": 4}}


def test_a_put_without_tags_sends_back_only_tags_kept_from_before():
    ctl = _Controller()
    ctl.put(["old", "bare"], [{"s": 1}, None])
    out, stored = ctl.put(["old", "bare"], None)
    assert out["tags"] == {"old": {"s": 1}}
    assert stored == {"old": {"s": 1}, "bare": {}}


def test_a_key_named_twice_sends_every_tag_back():
    ctl = _Controller()
    out, stored = ctl.put(["k", "k", "j"], [{"a": 1}, {"b": 2}, {"c": 3}])
    assert out["tags"] == {"k": {"a": 1, "b": 2}, "j": {"c": 3}}
    assert stored["k"] == {"a": 1, "b": 2}
