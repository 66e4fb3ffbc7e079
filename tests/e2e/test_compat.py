"""TransferQueue 0.1.11 drop-in compatibility against real deployments: call shapes, the
exception types TransferQueue users catch, metadata.json, mixed fields, TransferQueue's
results by default and the opt-in strict mode. See docs/compatibility.md."""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import urllib.request

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq
from tq_procs import free_port_run
from tqtx import KVBatchMeta
from tqtx import format as fmt
from tqtx.client.tensors import to_raw

# TransferQueue 0.1.11 transfer_queue/interface.py: parameter names, kinds and defaults.
TQ_SIGNATURES = {
    "kv_put": "(key, partition_id, fields=None, tag=None, data_parser=None)",
    "kv_batch_put": "(keys, partition_id, fields=None, tags=None, data_parser=None)",
    "kv_batch_get": "(keys, partition_id, select_fields=None)",
    "kv_batch_get_by_meta": "(meta, select_fields=None)",
    "kv_list": "(partition_id=None)",
    "kv_clear": "(keys, partition_id)",
    "save_checkpoint": "(checkpoint_dir, *, include_storage=True, metadata=None)",
    "load_checkpoint": "(checkpoint_dir)",
    "init": "(conf=None)",
    "get_metrics_endpoint": "()",
    "get_client": "()",
    "close": "()",
}
TQ_ASYNC = ["kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list",
            "kv_clear"]


def rows(col) -> list:
    """A jagged (TransferQueue-shaped) column as nested lists, one per sample."""
    return [t.tolist() for t in col.unbind()]


def _bare(fn) -> inspect.Signature:
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                   for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)


def _accepts(ours: inspect.Signature, theirs: str) -> bool:
    """Every TransferQueue parameter, same name/kind/default and order; anything more is
    keyword-only with a default (so every TransferQueue call binds the same way)."""
    ns: dict = {}
    exec(f"def f{theirs}: pass", ns)
    want = list(inspect.signature(ns["f"]).parameters.values())
    have = list(ours.parameters.values())
    head, extra = have[:len(want)], have[len(want):]
    same = [(p.name, p.kind, p.default) for p in head] == \
           [(p.name, p.kind, p.default) for p in want]
    return same and all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra)


# ---------------------------------------------------------------- 1. call shapes
@pytest.mark.parametrize("name", sorted(TQ_SIGNATURES))
def test_signatures_accept_every_transferqueue_call(name):
    assert _accepts(_bare(getattr(tq, name)), TQ_SIGNATURES[name]), _bare(getattr(tq, name))
    if name in TQ_ASYNC:
        twin = getattr(tq, f"async_{name}")
        assert inspect.iscoroutinefunction(twin)
        assert _accepts(_bare(twin), TQ_SIGNATURES[name])


# TransferQueue 0.1.11 transfer_queue/client.py, TransferQueueClient (sync; the async forms
# take the same parameters plus the socket its decorator injects)
TQ_CLIENT_SIGNATURES = {
    "get_meta": "(data_fields, batch_size, partition_id, mode='fetch', task_name=None, "
                "sampling_config=None)",
    "set_custom_meta": "(metadata)",
    "put": "(data, metadata=None, partition_id=None, data_parser=None)",
    "get_data": "(metadata)", "clear_partition": "(partition_id)", "clear_samples": "(metadata)",
    "get_consumption_status": "(task_name, partition_id)",
    "get_production_status": "(data_fields, partition_id)",
    "check_consumption_status": "(task_name, partition_id)",
    "check_production_status": "(data_fields, partition_id)",
    "reset_consumption": "(partition_id, task_name=None)", "get_partition_list": "()",
    "kv_retrieve_meta": "(keys, partition_id, create=False)",
    "kv_retrieve_keys": "(global_indexes, partition_id)", "kv_list": "(partition_id=None)",
}


