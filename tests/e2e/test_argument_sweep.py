"""Every public function, with wrong values for each argument in turn (issue 33, item 2).

For each function of the module API (and each async twin) and each of its arguments, the
other arguments get a valid value and this one a generated wrong value: None, a bool, an
int (huge ones too), a float (NaN, infinities), bytes, "", whitespace, a huge str, a list
of the wrong type, a nested dict or a plain object. The expectation comes from an oracle
written here, apart from tqtx's own table (tqtx.arguments.table): a value the API documents as
accepted must not be refused for its type, any other must raise TypeError or ValueError
naming the argument. After a refusal nothing visible changed: ``kv_list()``, the controller
journal's files and the tree of the test's dumps and targets are byte-identical. After
every call the deployment still serves a put and a get. An accepted call's effects are
undone before the next example.

``TQTX_SWEEP_EXAMPLES`` (default 25) is the number of examples per argument.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import tqtx as tq
from tqtx import KVBatchMeta, api
from tqtx.arguments.table import ARGUMENTS
from treehash import diff, snapshot

pytestmark = pytest.mark.timeout(600)

EXAMPLES = int(os.environ.get("TQTX_SWEEP_EXAMPLES", "25"))
P = "sweep"            # seeded partition: keys a, b with field x
PUT_P = "sweep-put"    # where the put functions' accepted calls land (emptied after each)
HUGE = "k" * 100_000   # over every length limit (keys, partition IDs, paths)


class Opaque:
    """A plain object: no function takes one."""

    def __repr__(self):
        return "Opaque()"


_leaf = st.one_of(st.integers(-(2 ** 63), 2 ** 63 - 1), st.none(), st.text(max_size=3))
NESTED = st.recursive(st.dictionaries(st.text(max_size=3), _leaf, max_size=2),
                      lambda inner: st.dictionaries(st.text(max_size=3), inner, max_size=2),
                      max_leaves=4)
WRONG = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2 ** 64),
    st.floats(allow_nan=True, allow_infinity=True), st.just(math.nan), st.binary(max_size=8),
    st.just(""), st.sampled_from([" ", "\t", " \n ", "\u3000"]), st.just(HUGE),
    st.lists(st.one_of(st.integers(), st.none(), st.binary(max_size=3), st.floats()),
             min_size=1, max_size=3),
    NESTED, st.builds(Opaque), st.builds(object))


# --------------------------------------------------------------------------- the oracle
def name_ok(v) -> bool:
    return isinstance(v, str) and len(v) <= 65536


def partition_ok(v) -> bool:
    return name_ok(v) and bool(v.strip())


def keys_ok(v) -> bool:  # one str, or a non-empty list of distinct str
    if isinstance(v, str):
        return name_ok(v)
    return (isinstance(v, list) and bool(v) and all(map(name_ok, v))
            and len(set(v)) == len(v))


def field_names_ok(v) -> bool:
    return name_ok(v) or (isinstance(v, (list, tuple)) and all(map(name_ok, v)))


def one_sample_fields_ok(v) -> bool:  # a dict of field name -> value (any nested value)
    return isinstance(v, Mapping) and all(isinstance(k, str) and k for k in v)


def batch_fields_ok(v) -> bool:
    # a dict of batched columns: a scalar str or None is one value for every row
    # (tensordict's NonTensorData); an int is not a column; nested dicts are refused
    return (isinstance(v, Mapping) and all(isinstance(k, str) and k for k in v)
            and all(x is None or isinstance(x, str) for x in v.values()))


def tags_ok(v) -> bool:  # one per key (the baseline has one key)
    return (isinstance(v, (list, tuple)) and len(v) == 1
            and all(t is None or isinstance(t, Mapping) for t in v))


def json_dict_ok(v) -> bool:
    return isinstance(v, Mapping)


def optional(ok):
    return lambda v: v is None or ok(v)


def never(v) -> bool:
    return False


def is_bool(v) -> bool:
    return isinstance(v, bool)


# function -> argument -> (valid value, oracle: is this value accepted?)
def baselines(root: Path) -> dict:
    td1 = TensorDict({"x": torch.ones(1, 3)}, batch_size=[1])
    return {
        "init": {"conf": (None, optional(lambda v: isinstance(v, Mapping))),
                 "address": (None, optional(never)),
                 "config": (None, optional(lambda v: isinstance(v, Mapping)))},
        "close": {"cancel_dumps": (False, is_bool), "keep_buffer": (False, is_bool)},
        "kv_put": {"key": ("new", name_ok), "partition_id": (PUT_P, partition_ok),
                   "fields": ({"x": torch.ones(3)}, optional(one_sample_fields_ok)),
                   "tag": ({"t": 1}, optional(lambda v: isinstance(v, Mapping))),
                   "data_parser": (None, optional(never))},
        "kv_batch_put": {"keys": (["new"], lambda v: keys_ok(v) and len(
                             [v] if isinstance(v, str) else v) == 1),
                         "partition_id": (PUT_P, partition_ok),
                         "fields": (td1, optional(batch_fields_ok)),
                         "tags": ([{"t": 1}], optional(tags_ok)),
                         "data_parser": (None, optional(never))},
        "kv_batch_get": {"keys": (["a", "b"], keys_ok), "partition_id": (P, partition_ok),
                         "select_fields": (None, optional(field_names_ok))},
        "kv_batch_get_by_meta": {
            "meta": (KVBatchMeta(keys=["a"], partition_id=P, fields=["x"]), never),
            "select_fields": (None, optional(field_names_ok))},
        "kv_list": {"partition_id": (P, optional(partition_ok))},
        "kv_clear": {"keys": (["zzz-unknown"], lambda v: keys_ok(v) or (
                         isinstance(v, list) and bool(v) and all(map(name_ok, v)))),
                     "partition_id": (P, partition_ok)},
        "save_checkpoint": {"checkpoint_dir": (root / "sweep-ckpt", never),
                            "include_storage": (True, is_bool),
                            "metadata": ({"m": 1}, optional(json_dict_ok))},
        "load_checkpoint": {"checkpoint_dir": (root / "ckpt", never)},
        "dump_data_by_key": {"dump_dir": (root / "sweep-dump", never),
                             "keys": (["a", "b"], never), "partition_id": (P, partition_ok),
                             "via": ("units", never), "block": (True, is_bool)},
        "load_data_by_key": {"dump_dir": (root / "dump-ab", never),
                             "partition_id": (P, optional(partition_ok)),
                             "via": ("units", never)},
        "recover_data_load": {"dump_dir": (root / "dump-ab", never), "cancel": (False, is_bool)},
        "list_restores": {"partition_id": (P, optional(partition_ok))},
        "list_lost_keys": {"partition_id": (P, optional(partition_ok))},
        "read_row_index": {"dump_dir": (root / "dump-ab", never)},
    }


# --------------------------------------------------------------------------- the deployment
@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    state = tmp_path_factory.mktemp("sweep-state")
    tq.close()
    tq.init({"num_units": 2, "state_dir": str(state)})
    tq.kv_batch_put(["a", "b"], P, TensorDict({"x": torch.arange(6.).reshape(2, 3)},
                                              batch_size=[2]), tags=[{"t": 1}, {"t": 2}])
    tq.dump_data_by_key(root / "dump-ab", ["a", "b"], P)
    tq.save_checkpoint(root / "ckpt")
    yield root, state
    tq.close()


def journal_files(state: Path) -> dict:
    """sha256 of the controller journal's files (not -shm: readers touch it)."""
    out = {}
    for name in ("journal.sqlite", "journal.sqlite-wal"):
        p = state / name
        out[name] = hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
    return out


