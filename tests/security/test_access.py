"""Access control: loopback by default, CURVE (or an explicit --insecure) for anything else.

The CURVE tests bind this machine's own non-loopback IPv4 address (``hostname -I``); when
there is none they run on loopback with ``TQTX_CURVE=1``, which forces CURVE there.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import zmq
import zmq.auth
from click.testing import CliRunner
from tensordict import TensorDict

import tqtx as tq
from tqtx.wire import security
from tqtx.errors import PeerTimeoutError
from tqtx.wire.peer import Peer

pytestmark = pytest.mark.strict  # the tests compare dense columns


def _non_loopback_ip() -> str | None:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.split():
        try:
            ip = ipaddress.ip_address(word)
        except ValueError:
            continue
        if ip.version != 4 or ip.is_loopback:
            continue
        try:
            with socket.socket() as s:
                s.bind((word, 0))
        except OSError:
            continue
        return word
    return None


IP = _non_loopback_ip()


@pytest.fixture
def curve_host(monkeypatch):
    """A host whose bind requires CURVE: the machine's own IP, else loopback + TQTX_CURVE=1."""
    monkeypatch.delenv("TQTX_INSECURE", raising=False)
    monkeypatch.delenv("TQTX_KEYS_DIR", raising=False)
    monkeypatch.delenv("TQTX_SERVER_KEY", raising=False)
    if IP is None:
        monkeypatch.setenv("TQTX_CURVE", "1")
        return "127.0.0.1"
    monkeypatch.delenv("TQTX_CURVE", raising=False)
    return IP


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [f"k{i}" for i in range(n)]
    td = TensorDict({"obs": torch.randn(n, 3, generator=g),
                     "big": torch.randn(n, 2048, generator=g)}, batch_size=[n])
    return keys, td


# ---------------------------------------------------------------- unit level
def test_loopback_needs_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("TQTX_CURVE", raising=False)
    assert security.server_curve_for("127.0.0.1", str(tmp_path)) is None
    assert security.server_curve_for("localhost", None) is None
    assert security.server_curve_for("::1", None) is None
    assert security.client_curve_for(str(tmp_path), host="127.0.0.1") is None


def test_non_loopback_without_keys_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv("TQTX_INSECURE", raising=False)
    monkeypatch.delenv("TQTX_KEYS_DIR", raising=False)
    with pytest.raises(PermissionError, match="tqtx keys init"):
        security.server_curve_for("0.0.0.0", str(tmp_path))
    with pytest.raises(PermissionError, match="without authentication"):
        security.attach_curve("tcp://10.1.2.3:5555", state_dir=str(tmp_path))


