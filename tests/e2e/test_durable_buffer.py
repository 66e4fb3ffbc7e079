"""A buffer that survives the whole job (durability buffer and sync): after a SIGKILL of
every process, a start on the same state dir brings back every acknowledged put bit for bit,
no cleared key comes back, and a unit killed alone comes back with its rows. Real processes,
loopback only, each test in its own state dir."""
from __future__ import annotations

import os
import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import api
from tqtx.errors import RowsLostError, TqtxError
from whole_job import kill_whole_job, wait_units_registered

pytestmark = pytest.mark.timeout(300)

PID = "p"


def _batch(keys, base: int) -> TensorDict:
    n = len(keys)
    return TensorDict({"v": torch.arange(base, base + n * 5, dtype=torch.int64).reshape(n, 5),
                       "w": torch.rand(n, 3, generator=torch.Generator().manual_seed(base))},
                      batch_size=[n])


def _read(keys) -> dict:
    td = tq.kv_batch_get(keys, PID)
    return {k: (td["v"][i].tolist(), td["w"][i].tolist()) for i, k in enumerate(keys)}


# quick tier: sync (nothing acknowledged lost); buffer also runs 20 whole-job kills below
@pytest.mark.parametrize("durability", [pytest.param("buffer", marks=pytest.mark.slow),
                                        "sync"])
def test_a_killed_job_comes_back_with_every_acknowledged_put(tq_start, tmp_path, durability):
    state = str(tmp_path / "state")
    cfg = {"durability": durability, "flush_interval_s": 0.2, "state_dir": state}
    tq_start(2, **cfg)
    keys = [f"k{i}" for i in range(40)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0), tags=[{"i": i} for i in range(40)])
    tq.kv_batch_put(keys[:10], PID, _batch(keys[:10], 1000))   # overwritten
    tq.kv_clear(keys[30:], PID)                                  # cleared
    tq.kv_batch_put(["late"], PID, _batch(["late"], 7))          # a reused index
    tq.kv_put("tag-only", PID + "-t", tag={"status": "running"})
    live = keys[:30] + ["late"]
    want = _read(live)
    if durability == "buffer":  # every put acknowledged more than the interval before
        time.sleep(0.5)
    kill_whole_job()

    tq_start(2, **cfg)
    wait_units_registered()
    assert sorted(tq.kv_list()[PID]) == sorted(live)
    assert tq.list_lost_keys() == {}
    assert _read(live) == want
    assert tq.kv_list(PID)[PID]["k3"] == {"i": 3}
    assert tq.kv_list(PID + "-t") == {PID + "-t": {"tag-only": {"status": "running"}}}
    stats = tq.get_client().stats()
    assert stats["controller"]["lost_rows"] == 0
    for u in stats["units"]:
        log = u["row_log"]
        assert log["dir"].endswith(f"units/unit-{u['unit_id']}") and log["error"] is None
        assert log["sync"] == (durability == "sync") and log["disk_bytes"] > 0
    # and the recovered buffer carries on: a put and a clear after the recovery
    tq.kv_batch_put(["new"], PID, _batch(["new"], 99))
    tq.kv_clear(["k0"], PID)
    assert "k0" not in tq.kv_list(PID)[PID] and _read(["new"]) == {
        "new": ([99, 100, 101, 102, 103], _batch(["new"], 99)["w"][0].tolist())}


def test_the_rows_of_a_unit_whose_log_is_gone_are_named_lost(tq_start, tmp_path):
    """A node that is gone (its unit's data directory with it): after the restart the other
    unit's rows are back bit for bit, and every row of the gone one is named lost, never
    silently missing."""
    state = str(tmp_path / "state")
    cfg = {"durability": "sync", "state_dir": state}
    tq_start(2, **cfg)
    keys = [f"k{i}" for i in range(40)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0))
    want = _read(keys)
    kill_whole_job()
    gone = os.path.join(state, "units", "unit-1")
    os.rename(gone, gone + ".elsewhere")   # the node and its disk are gone

    tq_start(2, **cfg)
    wait_units_registered()
    lost = set(tq.list_lost_keys().get(PID, {}))
    kept = [k for k in keys if k not in lost]
    assert lost and kept, (lost, kept)
    assert sorted(tq.kv_list()[PID]) == sorted(kept)       # lost ones are listed apart
    assert _read(kept) == {k: want[k] for k in kept}
    for key in sorted(lost)[:3]:
        with pytest.raises(RowsLostError, match=key):
            tq.kv_batch_get([key], PID)
    assert tq.get_client().stats()["controller"]["lost_rows"] == len(lost)


