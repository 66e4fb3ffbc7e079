"""Hand-placed hosts over TCP, CURVE on: three Linux network namespaces made by the test.

``tqtx-test-<random>-c`` holds the controller (``tqtx controller --host 0.0.0.0``) and the
client; ``-a`` and ``-b`` hold units (``tqtx unit --controller tcp://...``). Each unit
namespace is joined to the controller's by its own veth pair with two addresses of a
random 10.213.X.0/24 (/30 links): no other address is ever a target. The namespaces share
the filesystem, which is the "directory all hosts can reach". Everything is torn down in
a ``finally``. Skipped (with the reason) only where namespaces cannot be created.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tqtx.deploy.local import _read_announcement

# Under pytest-xdist these tests run one after another on one worker (they create and
# remove network namespaces and veth pairs of their own).
pytestmark = pytest.mark.xdist_group("netns")

IP = shutil.which("ip")


def _run(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=check)


class Hosts:
    """Three namespaces: ``c`` (controller, client) and unit hosts ``a`` and ``b``."""

    def __init__(self):
        self.tag = f"{random.randrange(16 ** 6):06x}"
        self.net = random.randrange(1, 255)
        self.ns = {h: f"tqtx-test-{self.tag}-{h}" for h in "cab"}
        # /30 links: c is .1 (to a) and .5 (to b); a is .2, b is .6
        self.addr = {"c_a": f"10.213.{self.net}.1", "a": f"10.213.{self.net}.2",
                     "c_b": f"10.213.{self.net}.5", "b": f"10.213.{self.net}.6"}
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []

    def up(self):
        for ns in self.ns.values():
            _run(IP, "netns", "add", ns)
            self.made.append(ns)
            _run(IP, "-n", ns, "link", "set", "lo", "up")
        for h in "ab":
            near, far = f"tq{self.tag}c{h}", f"tq{self.tag}{h}"
            _run(IP, "link", "add", near, "netns", self.ns["c"], "type", "veth", "peer", "name",
                 far, "netns", self.ns[h])
            _run(IP, "-n", self.ns["c"], "addr", "add", f"{self.addr['c_' + h]}/30", "dev", near)
            _run(IP, "-n", self.ns[h], "addr", "add", f"{self.addr[h]}/30", "dev", far)
            _run(IP, "-n", self.ns["c"], "link", "set", near, "up")
            _run(IP, "-n", self.ns[h], "link", "set", far, "up")

    def link_down(self, h):
        _run(IP, "-n", self.ns[h], "link", "set", f"tq{self.tag}{h}", "down")

    def start(self, host, args, env=None, what="process", prefix=()):
        proc = subprocess.Popen([IP, "netns", "exec", self.ns[host], *prefix, sys.executable,
                                 *args],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        msg = _read_announcement(proc, what, 60)
        assert "ready" in msg, msg
        return proc, msg

    def client(self, script, *args, timeout=120):
        out = subprocess.run([IP, "netns", "exec", self.ns["c"], sys.executable, "-c",
                              textwrap.dedent(script), *args], capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def down(self):
        self.stop_all()
        for ns in self.made:  # deleting a namespace deletes its veth ends too
            _run(IP, "netns", "delete", ns, check=False)


@pytest.fixture
def hosts():
    if IP is None:
        pytest.skip("no `ip` command: cannot create network namespaces")
    h = Hosts()
    try:
        try:
            h.up()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
        yield h
    finally:
        h.down()


def _deploy(hosts, state_dir, placement, env=None, prefix=None):
    """Controller in c, units as ``placement`` (unit id -> host); returns its address."""
    if not os.path.isdir(os.path.join(state_dir, "keys")):
        _run(sys.executable, "-m", "tqtx", "keys", "init", "--state-dir", state_dir)
    _, msg = hosts.start("c", ["-m", "tqtx", "controller", "--units", str(len(placement)),
                               "--host", "0.0.0.0", "--state-dir", state_dir], what="controller")
    port = msg["ready"].rsplit(":", 1)[1]
    for uid, h in sorted(placement.items()):
        ctl = f"tcp://{hosts.addr['c_' + h]}:{port}"
        hosts.start(h, ["-m", "tqtx", "unit", "--controller", ctl, "--unit-id", str(uid),
                        "--host", hosts.addr[h], "--keys-dir", os.path.join(state_dir, "keys"),
                        "--node", f"host-{h}"], env=env, what=f"unit {uid}",
                    prefix=(prefix or {}).get(h, ()))
    return f"tcp://{hosts.addr['c_a']}:{port}"


CLIENT = """
    import json, sys, torch
    from tensordict import TensorDict
    import tqtx as tq
    address, keys_dir, dump, step = sys.argv[1:5]
    tq.init({"address": address, "keys_dir": keys_dir, "timeout": 20})
    keys = [f"k{i}" for i in range(24)]
    out = {}
    if step == "put-dump":
        tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(24.), "t": torch.ones(24, 4)},
                                             batch_size=[24]), tags=[{"i": i} for i in range(24)])
        out["dump"] = tq.dump_data_by_key(dump, keys, "p")
        out["nodes"] = [u["node"] for u in tq.get_client().stats()["units"]]
    elif step == "restore":
        out["load"] = tq.load_data_by_key(dump)
        got = tq.kv_batch_get(keys, "p")
        out["x"] = got["x"].tolist()
        out["t"] = got["t"].sum().item()
        out["units"] = tq.get_client().topology["units"]
    elif step == "dump-unreachable":
        tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(24.)}, batch_size=[24]))
        try:
            tq.dump_data_by_key(dump, keys, "p")
            out["error"] = None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        import os
        out["left"] = sorted(os.listdir(os.path.dirname(dump)))
        out["client"] = tq.dump_data_by_key(dump, keys, "p", via="client")["via"]
    elif step == "dump-while-b-goes":
        try:
            tq.dump_data_by_key(dump, keys, "p")
            out["error"] = None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    tq.close()
    print(json.dumps(out, default=str))
