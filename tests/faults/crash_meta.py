"""Crash matrix, metadata part (issue 15): kill -9 the controller at a ``controller.meta.<op>.
<stage>`` point, restart the controller alone on the same state dir while the units keep
running (role ``units-alive``), and check what the journaled metadata kept. Used by
test_crash_matrix.py; the invariants per op are in :func:`meta_case`."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from buffers import assert_same_value
from crash import Run, _copy_dump, _settle, assert_journals_final, assert_listed_readable
from tqtx import api
from tqtx.errors import RowsLostError
from tqtx.wire.peer import Peer

ROLE = "units-alive"
OLD = [f"a{i}" for i in range(6)]
WAIT = 30.0   # bound on each wait of a case (the controller to die, to come back, the op)


def _rows(keys, base: int) -> dict:
    return {k: {"x": torch.arange(base + 3 * i, base + 3 * i + 3)} for i, k in enumerate(keys)}


def _put(pid: str, rows: dict, tag: dict) -> None:
    keys = list(rows)
    td = TensorDict({"x": torch.stack([rows[k]["x"] for k in keys])}, batch_size=[len(keys)])
    tq.kv_batch_put(keys, pid, td, tags=[dict(tag) for _ in keys])


def _read(pid: str, key: str) -> torch.Tensor:
    return tq.kv_batch_get([key], pid, select_fields=["x"])["x"][0]


def _owner(pid: str, keys) -> dict:
    res = tq.get_client().controller.call("LOOKUP", {"partition_id": pid, "keys": list(keys)})
    return {k: i % res["num_units"] for k, i in zip(keys, res["indexes"])}


class MetaRun(Run):
    """A matrix run whose controller is killed at a metadata point and restarted alone."""

    def __init__(self, tmp_path, point: str, nth: int):
        super().__init__(tmp_path, point, "kill", nth, ROLE)

    def crash_and_restart(self, fn, after_restart=None) -> None:
        """Run ``fn`` in a thread; once the controller died at the point, restart it on the
        same state dir without the fault, wait for ``fn``; ``after_restart`` then repairs
        what else died, and every unit must be registered again."""
        dep = api._deployment
        ctl = dep.procs["controller"]
        done: dict = {}

        def op():
            try:
                fn()
                done["outcome"] = "ok"
            except Exception as exc:  # noqa: BLE001 - any failure is allowed; invariants decide
                done["outcome"], done["error"] = "error", f"{type(exc).__name__}: {exc}"
        t = threading.Thread(target=op, daemon=True)
        t.start()
        deadline = time.monotonic() + WAIT
        while ctl.poll() is None and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        # a point after the reply (a checkpoint load's keys) kills it once fn has returned
        while ctl.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl.poll() is not None, (self.spec, "the controller did not die", done)
        dep.restart_controller(env={"TQTX_FAULTS": ""})
        self.restarted.add("controller")
        t.join(WAIT + 30)
        assert not t.is_alive(), (self.spec, "the operation did not end after the restart")
        if after_restart is not None:
            after_restart()
        self._note_pids()
        self.wait_ready()
        self.outcome, self.error = done["outcome"], done.get("error", "")

    def wait_ready(self) -> None:
        """Every unit registered with the (new) controller, and the client follows it."""
        peer = Peer(api._deployment.address, "controller", timeout=5.0)
        try:
            deadline = time.monotonic() + WAIT
            while not peer.call("TOPOLOGY")["ready"]:
                assert time.monotonic() < deadline, "the units did not re-register"
                time.sleep(0.1)
        finally:
            peer.close()
        tq.get_client().refresh_topology()

    def assert_no_orphans(self, rowless=frozenset()) -> None:
        """Each unit ends up holding exactly the live rows it owns: rows of a put that never
        committed or of a committed clear are dropped when it re-registers. ``rowless``:
        (partition, key) of listed keys that hold no row (a restored tag-only key)."""
        listed = tq.kv_list()
        want = {u: 0 for u in range(self.num_units)}
        for pid, keys in listed.items():
            for k, u in _owner(pid, keys).items():
                want[u] += (pid, k) not in rowless
        deadline = time.monotonic() + 10
        while True:
            got = {u: tq.get_client().unit(u).call("STATS")["rows"] for u in want}
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == want, f"rows held per unit {got}, live keys per unit {want}"

    def assert_works(self) -> None:
        """Nothing is blocked: a new put reads back."""
        _put("after", _rows(["w0", "w1", "w2"], 900), {"w": 1})
        assert torch.equal(_read("after", "w2"), torch.arange(906, 909))


# --------------------------------------------------------------------------- the ops
def _commit_put(run: MetaRun, ref) -> dict:
    old, z = _rows(OLD, 0), _rows(["z"], 500)
    _put("p", old, {"v": 0})
    _put("other", z, {"o": 1})
    new = _rows(["n0", "n1", "n2", "a1"], 100)
    run.crash_and_restart(lambda: _put("p", new, {"v": 1}))
    listed = tq.kv_list()
    expected = {"p": dict(old), "other": z}
    if run.outcome == "ok":
        for k, row in new.items():
            assert listed["p"][k] == {"v": 1}, (k, listed["p"].get(k))
            assert torch.equal(_read("p", k), row["x"]), k
    for k, row in new.items():
        if k not in listed["p"]:
            assert k != "a1", "the overwritten key is gone"
            with pytest.raises(KeyError):
                _read("p", k)
            continue
        got = _read("p", k)
        if k == "a1":   # the unit may hold the new value before COMMIT_PUT published it
            assert torch.equal(got, row["x"]) or torch.equal(got, old[k]["x"]), got
            assert listed["p"][k] in ({"v": 0}, {"v": 1}), listed["p"][k]
            expected["p"][k] = {"x": got}
        else:
            assert torch.equal(got, row["x"]) and listed["p"][k] == {"v": 1}, (k, got)
            expected["p"][k] = row
    for k in OLD:
        if k != "a1":
            assert listed["p"][k] == {"v": 0}, k
    assert listed["other"] == {"z": {"o": 1}}
    assert_listed_readable(expected, set())
    run.assert_no_orphans()
    return {"which": "new" if "n0" in listed["p"] else "old"}


def _clear(run: MetaRun, ref) -> dict:
    old, z = _rows(OLD, 0), _rows(["z"], 500)
    _put("p", old, {"v": 0})
    _put("other", z, {"o": 1})
    gone = ["a1", "a2", "a4"]
    run.crash_and_restart(lambda: tq.kv_clear(gone, "p"))
    listed = tq.kv_list()
    left = [k for k in gone if k in listed.get("p", {})]
    assert left in ([], gone), f"half cleared: {left} of {gone} still listed"
    if run.outcome == "ok":
        assert not left, left
    for k in gone:
        if k not in left:
            with pytest.raises(KeyError) as exc:
                _read("p", k)
            assert not isinstance(exc.value, RowsLostError), exc.value
    expected = {"p": {k: r for k, r in old.items() if k not in gone or k in left}, "other": z}
    assert {k: listed["p"][k] for k in expected["p"]} == {k: {"v": 0} for k in expected["p"]}
    assert listed["other"] == {"z": {"o": 1}}
    assert_listed_readable(expected, set())
    run.assert_no_orphans()
    return {"which": "old" if left else "new"}


def _checkpoint_replace(run: MetaRun, ref) -> dict:
    ckpt_rows, z = _rows(OLD, 0), _rows(["z"], 500)
    _put("p", ckpt_rows, {"v": 0})
    _put("other", z, {"o": 1})
    ckpt = run.tmp / "ckpt"
    tq.save_checkpoint(ckpt)
    # after the checkpoint: a0 cleared, a1 overwritten, b0/b1 new
    tq.kv_clear(["a0"], "p")
    later = _rows(["a1", "b0", "b1"], 200)
    _put("p", later, {"v": 1})
    now = {"p": {**{k: r for k, r in ckpt_rows.items() if k != "a0"}, **later}, "other": z}
    saved = {"p": ckpt_rows, "other": z}
    run.crash_and_restart(lambda: tq.load_checkpoint(ckpt))
    listed = tq.kv_list()
    keys = {pid: set(ks) for pid, ks in listed.items() if ks}
    which = "new" if keys == {pid: set(r) for pid, r in saved.items()} else "old"
    want = saved if which == "new" else now
    assert keys == {pid: set(r) for pid, r in want.items()}, \
        f"metadata is neither the checkpoint's nor the old one: {keys}"
    if run.outcome == "ok":
        assert which == "new"
    for k in want["p"]:
        tag = {"v": 1} if which == "old" and k in later else {"v": 0}
        assert listed["p"][k] == tag, (which, k, listed["p"][k])
    assert_listed_readable(want, set())
    run.assert_no_orphans()
    return {"which": which}


def _restore_publish(run: MetaRun, ref) -> dict:
    dump = _copy_dump(ref["path"], run.tmp / "dump")
    mine = _rows(["s1"], 700)
    by, z = _rows(["by"], 800), _rows(["z"], 500)
    _put("p", mine, {"status": "mine"})
    _put("p", by, {"b": 1})
    _put("other", z, {"o": 1})
    run.crash_and_restart(lambda: tq.load_data_by_key(dump))
    cancelled = _settle(run, dump)
    ctl = assert_journals_final(run.cfg["state_dir"], dump)
    committed = [r for r in ctl["restores"] if r["state"] == "committed"]
    restored = set(ref["sel"]) | {"tag-only"}
    listed = tq.kv_list()
    visible = set(listed["p"])
    if run.outcome == "ok":
        assert committed
    if committed:
        assert restored <= visible, f"committed but missing {sorted(restored - visible)}"
        for k in restored:
            assert_same_value(ref["tags"][k], listed["p"][k], f"tag of {k}")
        expected = {"p": {**{k: ref["rows"].get(k, {}) for k in restored}, "by": by["by"]},
                    "other": z}
    else:
        assert not ((restored - {"s1"}) & visible), sorted(restored & visible)
        assert listed["p"]["s1"] == {"status": "mine"}
        expected = {"p": {**mine, **by}, "other": z}
    assert listed["p"]["by"] == {"b": 1} and listed["other"] == {"z": {"o": 1}}
    assert_listed_readable(expected, set())
    run.units_clean()
    run.assert_no_orphans(rowless={("p", "tag-only")})
    return {"which": "new" if committed else "old", "cancel_needed": cancelled}


def _unit_lost(run: MetaRun, ref) -> dict:
    rows, z = _rows([f"u{i}" for i in range(8)], 0), _rows(["z"], 500)
    _put("p", rows, {"v": 0})
    _put("other", z, {"o": 1})
    owner = {**_owner("p", rows), **{("other", "z"): _owner("other", ["z"])["z"]}}
    dep = api._deployment
    victim = dep.procs[f"unit {run.FAULTY_UNIT}"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)

    def back():   # the controller died before its reply: that start of the unit failed
        proc = dep.procs[f"unit {run.FAULTY_UNIT}"]
        proc.wait(WAIT)
        dep.restart_unit(run.FAULTY_UNIT)
    run.crash_and_restart(lambda: dep.restart_unit(run.FAULTY_UNIT), back)
    lost = [k for k in rows if owner[k] == run.FAULTY_UNIT]
    assert lost and len(lost) < len(rows), owner
    listed = tq.kv_list()
    assert listed["p"] == {k: {"v": 0} for k in rows if k not in lost}, "a lost key is listed"
    named = tq.list_lost_keys("p")["p"]
    assert named == {k: {"tag": {"v": 0}, "fields": ["x"], "unit": run.FAULTY_UNIT}
                     for k in lost}, named
    for k in lost:
        with pytest.raises(RowsLostError) as exc:
            _read("p", k)
        assert k in exc.value.keys and exc.value.units.get(k) == run.FAULTY_UNIT, exc.value
    for k in rows:
        if k not in lost:
            assert torch.equal(_read("p", k), rows[k]["x"]), k
    assert tq.get_client().controller.call("STATS")["lost_rows"] == len(lost)
    if owner[("other", "z")] != run.FAULTY_UNIT:
        assert torch.equal(_read("other", "z"), z["z"]["x"])
    exempt = {("p", k) for k in lost} | (
        {("other", "z")} if owner[("other", "z")] == run.FAULTY_UNIT else set())
    assert_listed_readable({"p": rows, "other": z}, exempt)
    # a lost key put again is live with its new value
    _put("p", {lost[0]: {"x": torch.arange(3)}}, {"v": 2})
    assert torch.equal(_read("p", lost[0]), torch.arange(3))
    return {"which": "new", "lost": len(lost)}


def _end_buffer(run: MetaRun, ref) -> dict:
    old, z = _rows(OLD, 0), _rows(["z"], 500)
    _put("p", old, {"v": 0})
    _put("other", z, {"o": 1})
    run.crash_and_restart(
        lambda: tq.get_client().controller.call("END_BUFFER", timeout=10))
    listed = {pid: ks for pid, ks in tq.kv_list().items() if ks}
    if listed:
        assert listed == {"p": {k: {"v": 0} for k in OLD}, "other": {"z": {"o": 1}}}, listed
        assert run.outcome != "ok", "END_BUFFER replied but the metadata is still there"
        assert_listed_readable({"p": old, "other": z}, set())
    run.assert_no_orphans()
    return {"which": "old" if listed else "new"}


OPS = {"commit_put": _commit_put, "clear": _clear, "checkpoint_replace": _checkpoint_replace,
       "checkpoint_keys": _checkpoint_replace,
       "restore_publish": _restore_publish, "unit_lost": _unit_lost, "end_buffer": _end_buffer}


def nth_hit(op: str, stage: str) -> int:
    """Which hit of the point is the one under test: the setup's puts commit twice before
    the put under test; every unit's first registration passes unit_lost.before_reply."""
    if op == "commit_put":
        return 3
    if op == "unit_lost" and stage == "before_reply":
        return 3   # 2 units registered at start, then the one restarted empty
    return 1


def meta_case(tmp_path, point: str, ref: dict) -> dict:
    """Kill the controller at ``point`` (``controller.meta.<op>.<stage>``) during that op,
    restart it alone, settle, check the op's invariants and that nothing is blocked."""
    _, _, op, stage = point.split(".")
    run = MetaRun(tmp_path, point, nth_hit(op, stage))
    run.start()
    try:
        res = OPS[op](run, ref)
        assert "controller" in run.restarted
        run.assert_works()
        res.update(outcome=run.outcome, error=run.error)
        return res
    finally:
        run.close()