@pytest.mark.parametrize("name", sorted(TQ_CLIENT_SIGNATURES))
def test_client_calls_take_transferqueues_parameters(name):
    from tqtx.compat.dataplane import DataPlaneClient
    for method in (name, f"async_{name}"):
        fn = getattr(DataPlaneClient, method)
        sig = _bare(fn)
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self
        assert _accepts(sig, TQ_CLIENT_SIGNATURES[name]), (method, sig)
    assert inspect.iscoroutinefunction(getattr(DataPlaneClient, f"async_{name}"))


def test_kv_batch_meta_has_transferqueue_fields_and_methods():
    import dataclasses
    assert [f.name for f in dataclasses.fields(KVBatchMeta)] == [
        "keys", "tags", "partition_id", "fields", "extra_info"]
    m = KVBatchMeta(keys=["a", "b", "c"], tags=[{"i": 0}, {"i": 1}, {"i": 2}],
                    partition_id="p", fields=["x"], extra_info={"step": 3})
    assert m.size == len(m) == 3
    parts = m.chunk(2)
    assert [c.keys for c in parts] == [["a", "b"], ["c"]]
    assert all(c.extra_info == {"step": 3} and c.partition_id == "p" for c in parts)
    whole = KVBatchMeta.concat(parts)
    assert whole.keys == m.keys and whole.tags == m.tags and whole.extra_info == {"step": 3}
    assert m.select_keys(["c", "a"]).tags == [{"i": 2}, {"i": 0}]
    with pytest.raises(RuntimeError):
        m.select_keys(["zz"])
    m.reorder([2, 0, 1])
    assert m.keys == ["c", "a", "b"] and m.tags[0] == {"i": 2}
    with pytest.raises(ValueError):
        KVBatchMeta(keys=["a", "a"])
    with pytest.raises(ValueError):
        KVBatchMeta.concat([m, KVBatchMeta(keys=["d"], partition_id="other", fields=["x"])])


def test_transferqueue_call_shapes(tq_shared, pid, tmp_path):
    # a single str key wherever TransferQueue takes keys; select_fields as str or list
    meta = tq.kv_batch_put("one", pid, TensorDict({"x": torch.arange(3)[None]}, [1]),
                           tags=[{"status": "pending"}])
    assert meta.keys == ["one"] and meta.fields == ["x"]
    # as TransferQueue: the returned tags are the keys' tags as stored (merged)
    meta = tq.kv_batch_put("one", pid, TensorDict({"z": torch.ones(1)}, [1]), tags=[{"n": 1}])
    assert meta.tags == [{"status": "pending", "n": 1}] and meta.fields == ["x", "z"]
    assert tq.kv_put("one", pid, tag={"n": 2}).tags == [{"status": "pending", "n": 2}]
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 3, dtype=torch.int64),
                                                 "y": torch.zeros(2)}, [2]))
    assert rows(tq.kv_batch_get("one", pid, select_fields="x")["x"]) == [[0, 1, 2]]
    assert list(tq.kv_batch_get(["a", "b"], pid, select_fields=["y"]).keys()) == ["y"]
    m = KVBatchMeta(keys=["a", "b"], partition_id=pid, fields=["x", "y"])
    assert list(tq.kv_batch_get_by_meta(m, select_fields="y").keys()) == ["y"]
    # verl's re-issue: tags only, no fields
    tq.kv_batch_put(["a", "b"], pid, tags=[{"status": "pending"}] * 2)
    assert tq.kv_list(pid)[pid]["a"] == {"status": "pending"}
    tq.kv_clear("one", pid)
    assert sorted(tq.kv_list(pid)[pid]) == ["a", "b"]

    async def twins():
        await tq.async_kv_put("c", pid, {"x": torch.arange(3)}, tag={"s": 1}, data_parser=None)
        got = await tq.async_kv_batch_get("c", pid, select_fields="x")
        await tq.async_kv_clear("c", pid)
        return got
    assert rows(asyncio.run(twins())["x"]) == [[0, 1, 2]]
    assert "c" not in tq.kv_list(pid)[pid]

    # data_parser would ship code to the units: refused before anything is written
    for call in (lambda: tq.kv_put("new", pid, {"x": torch.ones(3)}, data_parser=dict),
                 lambda: tq.kv_batch_put(["new"], pid, TensorDict({"x": torch.ones(1, 3)}, [1]),
                                         data_parser=dict)):
        with pytest.raises(NotImplementedError, match="data_parser.*pickle"):
            call()
    assert "new" not in tq.kv_list(pid)[pid]
    with pytest.raises(ValueError, match="kv_batch_put"):  # as TransferQueue: one sample
        tq.kv_put("new", pid, {"x": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                               layout=torch.jagged)})

    # include_storage and metadata are keyword-only, as in TransferQueue
    with pytest.raises(TypeError):
        tq.save_checkpoint(tmp_path / "c", False)
    assert tq.get_metrics_endpoint() is None  # this deployment exports no metrics