def visible(root: Path, state: Path) -> tuple:
    return tq.kv_list(), journal_files(state), snapshot(root)


def serves_a_put_and_a_get() -> None:
    tq.kv_put("probe", "sweep-probe", {"x": torch.full((3,), 7.0)})
    x = tq.kv_batch_get(["probe"], "sweep-probe")["x"]  # jagged: TransferQueue's shape
    assert [row.tolist() for row in x.unbind()] == [[7.0] * 3]
    tq.kv_clear(["probe"], "sweep-probe")


def undo(root: Path, result) -> None:
    """Undo what an accepted call made: keys put into PUT_P, a dump or a checkpoint."""
    if isinstance(result, tq.DumpHandle):
        result.result(timeout=60)
    keys = list(tq.kv_list(PUT_P).get(PUT_P, {}))
    if keys:
        tq.kv_clear(keys, PUT_P)
    for name in ("sweep-dump", "sweep-ckpt"):
        for p in root.glob(name + "*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _twin(fn_name: str):
    fn = getattr(tq, fn_name)
    if not fn_name.startswith("async_"):
        return fn
    return lambda **kw: asyncio.run(fn(**kw))


def _cases():
    out = []
    for name, args in ARGUMENTS.items():
        for arg in args:
            out.append((name, arg))
            if hasattr(api, f"async_{name}"):  # the same table's checks: the slow tier
                out.append(pytest.param(f"async_{name}", arg, marks=pytest.mark.slow))
    return out


def test_the_sweep_covers_every_public_function_and_argument(tmp_path):
    """The table and this sweep's baselines name every parameter of every API function."""
    base = baselines(tmp_path)
    public = [n for n in api.__all__ if inspect.isfunction(getattr(api, n))]
    for name in public:
        params = list(inspect.signature(getattr(api, name)).parameters)
        assert list(ARGUMENTS[name]) == params, name
        assert list(base.get(name, {})) == params, name
    twins = [n for n in dir(api) if n.startswith("async_")]
    for twin in twins:
        assert list(inspect.signature(getattr(api, twin)).parameters) == \
               list(ARGUMENTS[twin.removeprefix("async_")]), twin


@pytest.mark.parametrize("function, argument", _cases())
def test_wrong_values_are_refused_and_change_nothing(sweep, function, argument):
    root, state = sweep
    base = baselines(root)[function.removeprefix("async_")]
    accepted = base[argument][1]
    call = _twin(function)

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(value=WRONG)
    def run(value):
        counts = RAN.setdefault((function, argument), {"examples": 0, "refused": 0,
                                                       "accepted": 0})
        counts["examples"] += 1
        if function.endswith("close") and isinstance(value, bool):
            return  # accepted, and it would end the deployment: close's own tests do that
        kwargs = {a: v for a, (v, _) in base.items()}
        kwargs[argument] = value
        before = visible(root, state)
        refusal = f"{function.removeprefix('async_')}(): {argument} must be "
        try:
            result = call(**kwargs)
        except (TypeError, ValueError) as exc:
            if accepted(value):
                # an accepted shape may still be refused for its meaning (an unknown field,
                # a config key's value), never for its type
                assert not str(exc).startswith(refusal), (function, argument, value, str(exc))
            else:
                assert str(exc).startswith(refusal), (function, argument, value, str(exc))
            counts["refused"] += 1
            after = visible(root, state)
            assert after[0] == before[0], "kv_list changed"
            assert after[1] == before[1], "the controller journal changed"
            assert not diff(before[2], after[2]), diff(before[2], after[2])
        else:
            assert accepted(value), f"{function}({argument}={value!r}) was accepted"
            counts["accepted"] += 1
            undo(root, result)
        serves_a_put_and_a_get()

    run()


RAN: dict = {}  # (function, argument) -> examples run, refused, accepted


def test_every_case_ran_its_examples(capsys):
    """Runs after the sweep (module order): each case that ran got its examples; the totals
    are printed (-s not needed)."""
    if not RAN:
        pytest.skip("no sweep case ran in this session (deselected)")
    short = {case: c for case, c in RAN.items() if c["examples"] < EXAMPLES}
    assert not short, short
    total = {k: sum(c[k] for c in RAN.values()) for k in ("examples", "refused", "accepted")}
    with capsys.disabled():
        print(f"\nargument sweep: {len(RAN)} function/argument cases, {total['examples']} "
              f"examples ({total['refused']} refused, {total['accepted']} accepted), "
              f"{EXAMPLES} per case")
