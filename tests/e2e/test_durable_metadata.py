"""Durable metadata (issue 15): what survives a controller restart, a unit that comes back
empty, restores and dumps in flight, the durability settings, a clean close, compaction and
a journal upgrade. Real processes (controller, units, writer processes), loopback only,
each test in its own state dir."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import api, faults
from tqtx import format as fmt

pytestmark = pytest.mark.timeout(300)

PID = "p"


# --------------------------------------------------------------------------- helpers
def _wait(cond, what: str, timeout: float = 30.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def _units_ready(timeout: float = 30.0) -> None:
    """Wait until every unit has (re-)registered with the current controller."""
    client = tq.get_client()
    _wait(lambda: client.controller.call("TOPOLOGY")["ready"], "the units to re-register",
          timeout)


def _restart_controller(**kwargs) -> None:
    dep = api._deployment
    before = dep.incarnation
    dep.restart_controller(**kwargs)
    assert dep.incarnation != before
    _units_ready()


def _wait_exit(proc, timeout: float = 60.0) -> None:
    _wait(lambda: proc.poll() is not None, "the controller to die at its fault point", timeout,
          0.05)


def _journal_show(state_dir) -> dict:
    """``tqtx journal show --json`` (the CLI, a real process)."""
    res = subprocess.run([sys.executable, "-m", "tqtx", "journal", "show", "--json",
                          "--state-dir", str(state_dir)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _batch(keys, base: int = 0, fields=("v",)) -> TensorDict:
    n = len(keys)
    cols = {f: torch.arange(base + j * 1000, base + j * 1000 + n * 3).reshape(n, 3)
            for j, f in enumerate(fields)}
    return TensorDict(cols, batch_size=[n])


def _owners(keys, pid=PID) -> dict[str, int]:
    client = tq.get_client()
    desc = client.controller.call("DESCRIBE_ROWS_BY_KEY", {"partition_id": pid, "keys": keys})
    return {k: client.owner(i) for k, i in zip(keys, desc["indexes"])}


def _rows(col) -> list:
    """A column's rows as lists, whatever its layout (jagged by default, dense if strict)."""
    return [t.tolist() for t in col.unbind()] if col.is_nested else col.tolist()


def _values(keys, pid=PID, field="v") -> dict[str, list]:
    td = tq.kv_batch_get(keys, pid, select_fields=[field])
    return dict(zip(keys, _rows(td[field])))


def _kill_unit(uid: int) -> None:
    proc = api._deployment.procs[f"unit {uid}"]
    proc.kill()
    proc.wait(10)


def _stats() -> dict:
    return tq.get_client().stats()


# --------------------------------------------------------------------------- 1. writers
WRITER = r"""
import json, os, sys, time
import torch, tqtx as tq
out, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = tq.init()
assert cfg["mode"] == "attached", cfg
open(out + ".ready", "w").close()
while not os.path.exists(out + ".go"):
    time.sleep(0.01)
ok, failed = [], []
for i in range(n):  # until told to stop (n bounds it)
    if os.path.exists(out + ".stop"):
        break
    key = f"w{wid}-{i}"
    try:
        tq.kv_put(key, "p", {"v": torch.tensor([wid, i, i * i])}, tag={"w": wid, "i": i})
        ok.append(key)
    except Exception as exc:
        failed.append([key, f"{type(exc).__name__}: {exc}"])
    with open(out + ".n.tmp", "w") as f:
        f.write(str(i + 1))
    os.replace(out + ".n.tmp", out + ".n")
with open(out + ".tmp", "w") as f:
    json.dump({"ok": ok, "failed": failed, "pid": os.getpid()}, f)
os.replace(out + ".tmp", out)
"""