"""

NO_KEYS = """
    import json, sys
    import tqtx as tq
    try:
        tq.init({"address": sys.argv[1], "insecure": True, "timeout": 3})
        print(json.dumps({"error": None}))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


@pytest.mark.slow
def test_units_on_other_hosts_put_dump_restore_and_refuse_keyless_clients(hosts, tmp_path):
    state = str(tmp_path / "state1")
    os.makedirs(state)
    keys_dir = os.path.join(state, "keys")
    address = _deploy(hosts, state, {0: "a", 1: "b"})
    dump = str(tmp_path / "dump")  # one filesystem for all hosts
    out = hosts.client(CLIENT, address, keys_dir, dump, "put-dump")
    assert out["dump"]["shards"] == 2 and out["nodes"] == ["host-a", "host-b"]

    refused = hosts.client(NO_KEYS, address)
    assert refused["error"] and "did not reply" in refused["error"]

    hosts.stop_all()
    state2 = str(tmp_path / "state2")
    os.makedirs(state2)
    shutil.copytree(keys_dir, os.path.join(state2, "keys"))  # the same keys, copied
    address = _deploy(hosts, state2, {0: "b", 1: "a", 2: "b"})  # other count, other hosts
    out = hosts.client(CLIENT, address, keys_dir, dump, "restore")
    assert out["x"] == [float(i) for i in range(24)] and out["t"] == 96.0
    assert out["units"][0].startswith(f"tcp://{hosts.addr['b']}:")
    assert out["units"][1].startswith(f"tcp://{hosts.addr['a']}:")


@pytest.mark.slow
def test_unit_host_gone_during_a_dump_names_unit_and_host(hosts, tmp_path):
    state = str(tmp_path / "state")
    os.makedirs(state)
    keys_dir = os.path.join(state, "keys")
    # the second dump's shard writes wait 5 s: host b's link goes down meanwhile (no reset
    # reaches anyone: only silence, as when a host loses power)
    address = _deploy(hosts, state, {0: "a", 1: "b"},
                      env={"TQTX_FAULTS": "unit.dump.before_write@2:delay:5"})
    dump = str(tmp_path / "dump")
    hosts.client(CLIENT, address, keys_dir, dump, "put-dump")
    with open(os.path.join(dump, "dump_info.json")) as f:
        first = json.load(f)["dump_id"]
    def cut_when_writing():  # b's link goes down once the units were asked to write
        parent, name = os.path.split(dump)
        for _ in range(2400):
            if any(n.startswith(name + ".tmp-") for n in os.listdir(parent)):
                break
            time.sleep(0.05)
        hosts.link_down("b")

    cutter = threading.Thread(target=cut_when_writing, daemon=True)
    cutter.start()
    out = hosts.client(CLIENT, address, keys_dir, dump, "dump-while-b-goes", timeout=240)
    cutter.join(150)
    assert out["error"] is not None
    assert f"unit 1 at tcp://{hosts.addr['b']}:" in out["error"] and "DUMP_ROWS" in out["error"]
    with open(os.path.join(dump, "dump_info.json")) as f:
        assert json.load(f)["dump_id"] == first  # old-or-new: still the old dump


@pytest.mark.slow
def test_a_unit_host_without_the_shared_directory_is_named_before_writing(hosts, tmp_path):
    state = str(tmp_path / "state")
    os.makedirs(state)
    shared = tmp_path / "shared"
    shared.mkdir()
    # host b does not share `shared`: its unit runs in its own mount namespace with an
    # empty tmpfs over that directory (a node-local disk at the same path)
    private = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs tqtx-test {shared} && exec "$0" "$@"')
    address = _deploy(hosts, state, {0: "a", 1: "b"}, prefix={"b": private})
    dump = shared / "dump"
    out = hosts.client(CLIENT, address, os.path.join(state, "keys"), str(dump),
                       "dump-unreachable")
    assert out["error"] and out["error"].startswith("TargetUnreachableError")
    assert "unit 1 at tcp://" + hosts.addr["b"] in out["error"]
    assert "unit 0" not in out["error"] and str(shared) in out["error"]
    assert out["left"] == []  # refused before anything was written (probes removed)
    assert out["client"] == "client"  # via="client" still works: the fallback
    assert (dump / "dump_info.json").is_file()