def test_get_metrics_endpoint_names_the_controller_exporter(tq_start):
    pytest.importorskip("prometheus_client")
    base = free_port_run(3)
    tq_start(2, metrics={"enabled": True, "port": base})
    endpoint = tq.get_metrics_endpoint()
    assert endpoint == f"127.0.0.1:{base}"
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30) as r:
        assert b"tqtx" in r.read()
    tq.close()
    assert tq.get_metrics_endpoint() is None  # not initialized: None, as in TransferQueue


# ---------------------------------------------------------------- 3. errors
@pytest.mark.strict
def test_select_fields_not_produced_is_a_value_error(tq_shared, pid):
    tq.kv_put("a", pid, {"x": torch.ones(1)})
    tq.kv_put("b", pid, {"x": torch.ones(1), "y": torch.ones(1)})
    with pytest.raises(ValueError, match="select_fields.*'y' not found") as ei:
        tq.kv_batch_get(["a", "b"], pid, select_fields="y")
    assert isinstance(ei.value, tq.FieldsNotFoundError)  # the class crossed the wire
    assert isinstance(ei.value, KeyError) and "'a'" in str(ei.value)
    with pytest.raises(ValueError, match="select_fields.*not found"):
        tq.kv_batch_get_by_meta(KVBatchMeta(keys=["a"], partition_id=pid, fields=["x"]), "y")


def test_missing_files_are_file_not_found_naming_the_file(tq_shared, pid, tmp_path):
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.arange(4.0).reshape(2, 2)}, [2]))
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found.*no-ckpt"):
        tq.load_checkpoint(tmp_path / "no-ckpt")
    ck = tmp_path / "ck"
    tq.save_checkpoint(ck)
    tq.kv_put("after", pid, {"x": torch.ones(2)})
    (ck / "metadata.json").unlink()
    with pytest.raises(FileNotFoundError, match="metadata.json") as ei:
        tq.load_checkpoint(ck)
    assert ei.value.filename == str(ck / "metadata.json")
    assert "after" in tq.kv_list(pid)[pid]  # refused before anything was replaced

    with pytest.raises(FileNotFoundError, match="no-dump.*dump directory") as ei:
        tq.load_data_by_key(tmp_path / "no-dump", partition_id=pid + "-t")
    assert ei.value.filename == str(tmp_path / "no-dump")
    d = tmp_path / "d"
    tq.dump_data_by_key(d, ["a", "b"], pid)
    shards = sorted((d / fmt.SHARDS_DIR).glob("*.bin"))
    hidden = tmp_path / "hidden.bin"
    os.rename(shards[0], hidden)
    with pytest.raises(FileNotFoundError, match="shard file is missing") as ei:
        tq.load_data_by_key(d, partition_id=pid + "-t")
    assert ei.value.filename == str(shards[0])
    os.rename(hidden, shards[0])
    (d / fmt.MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="dump_info.json") as ei:
        tq.load_data_by_key(d, partition_id=pid + "-t")
    assert ei.value.filename == str(d / fmt.MANIFEST)
    assert pid + "-t" not in tq.kv_list()