def _progress(out: str) -> int:
    try:
        with open(out + ".n") as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_two_writers_carry_on_across_controller_kills(tq_start, tmp_path):
    n = 20000  # a bound only: the writers run until this test tells them to stop
    cfg = tq_start(2)
    env = {**os.environ, "TQTX_STATE_DIR": cfg["state_dir"]}
    env.pop("TQTX_ADDRESS", None)
    outs = [str(tmp_path / f"writer{w}.json") for w in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, outs[w], str(w), str(n)], env=env,
                              stdin=subprocess.DEVNULL) for w in range(2)]
    try:
        _wait(lambda: all(os.path.exists(o + ".ready") for o in outs), "the writers to attach",
              120)
        for o in outs:
            open(o + ".go", "w").close()
        mark = 0
        for _ in range(2):
            mark += 60
            _wait(lambda: min(map(_progress, outs)) >= mark, f"{mark} puts per writer", 120,
                  0.01)
            api._deployment.restart_controller()   # kill -9, same state dir and port
            mark = max(map(_progress, outs))
        # a put started before the last restart was announced may still fail
        settled = max(map(_progress, outs)) + 1
        # the writers carry on: each does 60 more puts, then they are told to stop
        _wait(lambda: min(map(_progress, outs)) >= settled + 60, "puts after the restarts",
              120, 0.01)
        for o in outs:
            open(o + ".stop", "w").close()
        for p in procs:
            assert p.wait(180) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    _units_ready()
    results = [json.load(open(o)) for o in outs]
    assert [r["pid"] for r in results] == [p.pid for p in procs]  # never restarted
    listed = tq.kv_list(PID)[PID]
    for w, r in enumerate(results):
        ok = r["ok"]
        # the writers carried on: their puts after the last restart succeeded
        assert [k for k, _ in r["failed"] if int(k.split("-")[1]) >= settled] == [], r
        got = _values(ok)
        for key in ok:
            i = int(key.split("-")[1])
            assert got[key] == [w, i, i * i], key
            assert listed[key] == {"w": w, "i": i}, key
        for key, _err in r["failed"]:   # fully visible with the right value, or absent
            if key in listed:
                i = int(key.split("-")[1])
                assert listed[key] == {"w": w, "i": i}, key
                assert _values([key])[key] == [w, i, i * i], key
    # kv_list lists no key that cannot be read
    everything = sorted(listed)
    assert len(_values(everything)) == len(everything)
    assert _stats()["controller"]["lost_rows"] == 0