def test_a_unit_killed_alone_comes_back_with_its_rows(tq_start, tmp_path):
    tq_start(2, durability="buffer", flush_interval_s=0.2, state_dir=str(tmp_path / "state"))
    keys = [f"k{i}" for i in range(20)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0))
    want = _read(keys)
    time.sleep(0.5)  # every put acknowledged more than the interval before the kill
    dep = api._deployment
    proc = dep.procs["unit 0"]
    proc.kill()
    proc.wait(10)
    dep.restart_unit(0)
    wait_units_registered()
    assert tq.list_lost_keys() == {}
    assert _read(keys) == want


def test_a_clean_close_leaves_no_buffer_and_no_log(tq_start, tmp_path):
    state = str(tmp_path / "state")
    tq_start(2, durability="sync", state_dir=state)
    keys = [f"k{i}" for i in range(8)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0))
    units = os.path.join(state, "units")
    assert sorted(os.listdir(units)) == ["unit-0", "unit-1"]
    tq.close()
    assert not os.path.exists(units) or not any(
        f.endswith(".log") for _d, _s, files in os.walk(units) for f in files)
    tq_start(2, durability="sync", state_dir=state)
    assert tq.kv_list() == {}


def test_the_controller_setting_keeps_no_rows_across_a_killed_job(tq_start, tmp_path):
    state = str(tmp_path / "state")
    tq_start(2, durability="controller", state_dir=state)
    tq.kv_batch_put(["a", "b"], PID, _batch(["a", "b"], 0))
    assert not os.path.exists(os.path.join(state, "units"))
    kill_whole_job()
    tq_start(2, durability="controller", state_dir=state)
    assert tq.kv_list() == {} and tq.list_lost_keys() == {}


def test_a_logged_buffer_refuses_another_unit_count_and_says_how_to_move(tq_start, tmp_path):
    state = str(tmp_path / "state")
    tq_start(2, durability="buffer", flush_interval_s=0.2, state_dir=state)
    tq.kv_batch_put(["a", "b", "c"], PID, _batch(["a", "b", "c"], 0))
    want = _read(["a", "b", "c"])
    time.sleep(0.5)  # acknowledged more than the interval before the kill
    kill_whole_job()
    with pytest.raises(TqtxError, match="kept by 2 units in their row logs.*num_units=2"):
        tq_start(3, durability="buffer", state_dir=state)
    tq.close()
    tq_start(2, durability="buffer", state_dir=state)
    wait_units_registered()
    assert _read(["a", "b", "c"]) == want


def test_an_in_process_deployment_keeps_its_buffer_across_a_stop_that_keeps_it(tmp_path):
    from tqtx.testing import InProcessDeployment
    state = str(tmp_path / "state")
    with InProcessDeployment(2, state, durability="sync") as dep:
        dep.activate()
        tq.kv_batch_put(["a", "b", "c"], PID, _batch(["a", "b", "c"], 5))
        want = _read(["a", "b", "c"])
        dep.deactivate()
        dep.stop(keep_buffer=True)
    assert sorted(os.listdir(os.path.join(state, "units"))) == ["unit-0", "unit-1"]
    with InProcessDeployment(2, state, durability="sync") as dep:
        dep.activate()
        try:
            assert _read(["a", "b", "c"]) == want
        finally:
            dep.deactivate()
    assert not os.path.exists(os.path.join(state, "units", "unit-0", "seg-00000001.log"))


def test_a_checkpoint_of_a_logged_buffer_links_the_log_and_loads_as_saved(tq_start, tmp_path):
    import json
    ckpt = str(tmp_path / "ckpt")
    tq_start(2, durability="buffer", state_dir=str(tmp_path / "state"))
    keys = [f"k{i}" for i in range(12)]
    tq.kv_batch_put(keys, PID, _batch(keys, 0), tags=[{"i": i} for i in range(12)])
    # a field added to existing keys: their rows are two log entries, merged on replay
    tq.kv_batch_put(keys[:4], PID, TensorDict({"z": torch.ones(4, 2)}, batch_size=[4]))
    tq.kv_clear(keys[10:], PID)
    want = _read(keys[:10])
    want_z = [z.tolist() for z in tq.kv_batch_get(keys[:4], PID, select_fields=["z"])["z"]]
    tq.save_checkpoint(ckpt)
    manifest = json.load(open(os.path.join(ckpt, "checkpoint_info.json")))
    assert manifest["format_version"] == 3
    for entry in manifest["units"]:
        files = os.listdir(os.path.join(ckpt, entry["log"]["dir"]))
        assert sorted(f["file"] for f in entry["log"]["files"]) == sorted(files)
    assert not any(f.endswith(".bin") for f in os.listdir(os.path.join(ckpt, "units")))
    # the buffer moves on: overwrites, clears, new keys
    tq.kv_batch_put(keys[:10], PID, _batch(keys[:10], 500))
    tq.kv_clear(keys[:3], PID)
    tq.kv_batch_put(["after"], PID, _batch(["after"], 9))
    tq.load_checkpoint(ckpt)
    assert sorted(tq.kv_list()[PID]) == sorted(keys[:10])
    assert _read(keys[:10]) == want
    assert [z.tolist() for z in tq.kv_batch_get(keys[:4], PID, select_fields=["z"])["z"]] \
        == want_z == [[1.0, 1.0]] * 4
    assert tq.kv_list(PID)[PID]["k5"] == {"i": 5}
    # and into a deployment whose units keep no log
    tq_start(2, durability="controller", state_dir=str(tmp_path / "other"))
    tq.load_checkpoint(ckpt)
    assert _read(keys[:10]) == want