def test_dump_of_unknown_partition_or_keys_is_a_runtime_error(tq_shared, pid, tmp_path):
    tq.kv_put("a", pid, {"x": torch.ones(1)})
    missing = pid + "-none"
    with pytest.raises(RuntimeError, match="does not exist") as ei:
        tq.dump_data_by_key(tmp_path / "d", ["a"], missing)
    assert isinstance(ei.value, tq.PartitionNotFoundError) and isinstance(ei.value, KeyError)
    assert str(ei.value) == f"partition {missing!r} does not exist (not found)"
    with pytest.raises(RuntimeError) as ei:
        tq.dump_data_by_key(tmp_path / "d", ["a", "zz"], pid)
    assert isinstance(ei.value, tq.KeysNotFoundError) and ei.value.keys == ["zz"]
    assert not (tmp_path / "d").exists()


def test_unknown_dump_format_version_is_a_value_error(tq_shared, pid, tmp_path):
    tq.kv_put("a", pid, {"x": torch.ones(1)})
    d = tmp_path / "d"
    tq.dump_data_by_key(d, ["a"], pid)
    m = json.loads((d / fmt.MANIFEST).read_text())
    m["format_version"] = 99
    (d / fmt.MANIFEST).write_text(json.dumps(m))
    for call in (lambda: tq.load_data_by_key(d, partition_id=pid + "-t"),
                 lambda: tq.read_row_index(d)):
        with pytest.raises(ValueError, match="Unsupported dump format version 99"):
            call()


def test_schema_conflict_on_load_is_a_runtime_error(tq_shared, pid, tmp_path):
    tq.kv_put("a", pid, {"x": torch.ones(2)})  # float32
    d = tmp_path / "d"
    tq.dump_data_by_key(d, ["a"], pid)
    target = pid + "-t"
    tq.kv_put("b", target, {"x": torch.arange(2)})  # int64
    with pytest.raises(RuntimeError, match="dtype mismatch") as ei:
        tq.load_data_by_key(d, partition_id=target)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, tq.SchemaConflictError)
    assert sorted(tq.kv_list(target)[target]) == ["b"]
    with pytest.raises(ValueError, match="dtype mismatch"):  # the same on a put
        tq.kv_put("c", target, {"x": torch.ones(2)})


def test_key_error_messages_cross_the_wire_once(tq_shared, pid):
    client = tq.get_client()
    with pytest.raises(KeyError) as ei:  # a plain KeyError raised inside the controller
        client.controller.call("TAKE_DUMP_TAGS", {"dump_id": "no-such-dump"})
    assert type(ei.value) is KeyError
    assert ei.value.args[0].startswith("the controller holds no tags for background dump "
                                       "no-such-dump")


def test_error_classes_survive_the_wire_mapping():
    from tqtx.wire.errors import error_payload, raise_remote
    cases = [tq.DumpNotFoundError("/d/x.bin: shard file is missing", "/d/x.bin"),
             tq.FieldsNotFoundError("select_fields: field 'y' not found"),
             tq.PartitionNotFoundError("partition 'p' does not exist"),
             tq.SchemaConflictError("field 'x': dtype mismatch"),
             tq.KeysNotFoundError(["k"], "p")]
    for exc in cases:
        with pytest.raises(type(exc)) as ei:
            raise_remote(error_payload(exc), "unit 0")
        assert str(ei.value) == str(exc)
    assert ei.value.keys == ["k"]
    with pytest.raises(FileNotFoundError) as ei:
        raise_remote(error_payload(cases[0]), "unit 0")
    assert ei.value.filename == "/d/x.bin"