# --------------------------------------------------------------------------- 2. unit lost
def test_unit_back_empty_names_lost_rows_and_a_dump_repairs_them(tq_start, tmp_path):
    cfg = tq_start(2)
    keys = [f"k{i}" for i in range(16)]
    extra = [f"x{i}" for i in range(8)]    # not in the dump
    again = [f"y{i}" for i in range(8)]    # put again after the loss
    td = _batch(keys, 0, fields=("v", "u"))
    tags = [{"i": i} for i in range(len(keys))]
    tq.kv_batch_put(keys, PID, td, tags=tags)
    tq.kv_batch_put(extra, PID, _batch(extra, 500, fields=("v", "u")),
                    tags=[{"x": i} for i in range(len(extra))])
    tq.kv_batch_put(again, PID, _batch(again, 900, fields=("v", "u")),
                    tags=[{"y": i} for i in range(len(again))])
    ref = _values(keys)
    dump = tmp_path / "dump"
    tq.dump_data_by_key(dump, keys, PID)
    owner = _owners(keys + extra + again)
    lost = {k for k, u in owner.items() if u == 0}
    assert lost and len(lost) < len(owner)

    _kill_unit(0)
    api._deployment.restart_unit(0)            # back, empty
    tq.get_client().refresh_topology()
    _units_ready()

    lost_keys = sorted(k for k in keys if k in lost)
    with pytest.raises(tq.RowsLostError) as ei:
        tq.kv_batch_get(keys, PID)
    err = ei.value
    assert isinstance(err, KeyError)
    assert sorted(err.keys) == lost_keys
    assert err.units == {k: 0 for k in lost_keys}
    assert {k: sorted(v) for k, v in err.fields.items()} == {k: ["u", "v"] for k in lost_keys}
    assert err.partition_id == PID
    msg = str(err)
    assert lost_keys[0] in msg and "unit 0" in msg and "v" in msg, msg
    live = [k for k in keys if k not in lost]
    assert _values(live) == {k: ref[k] for k in live}
    # kv_list leaves them out (code that samples it never picks them); list_lost_keys
    # names them with their tags, fields and unit, for re-generation
    listed = tq.kv_list(PID)[PID]
    assert set(listed) == (set(keys) | set(extra) | set(again)) - lost
    gone = tq.list_lost_keys(PID)[PID]
    assert set(gone) == lost and tq.list_lost_keys() == {PID: gone}
    assert all(gone[k] == {"tag": {"i": i}, "fields": ["u", "v"], "unit": 0}
               for i, k in enumerate(keys) if k in lost)
    n_lost = len(lost)
    assert _stats()["controller"]["lost_rows"] == n_lost
    for extra_args in (["--json"], []):  # `tqtx stats --lost` names them too
        out = subprocess.run([sys.executable, "-m", "tqtx", "stats", "--address", cfg["address"],
                              "--lost", *extra_args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        if extra_args:
            assert set(json.loads(out.stdout)["lost_keys"][PID]) == lost
        else:
            assert f"lost: partition {PID!r} key {sorted(lost)[0]!r} (unit 0" in out.stdout

    shown = _journal_show(cfg["state_dir"])
    buf = shown.get("buffer")
    if buf is not None:  # (test_journal_show_counts_lost_rows reports its absence)
        assert {b["partition_id"]: b["lost_rows"] for b in buf} == {PID: n_lost}, buf

    # a put of a lost key makes it live again with exactly the new fields
    y_lost = sorted(k for k in again if k in lost)
    if y_lost:
        new = TensorDict({"v": torch.full((len(y_lost), 3), 7)}, batch_size=[len(y_lost)])
        tq.kv_batch_put(y_lost, PID, new, tags=[{"new": 1}] * len(y_lost))
        got = tq.kv_batch_get(y_lost, PID)
        assert set(got.keys()) == {"v"}
        assert _rows(got["v"]) == [[7, 7, 7]] * len(y_lost)
        # tags merge as for any put: the old tag's entries stay, the new ones are added
        assert all(tq.kv_list(PID)[PID][k] == {"y": int(k[1:]), "new": 1} for k in y_lost)

    # a restore of the dump repairs the lost keys it holds
    tq.load_data_by_key(dump)
    assert _values(keys) == ref
    got = tq.kv_batch_get(keys, PID)
    assert set(got.keys()) == {"u", "v"}
    # lost keys not in the dump: kv_clear removes them
    x_lost = sorted(k for k in extra if k in lost)
    tq.kv_clear(x_lost, PID)
    listed = tq.kv_list(PID)[PID]
    assert not set(x_lost) & set(listed)
    assert _stats()["controller"]["lost_rows"] == 0 and tq.list_lost_keys() == {}
    assert len(_values(sorted(listed))) == len(listed)


def test_journal_show_counts_lost_rows(tq_start):
    """``tqtx journal show`` counts the lost rows (xfail while it does not)."""
    cfg = tq_start(2)
    keys = [f"k{i}" for i in range(6)]
    tq.kv_batch_put(keys, PID, _batch(keys))
    n_lost = sum(1 for u in _owners(keys).values() if u == 0)
    _kill_unit(0)
    api._deployment.restart_unit(0)
    tq.get_client().refresh_topology()
    _units_ready()
    assert _stats()["controller"]["lost_rows"] == n_lost
    shown = _journal_show(cfg["state_dir"])
    if "buffer" not in shown:
        pytest.xfail("tqtx journal show --json does not show lost rows (for the lead to add)")
    assert {b["partition_id"]: (b["keys"], b["lost_rows"]) for b in shown["buffer"]} == {
        PID: (len(keys), n_lost)}


# --------------------------------------------------------------------------- 3. restores
def _restore_across_restart(tq_start, tmp_path, fault: str):
    """Bystanders in "p", a dump of 10 keys; a restore into "r" whose controller dies at
    ``fault`` and is restarted without it. Returns (dump, bystander values, dump values,
    load outcome)."""
    cfg = tq_start(2, env={"TQTX_FAULTS": fault})
    by = [f"b{i}" for i in range(8)]
    tq.kv_batch_put(by, PID, _batch(by, 100), tags=[{"b": i} for i in range(len(by))])
    keys = [f"d{i}" for i in range(10)]
    tq.kv_batch_put(keys, "src", _batch(keys, 300), tags=[{"d": i} for i in range(len(keys))])
    dump = str(tmp_path / "dump")
    tq.dump_data_by_key(dump, keys, "src")
    ref = _values(keys, "src")
    outcome: dict = {}

    def load():
        try:
            outcome["report"] = tq.load_data_by_key(dump, partition_id="r")
        except BaseException as exc:  # checked by the caller
            outcome["error"] = exc

    t = threading.Thread(target=load, daemon=True)
    t.start()
    _wait_exit(api._deployment.procs["controller"])
    _restart_controller(env={"TQTX_FAULTS": ""})
    t.join(120)
    assert not t.is_alive()
    return cfg, dump, _values(by), ref, outcome


def test_restore_decided_before_a_controller_kill_is_rolled_forward(tq_start, tmp_path):
    cfg, dump, by, ref, outcome = _restore_across_restart(
        tq_start, tmp_path, "controller.restore.after_commit_decision:kill")
    tq.recover_data_load(dump)
    keys = sorted(ref)
    assert _values(keys, "r") == ref
    assert tq.kv_list("r")["r"] == {k: {"d": int(k[1:])} for k in keys}
    assert _values(sorted(by)) == by
    states = [r["state"] for r in _journal_show(cfg["state_dir"])["restores"]]
    assert states == ["committed"], (states, outcome)


def test_restore_undecided_at_a_controller_kill_is_aborted(tq_start, tmp_path):
    cfg, dump, by, ref, outcome = _restore_across_restart(
        tq_start, tmp_path, "controller.restore.after_staged:kill")
    assert "report" not in outcome, outcome
    assert tq.recover_data_load(dump) is True   # nothing pending: it was aborted at restart
    assert tq.kv_list("r").get("r", {}) == {}
    assert _values(sorted(by)) == by
    states = [r["state"] for r in _journal_show(cfg["state_dir"])["restores"]]
    assert states == ["aborted"], (states, outcome)
    # the restore can be run again
    tq.load_data_by_key(dump, partition_id="r")
    assert _values(sorted(ref), "r") == ref


# --------------------------------------------------------------------------- 4. dumps
def test_dump_in_flight_across_a_controller_restart_settles(tq_start, tmp_path,
                                                              point_reached):
    tq_start(2)
    keys = [f"k{i}" for i in range(12)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0))
    old = _values(keys)
    dump = tmp_path / "dump"
    tq.dump_data_by_key(dump, keys, PID)
    more = [f"m{i}" for i in range(4)]
    tq.kv_batch_put(more, PID, _batch(more, 700))
    new = _values(keys + more)
    outcome: dict = {}
    snapshot = point_reached("client.dump.after_snapshot")

    def run():
        try:
            outcome["report"] = tq.dump_data_by_key(dump, keys + more, PID)
        except BaseException as exc:
            outcome["error"] = exc

    faults.configure("client.dump.after_snapshot:delay:2.0")
    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert snapshot.wait(60)
        _restart_controller()
        t.join(120)
        assert not t.is_alive()
    finally:
        faults.configure("")
    assert fmt.verify_dump(dump)["ok"], fmt.verify_dump(dump)
    index = fmt.read_dump_index(dump)
    dumped = sorted(r[0] for r in index.rows)
    assert dumped in (sorted(keys), sorted(keys + more)), (dumped, outcome)
    if "report" in outcome:
        assert dumped == sorted(keys + more)
    # the buffer is intact
    assert _values(keys + more) == new
    # what the dump holds reads back
    tq.load_data_by_key(dump, partition_id="check")
    assert _values(dumped, "check") == {k: (new if dumped != sorted(keys) else old)[k]
                                        for k in dumped}


def test_background_dump_across_a_controller_restart_is_not_published(tq_start, tmp_path,
                                                                     point_reached):
    """The tags a block=False call left on the controller die with it: the dump fails
    cleanly, the old dump stays, the units drop their snapshots."""
    tq_start(2)
    keys = [f"k{i}" for i in range(12)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0), tags=[{"i": i} for i in range(12)])
    dump = tmp_path / "dump"
    tq.dump_data_by_key(dump, keys[:6], PID)
    snapshot = point_reached("client.dump.after_snapshot")
    faults.configure("client.dump.after_snapshot:delay:2.0")
    try:
        handle = tq.dump_data_by_key(dump, keys, PID, block=False)
        assert snapshot.wait(60)
        _restart_controller()
        with pytest.raises(KeyError, match="holds no tags for background dump"):
            handle.result(timeout=120)
    finally:
        faults.configure("")
    assert fmt.verify_dump(dump)["ok"]
    assert sorted(r[0] for r in fmt.read_dump_index(dump).rows) == sorted(keys[:6])
    _wait(lambda: all(u["open_dumps"] == [] for u in _stats()["units"]),
          "the units to drop the snapshots", 30, 0.2)
    # and a dump after the restart works, tags included
    tq.dump_data_by_key(dump, keys, PID, block=False).result(timeout=60)
    assert {k: r["tag"] for k, r in tq.read_row_index(dump)["rows"].items()} == \
        {k: {"i": i} for i, k in enumerate(keys)}