def test_insecure_flag_allows_and_warns(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TQTX_INSECURE", "1")
    monkeypatch.delenv("TQTX_KEYS_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="tqtx.wire.security"):
        assert security.server_curve_for("0.0.0.0", str(tmp_path)) is None
        assert security.attach_curve("tcp://10.1.2.3:5555", state_dir=str(tmp_path)) is None
    assert sum("WITHOUT authentication" in r.getMessage() for r in caplog.records) == 2


def test_forced_curve_on_loopback_without_keys_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("TQTX_CURVE", "1")
    monkeypatch.delenv("TQTX_INSECURE", raising=False)
    monkeypatch.delenv("TQTX_KEYS_DIR", raising=False)
    with pytest.raises(PermissionError):
        security.server_curve_for("127.0.0.1", str(tmp_path))


def test_keys_init_cli(tmp_path):
    from tqtx.cli import main
    runner = CliRunner()
    res = runner.invoke(main, ["keys", "init", "--state-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout[: res.stdout.rindex("}") + 1])
    kd = tmp_path / "keys"
    assert info["keys_dir"] == str(kd)
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret",
                 "authorized/client.key"):
        assert (kd / name).is_file(), name
    assert (kd / "server.key_secret").stat().st_mode & 0o077 == 0
    assert (kd / "client.key_secret").stat().st_mode & 0o077 == 0
    assert kd.stat().st_mode & 0o077 == 0
    assert info["server_key"] == security.server_public_key(str(kd))
    assert len(info["server_key"]) == 40
    # the authorized key is the client's public key, and the server's is not authorized
    assert (kd / "authorized/client.key").read_bytes() == (kd / "client.key").read_bytes()
    # a second init refuses to clobber the keys; --force replaces them
    res2 = runner.invoke(main, ["keys", "init", "--state-dir", str(tmp_path)])
    assert res2.exit_code != 0 and "already holds keys" in res2.output
    res3 = runner.invoke(main, ["keys", "init", "--state-dir", str(tmp_path), "--force"])
    assert res3.exit_code == 0
    assert security.server_public_key(str(kd)) != info["server_key"]


# ---------------------------------------------------------------- whole deployments
@pytest.mark.skipif(IP is None, reason="no non-loopback IPv4 address on this machine")
def test_deployment_on_ip_without_keys_is_refused(tq_start, monkeypatch):
    monkeypatch.delenv("TQTX_INSECURE", raising=False)
    monkeypatch.delenv("TQTX_KEYS_DIR", raising=False)
    with pytest.raises(PermissionError, match="tqtx keys init"):
        tq_start(1, host=IP)


@pytest.mark.skipif(IP is None, reason="no non-loopback IPv4 address on this machine")
def test_deployment_on_ip_insecure_works_with_warning(tq_start, monkeypatch):
    monkeypatch.delenv("TQTX_INSECURE", raising=False)
    monkeypatch.delenv("TQTX_KEYS_DIR", raising=False)
    cfg = tq_start(1, host=IP, insecure=True)
    assert IP in cfg["address"]
    keys, td = _batch(3)
    tq.kv_batch_put(keys, "p", td)
    assert torch.equal(tq.kv_batch_get(keys, "p")["obs"], td["obs"])
    log = open(os.path.join(cfg["state_dir"], "logs", "controller.log")).read()
    assert "WITHOUT authentication" in log


def _all_refused(attempts: list, wait: float = 2.0) -> None:
    """Requests from peers without the right key get no reply at all.

    ``attempts``: ``(address, curve_configurator_or_None)``; all are sent at once, then
    every socket must stay silent for ``wait`` seconds.
    """
    from tqtx.wire.codec import encode
    ctx = zmq.Context.instance()
    socks = []
    try:
        for address, curve in attempts:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve(s)
            s.connect(address)
            for op in ("PING", "LIST"):
                try:  # a refused handshake can leave the socket no peer to queue for
                    s.send_multipart(encode({"op": op, "rid": op,
                                             "body": {"partition_id": None}}), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            socks.append((address, curve, s))
        poller = zmq.Poller()
        for *_, s in socks:
            poller.register(s, zmq.POLLIN)
        events = dict(poller.poll(wait * 1000))
        answered = [(a, c) for a, c, s in socks if s in events]
        assert not answered, f"peers without the right key got a reply: {answered}"
    finally:
        for *_, s in socks:
            s.close(0)


def test_curve_deployment_end_to_end(tq_start, curve_host, tmp_path):
    state = tmp_path / "curve-state"
    info = security.init_keys(state)
    cfg = tq_start(2, host=curve_host, state_dir=str(state))
    client = tq.get_client()
    assert client.curve is not None
    keys, td = _batch(8)
    tq.kv_batch_put(keys, "secret", td, tags=[{"i": i} for i in range(8)])
    got = tq.kv_batch_get(keys, "secret")
    assert torch.equal(got["big"], td["big"])

    # dump and transactional restore use controller<->unit connections in both directions
    dump = tmp_path / "dump"
    tq.dump_data_by_key(dump, keys[:5], "secret")
    rep = tq.load_data_by_key(dump, partition_id="restored")
    assert rep["keys"] == 5
    assert torch.equal(tq.kv_batch_get(keys[:5], "restored")["big"], td["big"][:5])

    controller = cfg["address"]
    unit0 = cfg["units"][0]
    # no key at all, a plaintext socket, and a keypair the servers do not authorize
    server_key = info["server_key"].encode()
    stranger_pub, stranger_sec = zmq.curve_keypair()

    def stranger(sock):
        sock.curve_serverkey = server_key
        sock.curve_publickey = stranger_pub
        sock.curve_secretkey = stranger_sec

    # a client that knows the server key but signs with the *server's* keypair
    spub, ssec = zmq.auth.load_certificate(info["server_secret"])

    def impostor(sock):
        sock.curve_serverkey = server_key
        sock.curve_publickey = spub
        sock.curve_secretkey = ssec

    # and one that has the authorized client keypair but the wrong server key
    cpub, csec = zmq.auth.load_certificate(info["client_secret"])
    wrong_pub, _ = zmq.curve_keypair()

    def wrong_server(sock):
        sock.curve_serverkey = wrong_pub
        sock.curve_publickey = cpub
        sock.curve_secretkey = csec

    _all_refused([(addr, curve) for addr in (controller, unit0)
                  for curve in (None, stranger, impostor, wrong_server)])
    # the Peer API reports the refusal as a timeout
    with pytest.raises(PeerTimeoutError):
        Peer(unit0, "intruder", timeout=1.0, curve=stranger).call("PING")

    # the deployment still serves its own clients after the failed handshakes
    assert torch.equal(tq.kv_batch_get(keys, "secret")["obs"], td["obs"])
    for u in range(2):
        assert client.unit(u).call("PING", timeout=10)["unit_id"] == u


_ATTACH = textwrap.dedent("""
    import json, os, sys
    import tqtx as tq
    cfg = json.loads(sys.argv[1])
    try:
        tq.init(cfg)
        client = tq.get_client()  # raw client calls: no torch import, fast start
        keys = sorted(client.list_keys("secret")["secret"])
        client.unit(1).call("PING")
        print("RESULT", json.dumps({"ok": True, "keys": keys}))
    except BaseException as exc:
        print("RESULT", json.dumps({"ok": False, "type": type(exc).__name__, "msg": str(exc)}))
    finally:
        tq.close()
""")


def _attach_all(runs: list) -> list:
    """Run attach attempts ``(cfg, env)`` in parallel subprocesses; their results in order."""
    procs = []
    for cfg, env in runs:
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("TQTX_KEYS_DIR", "TQTX_SERVER_KEY", "TQTX_INSECURE",
                                 "TQTX_STATE_DIR", "TQTX_CLIENT_KEY")}
        full_env.update(env or {})
        procs.append(subprocess.Popen([sys.executable, "-c", _ATTACH, json.dumps(cfg)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=full_env))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
                break
        else:
            raise AssertionError(err[-3000:])
    return results


@pytest.mark.slow
def test_curve_attach_from_other_processes(tq_start, curve_host, tmp_path):
    state = tmp_path / "curve-state"
    info = security.init_keys(state)
    cfg = tq_start(2, host=curve_host, state_dir=str(state))
    keys, td = _batch(4)
    tq.kv_batch_put(keys, "secret", td)
    expected = sorted(keys)
    address = cfg["address"]
    base = {"address": address, "timeout": 3}

    runs = [
        # the deployment's key and the authorized client keypair: served
        ({**base, "server_key": info["server_key"], "client_key": info["client_secret"]}, None),
        # the same through the environment (key dir of `tqtx keys init`)
        (base, {"TQTX_KEYS_DIR": info["keys_dir"]}),
        # the right server key but an unauthorized (ephemeral) client keypair: refused
        ({**base, "server_key": info["server_key"]}, None),
        # --insecure only skips the client-side check: the server still refuses
        ({**base, "insecure": True}, {"TQTX_CURVE": "0"}),
    ]
    if IP is not None:
        # no key at all: refused up front on a non-loopback address
        runs.append((base, None))
    results = _attach_all(runs)
    for ok in results[:2]:
        assert ok["ok"], ok
        assert ok["keys"] == expected
    for bad in results[2:4]:
        assert not bad["ok"] and bad["type"] == "PeerTimeoutError", bad
    if IP is not None:
        bad = results[4]
        assert not bad["ok"] and bad["type"] == "PermissionError", bad
        assert "without authentication" in bad["msg"]
    # the deployment is unaffected
    assert torch.equal(tq.kv_batch_get(keys, "secret")["obs"], td["obs"])


def test_curve_unit_restart_reregisters(tq_start, curve_host, tmp_path):
    """A unit started again (after dying) registers with the controller over CURVE."""
    state = tmp_path / "curve-state"
    security.init_keys(state)
    tq_start(2, host=curve_host, state_dir=str(state))
    from tqtx import api
    dep = api._deployment_handle()
    proc = dep.procs["unit 1"]
    proc.kill()
    proc.wait(10)
    dep.restart_unit(1)
    client = tq.get_client()
    client.refresh_topology()
    assert client.unit(1).call("PING", timeout=10)["unit_id"] == 1