# ---------------------------------------------------------------- 4. metadata.json
def test_checkpoint_metadata_json_is_transferqueue_layout(tq_shared, pid, tmp_path, caplog):
    tq.kv_put("a", pid, {"x": torch.arange(3)}, tag={"status": "running"})
    ck = tmp_path / "global_step_3" / "transfer_queue"
    tq.save_checkpoint(ck, metadata={"global_steps": 3})
    assert json.loads((ck / "metadata.json").read_text()) == {
        "storage_saved": True, "user_metadata": {"global_steps": 3}}
    tq.kv_clear("a", pid)
    res = tq.load_checkpoint(ck)
    assert res["metadata"] == {"global_steps": 3} and res["storage_saved"] is True
    assert rows(tq.kv_batch_get("a", pid)["x"]) == [[0, 1, 2]]

    # include_storage=False: as for TransferQueue's in-memory storage, the rows are saved
    with caplog.at_level(logging.WARNING, logger="tqtx.checkpoint"):
        tq.save_checkpoint(ck, include_storage=False, metadata={"global_steps": 4})
    assert "include_storage=False) has no effect" in caplog.text
    assert json.loads((ck / "metadata.json").read_text())["storage_saved"] is True
    tq.kv_clear("a", pid)
    assert tq.load_checkpoint(ck)["metadata"] == {"global_steps": 4}
    assert rows(tq.kv_batch_get("a", pid)["x"]) == [[0, 1, 2]]

    # a checkpoint of an earlier tqtx holds the user's dict itself
    (ck / "metadata.json").write_text(json.dumps({"step": 1}))
    assert tq.load_checkpoint(ck)["metadata"] == {"step": 1}


# ---------------------------------------------------------------- 5. mixed fields
def _same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert bytes(to_raw(a).data) == bytes(to_raw(b).data), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert type(a) is type(b) and a == b, where


MIXED = {
    "dtypes": [torch.tensor([1]), torch.tensor([1.5]), torch.tensor([-2], dtype=torch.int8)],
    "objects": [torch.tensor([True, False]), "text", {"t": torch.arange(2, dtype=torch.int16)}],
    "ranks": [torch.tensor(3.25, dtype=torch.float64), torch.ones(2, 2, dtype=torch.bfloat16),
              torch.tensor([float("nan")])],
}


def _check_mixed(pid, keys):
    td = tq.kv_batch_get(keys, pid)
    for field, rows in MIXED.items():
        col = td.get(field)
        assert isinstance(col, NonTensorStack), field
        for i, (want, got) in enumerate(zip(rows, col.tolist(), strict=True)):
            _same(want, got, f"{field}[{i}]")
    assert td["x"].tolist() == [0, 1, 2]


def test_mixed_fields_round_trip_bit_exact(tq_shared, pid, tmp_path):
    keys = ["k0", "k1", "k2"]
    td = TensorDict({f: NonTensorStack(*rows) for f, rows in MIXED.items()}, [3])
    td["x"] = torch.arange(3)
    with pytest.warns(UserWarning, match="stored as a non-tensor field"):
        tq.kv_batch_put(keys, pid, td)
    _check_mixed(pid, keys)
    # selective dump and restore into another partition
    tq.dump_data_by_key(tmp_path / "d", keys, pid)
    tq.load_data_by_key(tmp_path / "d", partition_id=pid + "-r")
    _check_mixed(pid + "-r", keys)
    # whole-system checkpoint
    tq.save_checkpoint(tmp_path / "ck")
    tq.kv_clear(keys, pid)
    tq.load_checkpoint(tmp_path / "ck")
    _check_mixed(pid, keys)


def test_kinds_mixed_across_puts_survive_dump_restore_and_checkpoint(tq_shared, pid, tmp_path):
    """TransferQueue accepts a field's tensor values in one put and non-tensor values in
    another (the default here too); every row comes back as it was put, through a dump,
    a restore into another partition and a checkpoint."""
    puts = {"a": torch.tensor([[7]]), "b": NonTensorStack("text"), "c": torch.tensor([[8]])}
    for key, value in puts.items():
        tq.kv_batch_put([key], pid, TensorDict({"x": value}, [1]))

    def check(p):
        values = tq.kv_batch_get(["a", "b", "c"], p)["x"].tolist()
        assert values[1] == "text" and torch.equal(values[0], torch.tensor([7]))
        assert torch.equal(values[2], torch.tensor([8]))
        only = tq.kv_batch_get(["a", "c"], p)["x"]  # all tensors: a jagged tensor
        assert rows(only) == [[7], [8]]
    check(pid)
    tq.dump_data_by_key(tmp_path / "d", ["a", "b", "c"], pid)
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    tq.load_data_by_key(tmp_path / "d", partition_id=pid + "-r")
    check(pid + "-r")
    tq.save_checkpoint(tmp_path / "ck")
    tq.kv_clear(["a", "b", "c"], pid)
    tq.load_checkpoint(tmp_path / "ck")
    check(pid)