# --------------------------------------------------------------------------- 5. durability
def test_durability_memory_forgets_keys_at_a_controller_restart(tq_start):
    tq_start(2, durability="memory")
    keys = [f"k{i}" for i in range(10)]
    tq.kv_batch_put(keys, PID, _batch(keys))
    st = _stats()
    assert st["controller"]["durability"] == "memory"
    assert sum(u["rows"] for u in st["units"]) == len(keys)
    _restart_controller()
    assert tq.kv_list(PID).get(PID, {}) == {}
    assert _stats()["controller"]["durability"] == "memory"
    # the units drop the rows the new controller does not know
    _wait(lambda: sum(u["rows"] for u in _stats()["units"]) == 0, "the orphan rows to drop",
          30, 0.2)


@pytest.mark.parametrize("durability", ["controller", "buffer", "sync", None])
def test_durability_controller_buffer_and_sync_keep_keys(tq_start, durability):
    cfg = {"durability": durability} if durability else {}
    tq_start(2, **cfg)
    keys = [f"k{i}" for i in range(10)]
    tq.kv_batch_put(keys, PID, _batch(keys, 40), tags=[{"i": i} for i in range(len(keys))])
    ref = _values(keys)
    assert _stats()["controller"]["durability"] == (durability or "controller")
    _restart_controller()
    assert _stats()["controller"]["durability"] == (durability or "controller")
    assert tq.kv_list(PID)[PID] == {k: {"i": i} for i, k in enumerate(keys)}
    assert _values(keys) == ref
    assert _stats()["controller"]["lost_rows"] == 0


