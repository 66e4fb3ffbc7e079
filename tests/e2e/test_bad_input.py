"""Bad input is refused up front with an error naming the key or field (issue 12, item 7).

Lone-surrogate strings cannot be encoded as UTF-8 (msgpack would raise a raw
UnicodeEncodeError mid-request); sparse, meta, quantized and mkldnn tensors have no strided
bytes to store (torch would raise an internal error). Each case runs against a real
deployment and checks that nothing was written. Conjugate / negative views hold a valid
value: they are materialized and stored.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq

BAD = "bad\udcff"


def _listed(pid) -> dict:
    return tq.kv_list(pid).get(pid, {})


def _assert_not_utf8(ei, value):
    message = str(ei.value)
    assert repr(value) in message and "not valid UTF-8" in message, message


# --------------------------------------------------------------------------- strings
def test_lone_surrogate_key_is_refused_before_sending(tq_shared, pid, tmp_path):
    x = torch.ones(2, 3)
    with pytest.raises(ValueError) as ei:
        tq.kv_put(BAD, pid, {"x": x[0]})
    _assert_not_utf8(ei, BAD)
    with pytest.raises(ValueError) as ei:
        tq.kv_batch_put(["fine", BAD], pid, TensorDict({"x": x}, batch_size=[2]))
    _assert_not_utf8(ei, BAD)
    assert _listed(pid) == {}  # not even the valid key of the batch
    tq.kv_put("fine", pid, {"x": x[0]})
    for call in (lambda: tq.kv_batch_get([BAD], pid), lambda: tq.kv_clear([BAD], pid),
                 lambda: tq.dump_data_by_key(tmp_path / "d", ["fine", BAD], pid)):
        with pytest.raises(ValueError) as ei:
            call()
        _assert_not_utf8(ei, BAD)
    assert not (tmp_path / "d").exists() and list(_listed(pid)) == ["fine"]


def test_lone_surrogate_partition_is_refused(tq_shared, tmp_path):
    bad_pid = "p\ud800"
    with pytest.raises(ValueError) as ei:
        tq.kv_put("k", bad_pid, {"x": torch.ones(3)})
    _assert_not_utf8(ei, bad_pid)
    with pytest.raises(ValueError) as ei:
        tq.kv_batch_put(["k"], bad_pid, TensorDict({"x": torch.ones(1, 3)}, batch_size=[1]))
    _assert_not_utf8(ei, bad_pid)
    with pytest.raises(ValueError) as ei:
        tq.dump_data_by_key(tmp_path / "d", ["k"], bad_pid)
    _assert_not_utf8(ei, bad_pid)
    assert bad_pid not in tq.kv_list() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("where", ["tag value", "tag key", "field name", "object value"])
def test_lone_surrogate_in_tags_fields_and_objects(tq_shared, pid, where):
    fields, tag = {"x": torch.ones(3)}, None
    if where == "tag value":
        tag = {"note": BAD}
    elif where == "tag key":
        tag = {BAD: 1}
    elif where == "field name":
        fields = {BAD: torch.ones(3)}
    else:
        fields = {"text": ["ok", BAD]}
    with pytest.raises(ValueError) as ei:
        tq.kv_put("k", pid, fields, tag=tag)
    _assert_not_utf8(ei, BAD)
    assert _listed(pid) == {}


# --------------------------------------------------------------------------- tensors
def _sparse_coo(n):
    return torch.eye(n, 3).to_sparse()


def _sparse_csr(n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.eye(n, 3).to_sparse_csr()


def _meta(n):
    return torch.empty(n, 3, device="meta")


def _quantized(n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation functions are deprecated
        return torch.quantize_per_tensor(torch.ones(n, 3), 0.1, 0, torch.quint8)


def _mkldnn(n):
    return torch.ones(n, 3).to_mkldnn()


UNSTORABLE = {"sparse_coo": (_sparse_coo, "sparse_coo"), "sparse_csr": (_sparse_csr, "sparse_csr"),
              "meta": (_meta, "meta"), "quantized": (_quantized, "quantized"),
              "mkldnn": (_mkldnn, "mkldnn")}


@pytest.mark.parametrize("kind", list(UNSTORABLE))
def test_unstorable_tensor_is_a_type_error_naming_the_field(tq_shared, pid, kind):
    make, said = UNSTORABLE[kind]
    td = TensorDict({"ok": torch.zeros(2, 3), "obs": make(2)}, batch_size=[2])
    with pytest.raises(TypeError) as ei:
        tq.kv_batch_put(["a", "b"], pid, td)
    assert "field 'obs'" in str(ei.value) and said in str(ei.value), str(ei.value)
    with pytest.raises(TypeError) as ei:
        tq.kv_put("c", pid, {"ok": torch.zeros(3), "obs": make(1)})
    assert "field 'obs'" in str(ei.value) and said in str(ei.value), str(ei.value)
    with pytest.raises(TypeError) as ei:  # inside an object value (or a tag) as well
        tq.kv_put("d", pid, {"obs": [make(1)]})
    assert "field 'obs'" in str(ei.value) and said in str(ei.value), str(ei.value)
    assert _listed(pid) == {}


@pytest.mark.strict
def test_conj_and_neg_views_are_stored_as_their_value(tq_shared, pid):
    z = torch.tensor([[1 + 2j, 3j], [-1j, 4 + 0j]], dtype=torch.complex64)
    conj, neg = z.conj(), z.conj().imag
    assert conj.is_conj() and neg.is_neg()
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"z": conj, "n": neg}, batch_size=[2]))
    tq.kv_put("c", pid, {"z": conj[0], "n": neg[1]}, tag={"t": conj[1]})
    got = tq.kv_batch_get(["a", "b", "c"], pid)
    want_z = torch.stack([conj.resolve_conj()[0], conj.resolve_conj()[1],
                          conj.resolve_conj()[0]])
    want_n = torch.stack([neg.resolve_neg()[0], neg.resolve_neg()[1], neg.resolve_neg()[1]])
    assert torch.equal(got["z"], want_z) and torch.equal(got["n"], want_n)
    assert torch.equal(_listed(pid)["c"]["t"], conj.resolve_conj()[1])