# ---------------------------------------------------------------- 6. compat switch
def _seed(pid):
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.arange(6).reshape(2, 3)}, [2]))
    tq.kv_put("a", pid, {"y": torch.ones(2)})


def test_strict_mode_is_strict_and_dense(tq_start, pid):
    tq_start(2, strict=True)
    _seed(pid)
    with pytest.raises(tq.KeysNotFoundError, match="missing"):
        tq.kv_batch_get(["a", "missing", "b"], pid)
    with pytest.raises(ValueError, match="select_fields"):
        tq.kv_batch_get(["a", "b"], pid, select_fields=["x", "y"])
    x = tq.kv_batch_get(["a", "b"], pid)["x"]
    assert not x.is_nested and x.tolist() == [[0, 1, 2], [3, 4, 5]]


# The default in the quick tier; the two spellings that ask for the same results, each a
# deployment of its own, in the full suite.
@pytest.mark.parametrize("config", [{}, pytest.param({"compat": "transferqueue"},
                                                     marks=pytest.mark.slow),
                                    pytest.param({"strict": False}, marks=pytest.mark.slow)])
def test_default_reproduces_transferqueues_lenient_results(tq_start, pid, config):
    tq_start(2, **config)
    _seed(pid)
    td = tq.kv_batch_get(["b", "missing", "a"], pid)  # unknown keys are left out
    assert td.batch_size == torch.Size([2])
    x = td["x"]
    assert x.is_nested and x.layout == torch.jagged  # nested even with uniform shapes
    assert [t.tolist() for t in x.unbind()] == [[3, 4, 5], [0, 1, 2]]
    # a field not produced for every key is left out, as TransferQueue does
    assert list(tq.kv_batch_get(["a", "b"], pid, select_fields=["x", "y"]).keys()) == ["x"]
    assert torch.equal(tq.kv_batch_get("a", pid, select_fields="y")["y"].unbind()[0],
                       torch.ones(2))
    with pytest.raises(ValueError):  # nothing found at all
        tq.kv_batch_get(["missing"], pid)
    tq.close()
    with pytest.raises(ValueError, match="compat"):
        tq_start(2, compat="bogus")
    with pytest.raises(ValueError, match="contradicts"):
        tq_start(2, compat="transferqueue", strict=True)


def test_strict_env_opts_in_where_init_does_not_say(tq_start, pid, monkeypatch):
    tq_start(2)
    _seed(pid)
    monkeypatch.setenv("TQTX_STRICT", "1")
    with pytest.raises(tq.KeysNotFoundError):
        tq.kv_batch_get(["a", "missing"], pid)
    tq_start(2, strict=False)  # the config wins over the environment
    _seed(pid)
    assert tq.kv_batch_get(["a", "missing"], pid).batch_size == torch.Size([1])


def test_init_takes_transferqueue_conf_and_passes_version_gates(tmp_path):
    """``tq.init(conf=...)`` as TransferQueue spells it, and the version gate verl puts in
    front of checkpointing the buffer (``__version__ >= 0.1.9``) passes."""
    tq.close()
    try:
        conf = {"backend": {"SimpleStorage": {"num_data_storage_units": 3}},
                "state_dir": str(tmp_path / "state")}
        assert tq.init(conf=conf)["num_units"] == 3
    finally:
        tq.close()
    with pytest.raises(TypeError, match="conf or config"):
        tq.init(conf={}, config={})
    as_tuple = lambda v: tuple(int(x) for x in v.split(".")[:3])  # noqa: E731
    assert as_tuple(tq.__version__) >= (0, 1, 9)
    assert tq.TRANSFERQUEUE_API_VERSION == "0.1.11"