# --------------------------------------------------------------------------- 6. close
def test_close_by_the_creator_ends_the_buffer(tq_start, tmp_path):
    state = str(tmp_path / "state")
    tq_start(2, state_dir=state)
    keys = [f"k{i}" for i in range(5)]
    tq.kv_batch_put(keys, PID, _batch(keys))
    tq.close()
    tq_start(2, state_dir=state)
    assert tq.kv_list() == {}
    assert _stats()["controller"]["lost_rows"] == 0


def test_crash_of_the_whole_job_starts_empty_and_says_so(tq_start, tmp_path):
    """No unit kept a row of the dead deployment: the next init starts empty, as
    TransferQueue does; the controller logs how many keys went and journals it."""
    state = str(tmp_path / "state")
    tq_start(2, state_dir=state)
    keys = [f"k{i}" for i in range(5)]
    tq.kv_batch_put(keys, PID, _batch(keys), tags=[{"i": i} for i in range(len(keys))])
    tq.kv_put("t", PID + "-tags", tag={"status": "running"})  # a key without fields too
    # what a kill -9 of the whole deployment leaves: no END_BUFFER
    dep = api._deployment
    dep.stop(graceful=False)
    api._client.close()
    api._client = api._deployment = api._config = None
    tq_start(2, state_dir=state)
    assert tq.kv_list() == {} and tq.list_lost_keys() == {}
    assert _stats()["controller"]["keys"] == 0
    tq.kv_put("k0", PID, {"v": torch.ones(3)})  # a new buffer, usable at once
    assert _values(["k0"]) == {"k0": [1.0, 1.0, 1.0]}
    events = [e for e in _journal_show(state)["recovery_events"] if e["kind"] == "buffer"]
    assert [e["action"] for e in events] == ["dropped"]
    assert events[0]["detail"].startswith("6 keys in 2 partitions of the previous deployment")
    with open(os.path.join(state, "logs", "controller.log")) as f:
        assert "startup: dropped 6 keys in 2 partitions" in f.read()


def test_controller_restart_with_live_units_holding_no_row_keeps_every_key(tq_start):
    """Tag-only keys and a unit emptied by clears: the units hold no row, yet they served
    the old controller, so the deployment is alive and its keys stay (not a dead buffer)."""
    tq_start(2)
    tq.kv_put("t", PID, tag={"status": "running"})
    tq.kv_put("gone", PID, {"v": torch.ones(3)})
    tq.kv_clear(["gone"], PID)
    _restart_controller()
    assert tq.kv_list(PID) == {PID: {"t": {"status": "running"}}}
    assert _stats()["controller"]["keys"] == 1