def test_a_corrupt_checkpoint_log_file_is_refused_before_any_unit_switches(
        tq_start, tmp_path):
    import json
    from tqtx.errors import DumpFormatError
    ckpt = str(tmp_path / "ckpt")
    tq_start(2, durability="buffer", state_dir=str(tmp_path / "state"))
    tq.kv_batch_put(["a", "b", "c", "d"], PID, _batch(["a", "b", "c", "d"], 0))
    tq.save_checkpoint(ckpt)
    tq.kv_batch_put(["a", "b", "c", "d"], PID, _batch(["a", "b", "c", "d"], 70))
    now = _read(["a", "b", "c", "d"])
    manifest = json.load(open(os.path.join(ckpt, "checkpoint_info.json")))
    entry = manifest["units"][0]
    victim = os.path.join(ckpt, entry["log"]["dir"], entry["log"]["files"][-1]["file"])
    data = bytearray(open(victim, "rb").read())
    data[-3] ^= 0xFF  # same size, a payload byte flipped
    open(victim, "wb").write(bytes(data))
    with pytest.raises(DumpFormatError, match="checksum does not match"):
        tq.load_checkpoint(ckpt)
    assert _read(["a", "b", "c", "d"]) == now


def _writer(wid: int, stop, acked: dict, cleared: dict) -> None:
    """Put this writer's own keys one after the other, clearing every third one after;
    record when each put and clear was acknowledged (monotonic clock)."""
    n = 0
    while not stop.is_set():
        key = f"w{wid}-{n}"
        try:
            tq.kv_batch_put([key], PID, _batch([key], wid * 100_000 + n))
            acked[key] = time.monotonic()
            if n % 3 == 2:
                old = f"w{wid}-{n - 2}"
                tq.kv_clear([old], PID)
                cleared[old] = time.monotonic()
        except Exception:  # noqa: BLE001 - the job is being killed under it
            return
        n += 1


@pytest.mark.slow
def test_whole_job_kills_under_buffer_keep_every_put_older_than_the_interval(
        tq_start, tmp_path):
    """8 writers put and clear; the whole job is SIGKILLed at a random moment and started
    again, twenty times (with the whole-job history tests' 2 x >= 15 under sync: >= 50).
    Every put acknowledged more than flush_interval_s before a kill is back bit for bit
    (unless a clear of it was acknowledged before the kill), every clear acknowledged that
    long before stays cleared."""
    import random
    import threading
    interval = 1.0  # the writer writes every half interval: half an interval of margin
    cfg = {"durability": "buffer", "flush_interval_s": interval,
           "state_dir": str(tmp_path / "state")}
    rng = random.Random()
    tq_start(2, **cfg)
    survivors: dict[str, int] = {}  # key -> the writer's value base, of every earlier round
    for rnd in range(20):
        stop = threading.Event()
        acked: dict[str, float] = {}
        cleared: dict[str, float] = {}
        writers = [threading.Thread(target=_writer, args=(w + 8 * rnd, stop, acked, cleared))
                   for w in range(8)]
        for t in writers:
            t.start()
        time.sleep(rng.uniform(1.5, 3.5))  # the kill comes at a random moment
        killed_at = time.monotonic()
        kill_whole_job()
        stop.set()
        for t in writers:
            t.join(30)
        tq_start(2, **cfg)
        wait_units_registered()
        listed = set(tq.kv_list().get(PID, {}))
        settled = killed_at - interval
        must = {k for k, t in acked.items() if t < settled and k not in cleared}
        gone = {k for k, t in cleared.items() if t < settled}
        assert must <= listed, f"round {rnd}: acknowledged puts lost: {sorted(must - listed)}"
        assert not gone & listed, f"round {rnd}: cleared keys back: {sorted(gone & listed)}"
        assert set(survivors) <= listed
        check = sorted(must | set(survivors))
        got = tq.kv_batch_get(check, PID)["v"] if check else []
        for key, row in zip(check, got):
            wid, n = key[1:].split("-")
            base = int(wid) * 100_000 + int(n)
            assert row.tolist() == list(range(base, base + 5)), f"round {rnd}: {key}"
        survivors.update({k: 0 for k in must})
        extra = sorted(listed - set(survivors))  # puts of the last interval: not carried on
        if extra:
            tq.kv_clear(extra, PID)
