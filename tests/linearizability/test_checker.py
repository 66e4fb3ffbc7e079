"""The history checker on hand-written histories (linearizable ones pass, known-bad ones fail
with the right explanation) and on generated ones (a hypothesis property)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from checker import ABSENT, LISTED, LOST, UNLISTED, Op, check

A, B = ("p", "a"), ("p", "b")


def op(kind, t0, t1, values=None, tags=None, *, outcome="ok", proc="w1", error="",
       optional=False) -> Op:
    """An op; writes tag the same value ids as they write, unless ``tags`` is given."""
    values = dict(values or {})
    if tags is None:
        tags = dict(values) if kind in ("put", "clear", "load", "ckpt_load") else {}
    return Op(proc, kind, t0, t1, outcome, values=values, tags=tags, error=error,
              optional=optional)


def put(t0, t1, values, **kw):
    return op("put", t0, t1, values, **kw)


def get(t0, t1, values, **kw):
    return op("get", t0, t1, values, **kw)


def only(verdict, kind: str):
    assert not verdict.unknown, verdict.summary()
    assert [v.kind for v in verdict.violations] == [kind], verdict.summary()
    return verdict.violations[0]


# ------------------------------------------------------------------ linearizable
def test_concurrent_put_and_gets_pass():
    for late in ("v1", "v2"):  # a read concurrent with a put may see either value
        h = [put(0, 10, {A: "v1"}), get(1, 2, {A: ABSENT}), get(3, 4, {A: "v1"}),
             put(5, 7, {A: "v2"}), get(6, 8, {A: late})]
        assert check(h).ok, check(h).summary()


def test_indeterminate_puts_pass():
    taken = [put(0, 1, {A: "v1"}), put(2, None, {A: "v2"}, outcome="info"),
             get(3, 4, {A: "v1"}), get(10, 11, {A: "v2"}), get(12, 13, {A: "v2"})]
    never = [put(0, 1, {A: "v1"}), put(2, None, {A: "v2"}, outcome="info"),
             get(3, 4, {A: "v1"}), get(30, 31, {A: "v1"})]
    for h in (taken, never):
        assert check(h).ok, check(h).summary()


def restart(t0, t1) -> Op:
    return Op("nemesis", "restart", t0, t1, "ok")


def test_an_indeterminate_put_is_revealed_by_the_restart_after_it():
    # it took effect before the kill, unseen; the first read after the restart shows it
    h = [put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}, outcome="info"), get(4, 5, {A: "v1"}),
         restart(6, 7), get(8, 9, {A: "v2"}), get(10, 11, {A: "v2"})]
    assert check(h).ok, check(h).summary()


def test_an_indeterminate_put_may_never_have_taken_effect_before_the_restart_after_it():
    # its PUT_ROWS died with a unit, say: no read after the restart shows it, ever
    h = [put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}, outcome="info"),
         restart(6, 7), get(8, 9, {A: "v1"}), get(10, 11, {A: "v1"})]
    assert check(h).ok, check(h).summary()
    # nor a clear: the key is still there
    h = [put(0, 1, {A: "v1"}), op("clear", 2, 3, {A: ABSENT}, outcome="info"),
         restart(6, 7), get(8, 9, {A: "v1"})]
    assert check(h).ok, check(h).summary()


def test_an_indeterminate_put_cannot_take_effect_after_the_restart_that_followed_it():
    # unbounded, v2 could appear between the reads after the restart; bounded, it cannot
    h = [put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}, outcome="info"),
         restart(6, 7), get(8, 9, {A: "v1"}), get(10, 11, {A: "v2"})]
    only(check(h), "not-linearizable")
    unbounded = [o for o in h if o.kind != "restart"]
    assert check(unbounded).ok, check(unbounded).summary()
    # a put still running at the kill is not bounded by it (its client may resend after)
    late = [put(0, 1, {A: "v1"}), put(2, 12, {A: "v2"}, outcome="info"),
            restart(6, 7), get(8, 9, {A: "v1"}), get(10, 11, {A: "v2"})]
    assert check(late).ok, check(late).summary()


def test_clears_and_failed_writes_pass():
    h = [put(0, 1, {A: "v1"}), op("clear", 2, 3, {A: ABSENT}), get(4, 5, {A: ABSENT}),
         put(5, 6, {A: "v3"}), put(6, 7, {A: "v4"}, outcome="fail"),
         op("clear", 6.5, 9, {A: ABSENT}), get(7, 8, {A: "v3"}), get(10, 11, {A: ABSENT})]
    assert check(h).ok, check(h).summary()


def test_dumps_loads_and_lists_pass():
    h = [put(0, 1, {A: "a1", B: "b1"}), put(2, 6, {A: "a2"}),
         op("dump", 3, 4, {A: "a1", B: "b1"}, {A: "a1", B: "b1"}),
         op("dump", 5, 7, {A: "a2"}, {A: "a2"}),
         op("load", 8, 9, {A: "a1", B: "b1"}),
         get(10, 11, {A: "a1", B: "b1"}),
         op("list", 12, 13, {A: LISTED, B: LISTED}, {A: "a1", B: "b1"}),
         op("clear", 14, 15, {B: ABSENT}),
         op("list", 16, 17, {A: LISTED, B: UNLISTED}, {A: "a1", B: ABSENT})]
    assert check(h).ok, check(h).summary()


def test_unit_loss_and_checkpoints_pass():
    loss = [put(0, 1, {A: "v1", B: "w1"}),
            op("unit_loss", 2, 4, {A: LOST, B: LOST}, optional=True, proc="nemesis"),
            get(5, 6, {A: "v1"}), get(5, 6, {B: LOST}),
            op("list", 7, 8, {A: LISTED, B: LISTED}, {A: "v1", B: "w1"})]
    ckpt = [put(0, 1, {A: "v1"}), op("ckpt_save", 2, 3, {A: "v1", B: ABSENT}, {A: "v1", B: ABSENT}),
            put(4, 5, {B: "w1"}), op("ckpt_load", 6, 7, {A: "v1", B: ABSENT}),
            get(8, 9, {B: ABSENT})]
    for h in (loss, ckpt):
        assert check(h).ok, check(h).summary()


# ------------------------------------------------------------------ known bad
def test_stale_read_after_a_completed_overwrite_fails():
    v = only(check([put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}, proc="w2"),
                    get(4, 5, {A: "v1"}, proc="w3")]), "not-linearizable")
    assert v.register == ("value", "p", "a")
    assert "get by w3 [4.0000s, 5.0000s] ok saw 'v1'" in v.message
    assert "superseded by (completed before the read began): put by w2 [2.0000s, 3.0000s] ok " \
           "wrote 'v2'" in v.message, v.message


def test_a_read_of_another_keys_value_fails_naming_both_keys():
    v = only(check([put(0, 1, {A: "a1"}), get(2, 3, {B: "a1"})]), "foreign-value")
    assert v.register == ("value", "p", "b")
    assert "'a1', which was put only to key(s) p/a, never to p/b" in v.message, v.message


def test_a_value_going_back_in_time_fails():
    v = only(check([put(0, 1, {A: "v1"}), put(2, 10, {A: "v2"}), get(3, 4, {A: "v2"}),
                    get(5, 6, {A: "v1"})]), "not-linearizable")
    assert "get by w1 [5.0000s, 6.0000s] ok saw 'v1'" in v.message
    assert "earlier read: get by w1 [3.0000s, 4.0000s] ok saw 'v2'" in v.message, v.message


def test_an_indeterminate_put_seen_then_unseen_fails():
    v = only(check([put(0, 1, {A: "v1"}), put(2, None, {A: "v2"}, outcome="info"),
                    get(5, 6, {A: "v2"}), get(7, 8, {A: "v1"})]), "not-linearizable")
    assert "saw 'v1'" in v.message and "earlier read" in v.message, v.message


def test_a_half_applied_restore_fails():
    base = [put(0, 1, {A: "a1", B: "b1"}), op("dump", 2, 3, {A: "a1", B: "b1"}),
            put(4, 5, {A: "a2", B: "b2"})]
    half = base + [op("load", 6, 7, {A: "a1", B: "b1"}), get(8, 9, {A: "a1", B: "b2"})]
    v = only(check(half), "not-linearizable")
    assert v.register == ("value", "p", "b")
    assert "saw 'b2'" in v.message and "load by w1 [6.0000s, 7.0000s] ok wrote 'b1'" in v.message
    failed = base + [op("load", 6, 7, {A: "a1", B: "b1"}, outcome="fail", error="ValueError"),
                     get(8, 9, {A: "a1", B: "b2"})]
    v = only(check(failed), "not-linearizable")
    assert v.register == ("value", "p", "a")
    assert "written only by a FAILED op (no effect allowed): load" in v.message, v.message


def test_a_dump_of_a_value_superseded_before_it_began_fails():
    v = only(check([put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}),
                    op("dump", 4, 5, {A: "v1"})]), "not-linearizable")
    assert "dump by w1 [4.0000s, 5.0000s] ok saw 'v1'" in v.message, v.message


def test_a_read_of_a_put_not_invoked_yet_fails():
    v = only(check([get(0, 1, {A: "v1"}), put(2, 3, {A: "v1"}, proc="w2")]), "future-value")
    assert "put only by puts invoked after it returned: put by w2 [2.0000s, 3.0000s]" in v.message


def test_a_failed_put_that_shows_fails():
    v = only(check([put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}, outcome="fail",
                                               error="KeysNotFoundError: b"),
                    get(4, 5, {A: "v2"})]), "not-linearizable")
    assert "written only by a FAILED op (no effect allowed): put by w1 [2.0000s, 3.0000s] fail " \
           "(KeysNotFoundError: b)" in v.message, v.message


def test_an_old_value_after_a_loss_fails_and_so_does_a_stale_tag():
    lost = check([put(0, 1, {A: "v1"}),
                  op("unit_loss", 2, 4, {A: LOST}, optional=True, proc="nemesis"),
                  get(5, 6, {A: LOST}), get(7, 8, {A: "v1"})])
    assert "saw 'v1'" in only(lost, "not-linearizable").message
    tag = only(check([put(0, 1, {A: "v1"}), put(2, 3, {A: "v2"}),
                      op("list", 4, 5, {A: LISTED}, {A: "v1"})]), "not-linearizable")
    assert tag.register == ("tag", "p", "a")


def test_a_value_no_put_wrote_fails():
    only(check([put(0, 1, {A: "v1"}), get(2, 3, {A: "<torn v1 pad=[7]>"})]), "unwritten-value")


def test_the_search_bound_is_reported():
    h = [put(i, i + 5, {A: f"v{i}"}) for i in range(6)] + [get(7, 8, {A: "v5"})]
    verdict = check(h, budget=3)
    assert ("value", "p", "a") in verdict.unknown and not verdict.ok
    assert "search bound hit" in verdict.summary()


def test_thousands_of_ops_per_key_stay_within_the_bound():
    h, value = [], ABSENT
    for i in range(3000):  # overlapping neighbours: op i at [i, i + 1.5], effect at i + 0.5
        if i % 3:
            h.append(get(i, i + 1.5, {A: value}, proc=f"w{i % 4}"))
        else:
            value = f"v{i}"
            h.append(put(i, i + 1.5, {A: value}, proc=f"w{i % 4}"))
    verdict = check(h)
    assert verdict.ok, verdict.summary()


# ------------------------------------------------------------------ generated
KEYS = [("p", "a"), ("p", "b"), ("q", "a")]


@st.composite
def sequential_histories(draw):
    """A random sequential execution (op i takes effect at time i) with random intervals
    around each op's instant: linearizable by construction."""
    jitter = draw(st.floats(0.0, 2.5))
    value = {k: ABSENT for k in KEYS}   # the row registers
    tag = {k: ABSENT for k in KEYS}     # the tag registers (a unit loss leaves them)
    dumps, ckpts, history = [], [], []
    for i in range(draw(st.integers(5, 40))):
        kind = draw(st.sampled_from(["put", "put", "get", "get", "clear", "list", "dump",
                                     "load", "lost_put", "unit_loss", "ckpt_save",
                                     "ckpt_load"]))
        keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True))
        t0 = i - draw(st.floats(0.0, jitter))
        t1 = i + draw(st.floats(0.0, jitter))
        if kind in ("put", "lost_put"):
            values = {k: f"{k[0]}/{k[1]}#{i}" for k in keys}
            # an indeterminate put took effect at i, or never
            if kind == "put" or draw(st.booleans()):
                value.update(values)
                tag.update(values)
            history.append(put(t0, t1, values) if kind == "put"
                           else put(t0, None, values, outcome="info"))
        elif kind == "clear":
            value.update({k: ABSENT for k in keys})
            tag.update({k: ABSENT for k in keys})
            history.append(op("clear", t0, t1, {k: ABSENT for k in keys}))
        elif kind == "unit_loss":  # the rows of some keys (the lost unit's) become LOST
            value.update({k: LOST for k in KEYS if value[k] != ABSENT and draw(st.booleans())})
            history.append(op("unit_loss", t0, t1, {k: LOST for k in KEYS}, optional=True))
        elif kind == "get":
            history.append(get(t0, t1, {k: value[k] for k in keys}))
        elif kind == "list":
            history.append(op("list", t0, t1, {k: UNLISTED if value[k] == ABSENT else LISTED
                                               for k in KEYS}, {k: tag[k] for k in KEYS}))
        elif kind == "dump":
            seen = [k for k in keys if value[k] not in (ABSENT, LOST)]
            dumps.append(({k: value[k] for k in seen}, {k: tag[k] for k in seen}))
            history.append(op("dump", t0, t1, *dumps[-1]))
        elif kind == "ckpt_save":
            ckpts.append((dict(value), dict(tag)))
            history.append(op("ckpt_save", t0, t1, *ckpts[-1]))
        elif (dumps if kind == "load" else ckpts):
            values, tags = draw(st.sampled_from(dumps if kind == "load" else ckpts))
            value.update(values)
            tag.update(tags)
            history.append(op(kind, t0, t1, values, tags))
    return history


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequential_histories())
def test_generated_sequential_histories_pass(history):
    verdict = check(history)
    assert verdict.ok, verdict.summary()


def _superseded(history, read: Op, key) -> list[str]:
    """Values put to ``key`` whose only write completed before another definite write of
    ``key`` was invoked, which completed before ``read`` was invoked."""
    writes = [o for o in history if o.is_write and key in o.values]
    out = []
    for old in writes:
        u = old.values[key]
        if old.kind != "put" or old.outcome != "ok" or u == read.values[key] or \
                sum(1 for o in writes if o.values[key] == u) != 1:
            continue
        if any(new.outcome == "ok" and not new.optional and new.values[key] != u
               and old.complete < new.invoke
               and new.complete < read.invoke for new in writes):
            out.append(u)
    return out


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.filter_too_much])
@given(sequential_histories(), st.data())
def test_a_read_mutated_to_a_superseded_value_is_caught(history, data):
    reads = [(o, k) for o in history if o.kind == "get" for k in o.values
             if _superseded(history, o, k)]
    assume(reads)
    read, key = data.draw(st.sampled_from(reads))
    read.values[key] = data.draw(st.sampled_from(_superseded(history, read, key)))
    verdict = check(history)
    assert not verdict.ok
    assert any(v.register == ("value", *key) and v.op is read for v in verdict.violations), \
        verdict.summary()