# --------------------------------------------------------------------------- 7. compaction
def _journal_sizes(state_dir) -> tuple[int, int]:
    base = os.path.join(state_dir, "journal.sqlite")
    return tuple(os.path.getsize(p) if os.path.exists(p) else 0 for p in (base, base + "-wal"))


def _wal_cap(path) -> int:
    """SQLite checkpoints the WAL once it holds wal_autocheckpoint pages (and reuses the
    file from its start): the WAL file's steady size."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (page,) = con.execute("PRAGMA page_size").fetchone()
    finally:
        con.close()
    return 1000 * page  # the default wal_autocheckpoint (tqtx does not change it)


def test_put_clear_cycles_keep_the_journal_flat(tq_start):
    cfg = tq_start(2)
    keys = [f"k{i}" for i in range(50)]
    td = _batch(keys)
    sizes = {}
    for cycle in range(1, 201):
        tq.kv_batch_put(keys, PID, td, tags=[{"c": cycle}] * len(keys))
        tq.kv_clear(keys, PID)
        if cycle in (20, 150, 200):
            sizes[cycle] = _journal_sizes(cfg["state_dir"])
    path = os.path.join(cfg["state_dir"], "journal.sqlite")
    total = {c: db + wal for c, (db, wal) in sizes.items()}
    # The WAL grows to SQLite's checkpoint size (~4 MiB) before its first checkpoint
    # (around cycle 100 here), then stays; the database file stays small.
    assert total[200] <= 1.5 * total[20] + _wal_cap(path) + 64 * 1024, sizes
    assert total[200] <= total[150] + 64 * 1024, sizes
    assert sizes[200][0] <= 256 * 1024, sizes
    live = [f"live{i}" for i in range(7)]
    tq.kv_batch_put(live, PID, _batch(live))
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT partition_id, key FROM meta_keys").fetchall()
    finally:
        con.close()
    assert sorted(rows) == sorted((PID, k) for k in live)


# --------------------------------------------------------------------------- 8. upgrade
@pytest.mark.slow
def test_journal_at_c0002_with_an_unfinished_restore_migrates_and_serves(tq_start, tmp_path):
    from tqtx.journal.migrate import migrate
    from tqtx.layout.paths import controller_journal_path
    state = tmp_path / "state"
    state.mkdir()
    path = controller_journal_path(state)
    assert migrate(path, "controller", "c0002") == (None, "c0002")
    con = sqlite3.connect(path)
    with con:
        con.execute("INSERT INTO incarnations (id, started_at, pid, host, address, version, "
                    "state_dir) VALUES (7, '2024-01-01T00:00:00+00:00', 42, 'h', 'tcp://h:1', "
                    "'0.0.9', ?)", (str(state),))
        con.execute("INSERT INTO restores (restore_id, partition_id, dump_dir, dump_id, "
                    "incarnation_id, state, keys, rows, bytes, created_at, updated_at) VALUES "
                    "('r1', 'train', ?, 'd1', 7, 'active', 5, 6, 0, 't0', 't0')",
                    (str(tmp_path / "gone"),))
        con.execute("INSERT INTO restore_units (restore_id, unit_id, state, rows, bytes, "
                    "created_at, updated_at) VALUES ('r1', 0, 'claimed', 3, 0, 't0', 't0')")
    con.close()
    tq_start(2, state_dir=str(state))
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (rev,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()
    assert rev == "c0008" and "meta_keys" in tables
    (rec,) = [r for r in _journal_show(state)["restores"] if r["restore_id"] == "r1"]
    assert rec["state"] in ("aborted", "failed"), rec
    keys = [f"k{i}" for i in range(4)]
    tq.kv_batch_put(keys, PID, _batch(keys, 5), tags=[{"i": 1}] * len(keys))
    assert _values(keys) == {k: v for k, v in zip(keys, _batch(keys, 5)["v"].tolist())}
    _restart_controller()
    assert _values(keys) == {k: v for k, v in zip(keys, _batch(keys, 5)["v"].tolist())}
