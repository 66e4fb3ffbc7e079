"""The argument checks of the public API and of tq.init's config keys (issue 33, item 1).

Every refusal here happens before tqtx is even initialized: the checks run before anything
is sent or written, so these tests need no deployment (tests/e2e/test_argument_sweep.py
runs the same calls, generated, against one). Each message names the function (or the
config key), the argument, what it got and what it accepts.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import KVBatchMeta, api
from tqtx.errors import DumpFormatError, DumpNotFoundError, TqtxError
from tqtx.deploy.initconfig import resolve
from tqtx.arguments.table import ARGUMENTS, ArgumentTypeError, check_call, check_snapshot_names


@pytest.fixture(autouse=True)
def not_initialized():
    tq.close()
    assert api._client is None


def refused(exc_type, call, *words):
    with pytest.raises(exc_type) as ei:
        call()
    message = str(ei.value)
    for word in words:
        assert word in message, message
    return message


# --------------------------------------------------------------------------- issue 33's cases
@pytest.mark.parametrize("pid, exc", [(5, TypeError), (b"p", TypeError), ("", ValueError),
                                      ("  ", ValueError), (True, TypeError)])
def test_load_data_by_key_partition_id_must_be_a_non_blank_str(pid, exc):
    refused(exc, lambda: tq.load_data_by_key("some/dump", partition_id=pid),
            "load_data_by_key()", "partition_id", "non-blank str", repr(pid))


@pytest.mark.parametrize("fields", [5, [1, 2], "x", 2.5])
def test_fields_of_the_wrong_type_name_the_argument(fields):
    # kv_put: TransferQueue raises ValueError here; tqtx's error is both
    msg = refused(ArgumentTypeError, lambda: tq.kv_put("k", "p", fields=fields),
                  "kv_put(): fields must be a dict or a TensorDict", type(fields).__name__)
    assert isinstance(ValueError(msg), ValueError) and issubclass(ArgumentTypeError, ValueError)
    refused(TypeError, lambda: tq.kv_batch_put(["k"], "p", fields=fields),
            "kv_batch_put(): fields must be a TensorDict or a dict")


@pytest.mark.parametrize("select", [5, 2.0, b"x", {"a": 1}, [1], ["x", None]])
def test_select_fields_is_a_str_or_a_list_of_str(select):
    refused(TypeError, lambda: tq.kv_batch_get(["a"], "p", select_fields=select),
            "kv_batch_get(): select_fields must be a str or a list of str")
    meta = KVBatchMeta(keys=["a"], partition_id="p", fields=["x"])
    refused(TypeError, lambda: tq.kv_batch_get_by_meta(meta, select_fields=select),
            "kv_batch_get_by_meta(): select_fields")


def test_kv_clear_keys_and_partition_are_checked():
    refused(TypeError, lambda: tq.kv_clear([1, 2], "p"), "kv_clear(): keys", "int 1 at [0]")
    refused(TypeError, lambda: tq.kv_clear(["a"], None), "kv_clear(): partition_id",
            "NoneType None")
    refused(ValueError, lambda: tq.kv_clear([], "p"), "kv_clear(): keys", "empty list")


@pytest.mark.parametrize("block", ["no", 0, 1, None])
def test_dump_block_must_be_a_bool(block):
    refused(TypeError, lambda: tq.dump_data_by_key("d", ["a"], "p", block=block),
            "dump_data_by_key(): block must be True or False", repr(block))


@pytest.mark.parametrize("name, value", [
    ("save_checkpoint", {"checkpoint_dir": "c", "include_storage": "yes"}),
    ("recover_data_load", {"dump_dir": "d", "cancel": 1}),
    ("close", {"cancel_dumps": "true"}),
])
def test_other_flags_must_be_bools(name, value):
    refused(TypeError, lambda: getattr(tq, name)(**value), f"{name}()", "True or False")


@pytest.mark.parametrize("path, exc", [("", ValueError), ("   ", ValueError),
                                       (b"/tmp/d", TypeError), (5, TypeError),
                                       ("a\0b", ValueError), ("x" * 5000, ValueError)])
def test_paths(path, exc):
    for call in (lambda: tq.read_row_index(path), lambda: tq.load_checkpoint(path),
                 lambda: tq.dump_data_by_key(path, ["a"], "p")):
        refused(exc, call, "path")


def test_keys_follow_transferqueue_one_str_or_a_list():
    refused(TypeError, lambda: tq.kv_batch_get(("a", "b"), "p"),  # a tuple: TransferQueue's
            "kv_batch_get(): keys must be a str or a non-empty list")  # TypeError too
    refused(ValueError, lambda: tq.kv_batch_put([], "p"), "empty list")
    refused(ValueError, lambda: tq.kv_batch_put(["a", "a"], "p"), "duplicate")
    refused(ValueError, lambda: tq.kv_batch_get(["a", "x" * 70000], "p"),
            "70000 characters at [1]")
    refused(TypeError, lambda: tq.dump_data_by_key("d", "a", "p"),
            "one str is not a list of keys")


def test_put_shapes_must_match_the_keys():
    td = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    refused(ValueError, lambda: tq.kv_batch_put(["a", "b", "c"], "p", td),
            "kv_batch_put(): fields must be a batch of 3 rows", "batch size [2]")
    refused(ValueError, lambda: tq.kv_batch_put(["a"], "p", {"x": torch.ones(3)}),
            "columns of 1 rows", "shape [3]", "'x'")
    refused(ValueError, lambda: tq.kv_batch_put(["a"], "p", {"x": {"y": 1}}), "nested dict")
    refused(ValueError, lambda: tq.kv_batch_put(["a"], "p", {"x": 5}), "one int")
    refused(ValueError, lambda: tq.kv_batch_put(["a"], "p", td[:1], tags=[{}, {}]),
            "kv_batch_put(): tags must be one per key (1); got 2 tags")
    refused(TypeError, lambda: tq.kv_batch_put(["a"], "p", td[:1], tags=[5]), "int 5 at [0]")
    refused(ValueError, lambda: tq.kv_put("a", "p", td), "fields must be one sample")
    refused(TypeError, lambda: tq.kv_put("a", "p", {1: torch.ones(1)}), "field name int 1")
    refused(TypeError, lambda: tq.kv_put("a", "p", {"x": 1}, tag=[1]), "tag must be a dict")
    refused(TypeError, lambda: tq.kv_put("a", "p", data_parser=5), "data_parser")


def test_meta_and_metadata_and_init_arguments():
    refused(TypeError, lambda: tq.kv_batch_get_by_meta({"keys": ["a"]}), "meta must be")
    bad_meta = KVBatchMeta(keys=["a"], partition_id=5, fields=["x"])
    refused(TypeError, lambda: tq.kv_batch_get_by_meta(bad_meta), "meta.partition_id int 5")
    refused(TypeError, lambda: tq.save_checkpoint("c", metadata={"t": object()}),
            "metadata must be a dict JSON can write")
    refused(TypeError, lambda: tq.save_checkpoint("c", metadata=[1]), "metadata")
    refused(TypeError, lambda: tq.init(5), "init(): conf must be a dict or an OmegaConf")
    for address in ("", "localhost:5555", "tcp://h:0", "tcp://h:99999", "tcp://:5", 5):
        refused((TypeError, ValueError), lambda: tq.init(address=address),
                "init(): address must be a controller address")
    refused(TypeError, lambda: tq.kv_list(5), "kv_list(): partition_id")
    refused(TypeError, lambda: tq.list_restores(b"p"), "list_restores(): partition_id")


def test_a_value_outside_64_bits_in_a_tag_is_a_value_error_not_an_overflow():
    from tqtx.client.tensors import encode_object
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        encode_object({"n": 2 ** 70}, "tag")
    assert encode_object({"n": 2 ** 64 - 1, "m": -(2 ** 63)}, "tag") == \
        {"n": 2 ** 64 - 1, "m": -(2 ** 63)}


# --------------------------------------------------------------------------- accepted shapes
def test_transferqueue_shapes_are_accepted():
    """What TransferQueue 0.1.11 accepts passes the checks (then the call needs tqtx)."""
    td = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    meta = KVBatchMeta(keys=["a"], partition_id="p", fields=["x"])
    calls = [
        lambda: tq.kv_put("k", "p", {"x": torch.ones(3)}, tag={"t": 1}),
        lambda: tq.kv_put("", "p", TensorDict({"x": torch.ones(1, 3)}, batch_size=[1])),
        lambda: tq.kv_put("k", "p", tag={"only": "a tag"}),
        lambda: tq.kv_batch_put(["a", "b"], "p", td, tags=[{"t": 1}, None]),
        lambda: tq.kv_batch_put("a", "p", td[:1], tags=({"t": 1},)),
        lambda: tq.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 3), "s": ["u", "v"],
                                                  "c": "same for both"}),
        lambda: tq.kv_batch_get("a", "p", select_fields="x"),
        lambda: tq.kv_batch_get(["a", "b"], "p", select_fields=["x"]),
        lambda: tq.kv_batch_get(["a"], "p", select_fields=("x", "y")),
        lambda: tq.kv_batch_get_by_meta(meta, "x"),
        lambda: tq.kv_list(), lambda: tq.kv_list("p"),
        lambda: tq.kv_clear("a", "p"), lambda: tq.kv_clear(["a", "a"], "p"),
        lambda: tq.save_checkpoint(Path("c"), include_storage=False, metadata={"step": 1}),
        lambda: tq.load_checkpoint("c"),
        lambda: tq.dump_data_by_key(Path("d"), ("a", "b"), "p", via="client", block=False),
        lambda: tq.dump_data_by_key("d", {"a"}, "p"),
        lambda: tq.dump_data_by_key("d", [], "p"),
        lambda: tq.load_data_by_key("d", partition_id="other"),
        lambda: tq.recover_data_load("d", cancel=True),
        lambda: tq.list_restores("p"),
    ]
    for call in calls:
        with pytest.raises(TqtxError, match="not initialized"):
            call()


def test_every_public_function_is_in_the_table_with_its_parameters():
    import inspect
    for name in api.__all__:
        fn = getattr(api, name)
        if inspect.isfunction(fn):
            assert list(ARGUMENTS[name]) == list(inspect.signature(fn).parameters), name
    check_call("kv_list", {"partition_id": None})


# --------------------------------------------------------------------------- config keys
@pytest.mark.parametrize("config, exc, words", [
    ({"port": 99999}, ValueError, ["'port'", "0 to 65535", "int 99999"]),
    ({"port": -1}, ValueError, ["'port'"]),
    ({"port": "5555"}, TypeError, ["'port'", "str '5555'"]),
    ({"num_units": 2.7}, TypeError, ["'num_units'", "float 2.7"]),
    ({"num_units": "2"}, TypeError, ["'num_units'", "str '2'"]),
    ({"num_units": 0}, ValueError, ["'num_units'", "from 1"]),
    ({"num_units": True}, TypeError, ["'num_units'"]),
    ({"num_units": 10 ** 9}, ValueError, ["'num_units'"]),
    ({"timeout": -1}, ValueError, ["'timeout'", "above 0", "int -1"]),
    ({"timeout": 0}, ValueError, ["'timeout'"]),
    ({"timeout": math.nan}, ValueError, ["'timeout'"]),
    ({"timeout": math.inf}, ValueError, ["'timeout'"]),
    ({"timeout": "30"}, TypeError, ["'timeout'"]),
    ({"host": ""}, ValueError, ["'host'"]), ({"host": "a b"}, ValueError, ["'host'"]),
    ({"state_dir": ""}, ValueError, ["'state_dir'"]),
    ({"durability": ""}, ValueError, ["'durability'", "'memory', 'controller', 'buffer', 'sync'"]),
    ({"flush_interval_s": 0}, ValueError, ["'flush_interval_s'", "above 0"]),
    ({"unit_data_dir": ""}, ValueError, ["'unit_data_dir'"]),
    ({"insecure": "yes"}, TypeError, ["'insecure'", "True or False"]),
    ({"warm_dump": 1}, TypeError, ["'warm_dump'"]),
    ({"metrics": True}, TypeError, ["'metrics'"]),
    ({"metrics": {"enabled": "false"}}, TypeError, ["metrics.enabled"]),
    ({"metrics": {"port": 70000}}, ValueError, ["metrics.port"]),
    ({"env": {"A": 1}}, TypeError, ["'env'", "int 1"]),
    ({"unit_env": {"x": {}}}, TypeError, ["'unit_env'"]),
    ({"compat": "TQ"}, ValueError, ["'compat'"]),
    ({"placement": "slurm"}, ValueError, ["'placement'"]),
    ({"address": "127.0.0.1:5555"}, ValueError, ["'address'", "tcp://host:port"]),
    ({"backend": {"SimpleStorage": {"num_data_storage_units": "2"}}}, TypeError,
     ["'backend.SimpleStorage.num_data_storage_units'", "str '2'"]),
    ({"backend": {"SimpleStorage": {"num_data_storage_units": 2.7}}}, TypeError,
     ["'backend.SimpleStorage.num_data_storage_units'"]),
    ({"backend": {"SimpleStorage": {"required_node_resource": 5}}}, TypeError,
     ["'backend.SimpleStorage.required_node_resource'"]),
])
def test_config_values_are_checked_naming_the_key(config, exc, words):
    with pytest.raises(exc) as ei:
        resolve(config)
    for word in words:
        assert word in str(ei.value), str(ei.value)
    with pytest.raises(exc):  # and init refuses it before starting anything
        tq.init(config)
    assert api._client is None


def test_valid_configs_pass_and_none_means_the_default():
    assert resolve({"num_units": 3, "port": 0, "timeout": 1.5, "host": "127.0.0.1",
                    "metrics": {"enabled": False, "port": 0}, "durability": "normal",
                    "state_dir": Path("/tmp/x"), "unit_env": {0: {"A": "1"}}}) == {
        "num_units": 3, "port": 0, "timeout": 1.5, "host": "127.0.0.1",
        "metrics": {"enabled": False, "port": 0}, "durability": "normal",
        "state_dir": Path("/tmp/x"), "unit_env": {"0": {"A": "1"}}}
    assert resolve({"num_units": None, "timeout": None}) == {}
    assert resolve({"backend": {"SimpleStorage": {"num_data_storage_units": 4,
                                                  "total_storage_size": None}},
                    "controller": {"polling_mode": False}}) == {"num_units": 4,
                                                              "polling_mode": False}


def test_an_initialized_process_still_checks_the_config(tmp_path):
    tq.init({"num_units": 1, "state_dir": str(tmp_path / "s")})
    try:
        with pytest.raises(TypeError, match="'num_units'"):
            tq.init({"num_units": 2.7})
        assert tq.init({"num_units": 1})["mode"] == "embedded"
    finally:
        tq.close()


# --------------------------------------------------------------------------- files
def test_snapshot_partition_ids_and_keys_must_be_str():
    good = {"next_index": 2, "partitions": {"p": {"schema": {}, "rows": [["a", 0, [], {}]]}}}
    check_snapshot_names(good, "ckpt/controller.msgpack")
    for bad, word in [({"partitions": {5: {"rows": []}}}, "partition id int 5"),
                      ({"partitions": {b"p": {"rows": []}}}, "partition id bytes"),
                      ({"partitions": {"": {"rows": []}}}, "partition id str ''"),
                      ({"partitions": {"p": {"rows": [[7, 0, [], {}]]}}}, "key int 7"),
                      ({"partitions": [1]}, "no partitions map")]:
        with pytest.raises(DumpFormatError, match="ckpt/controller.msgpack") as ei:
            check_snapshot_names(bad, "ckpt/controller.msgpack")
        assert word in str(ei.value), str(ei.value)


def test_os_pathlike_paths_are_accepted(tmp_path):
    class P(os.PathLike):
        def __fspath__(self):
            return str(tmp_path / "d")
    with pytest.raises(DumpNotFoundError, match="dump directory not found"):
        tq.read_row_index(P())  # needs no deployment: it went on to read the path
