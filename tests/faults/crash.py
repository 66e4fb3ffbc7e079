"""Helpers for the crash matrix: run a dump or a restore with one fault armed, recover, and
check every invariant. Used by test_crash_matrix.py."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import filelock
import pytest
import torch
from click.testing import CliRunner

import tqtx as tq
from buffers import assert_same_value, rollout_batch, rows_of
from tqtx import RestorePendingError, api
from tqtx.errors import PeerTimeoutError, RowsLostError
from tqtx import format as fmt

import treehash
from client_fork import run_client

T = 5.0                       # client request timeout in every matrix deployment
FINAL = {"committed", "aborted", "cancelled", "failed"}
UNIT_FINAL = {"applied", "failed", "dropped"}
PUB_FINAL = {"cleaned", "failed", "rolled-back"}



# --------------------------------------------------------------------------- helpers
def journal_json(state_dir=None, dump_dir=None) -> dict:
    """``tqtx journal show --json`` (the click command, run in this process)."""
    from tqtx.cli.journal import journal
    args = ["show", "--json"] + ([str(dump_dir)] if dump_dir else ["--state-dir", str(state_dir)])
    res = CliRunner().invoke(journal, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def assert_journals_final(state_dir, dump_dir) -> dict:
    ctl = journal_json(state_dir=state_dir)
    for r in ctl["restores"]:
        assert r["state"] in FINAL and r["outcome"] == r["state"], r
        assert all(u["state"] in UNIT_FINAL for u in r["units"]), r
    dj = journal_json(dump_dir=dump_dir)
    for r in dj["restores"]:
        assert r["state"] in FINAL, r
    for p in dj["publications"]:
        assert p["phase"] in PUB_FINAL, p
    return ctl


def siblings(d) -> list[str]:
    parent, name = os.path.split(str(d))
    return sorted(x for x in os.listdir(parent)
                  if x.startswith(name + ".tmp-") or x == name + ".old")


def assert_lock_free(path) -> None:
    lock = filelock.FileLock(str(path))
    lock.acquire(timeout=0)   # raises filelock.Timeout while anyone holds it
    lock.release()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def tqtx_own(tmp_path, dump, *, dump_too: bool):
    """Which paths under the test dir are tqtx's: the state dirs, the dump's lock and
    journal files and, for a dump case, the dump directory itself (a restore must leave
    the dump byte-identical)."""
    own = treehash.tqtx_own(tmp_path, dump)
    name = os.path.basename(str(dump))

    def allowed(rel: str) -> bool:
        top = rel.split(os.sep, 1)[0]
        if top in ("state", "ref-state"):
            return True
        if top == name:
            return dump_too
        return own(rel)
    return allowed


def plant_user_files(tmp_path, dump_name: str) -> None:
    """Files that are not tqtx's, around the dump path (look-alike names included)."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / (dump_name + ".txt")).write_text("not a dump")
    (tmp_path / (dump_name + "-user")).mkdir()
    (tmp_path / (dump_name + "-user") / "a.bin").write_bytes(b"\x00\x01" * 50)
    os.symlink("notes.txt", tmp_path / "link-to-notes")


def assert_listed_readable(expected: dict, exempt: set) -> None:
    """Invariant: every listed key of every partition is expected, and its row reads back
    with the expected values. ``expected[pid][key]`` is a row dict ({} for a key without
    fields); ``exempt`` holds (pid, key) of rows that died with a restarted unit (the only
    documented loss: a unit's memory)."""
    listed = tq.kv_list()
    for pid, keys in listed.items():
        want = expected.get(pid, {})
        unexpected = sorted(k for k in keys if k not in want and (pid, k) not in exempt)
        assert not unexpected, f"partition {pid!r} lists unexpected keys {unexpected}"
        readable = [k for k in keys if (pid, k) not in exempt and want.get(k)]
        for k in readable:
            row = want[k]
            got = rows_of(tq.kv_batch_get([k], pid, select_fields=sorted(row)))[0]
            for f, v in row.items():
                assert_same_value(v, got[f], f"{pid}/{k}.{f}")


def where(point: str) -> str:
    if point.startswith(("client.", "publish.")):
        return "client"
    return point.split(".", 1)[0]            # controller | unit


class Run:
    """One deployment lifecycle of a matrix case: start, crash, recover, check, close."""

    FAULTY_UNIT = 1
    ROLE_DELAY = 0.5   # how long the other unit (or the faulty one) is held at the point

    def __init__(self, tmp_path, point: str, action: str, nth: int, role: str | None = None,
                 trigger: str | None = None):
        """``role`` of the faulty unit: "first" (reaches the point while the other unit is
        held there), "last" (held at the point while the other unit goes on), "alone"
        (a 1-unit deployment); None: unit 1 of 2, no ordering. ``trigger``: a fault spec
        armed in unit 1 that leads the operation onto the path of a controller or client
        side ``point`` (a failing load for the abort path of a restore)."""
        self.tmp = tmp_path
        self.point, self.action, self.nth, self.role = point, action, nth, role
        self.spec = f"{point}@{nth}:{action}"
        self.trigger = trigger
        self.num_units = 1 if role == "alone" else 2
        self.FAULTY_UNIT = 0 if role == "alone" else 1
        self.side = where(point)
        self.pids: set[int] = set()
        self.state_dir = str(tmp_path / "state")
        self.restarted: set[str] = set()   # "job" and/or "unit 1"
        self.outcome = None                # "ok" | "error" | "died"
        self.error = ""

    # deployment --------------------------------------------------------------
    def start(self, faults: bool = True):
        env, unit_env = {}, {}
        if faults and self.side == "controller":
            env = {"TQTX_FAULTS": self.spec}
        if faults and self.side == "unit":
            hold = f"{self.point}@{self.nth}:delay:{self.ROLE_DELAY}"
            unit_env = {self.FAULTY_UNIT: {"TQTX_FAULTS": (
                f"{hold},{self.spec}" if self.role == "last" else self.spec)}}
            if self.role == "first":
                unit_env[1 - self.FAULTY_UNIT] = {"TQTX_FAULTS": hold}
        if faults and self.trigger:
            assert self.side != "unit", "a trigger leads to a controller or client side point"
            unit_env = {self.FAULTY_UNIT: {"TQTX_FAULTS": self.trigger}}
        tq.close()
        self.cfg = tq.init({"num_units": self.num_units, "state_dir": self.state_dir,
                            "timeout": T,
                            "env": env, "unit_env": unit_env})
        self._note_pids()
        return self.cfg

    def _note_pids(self):
        dep = api._deployment
        if dep is not None:
            self.pids.update(dep.pids.values())

    def dead(self, *exiting: str) -> list[str]:
        """The processes that exited; those named in ``exiting`` (killed, their connections
        already closed: the client saw that) are first given up to 10 s to finish exiting."""
        dep = api._deployment
        for name in exiting:
            try:
                dep.procs[name].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return [name for name, p in dep.procs.items() if p.poll() is not None]

    def recover_processes(self) -> None:
        """Restart what died: the whole job after a controller crash, else the dead unit."""
        dead = self.dead()
        if "controller" in dead:
            # The job died with its controller: kill what is left (crash, not shutdown).
            for name, p in api._deployment.procs.items():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
            self.restarted.add("job")
            self.start(faults=False)
        else:
            for name in dead:
                api._deployment.restart_unit(int(name.split()[1]))
                self.restarted.add(name)
            if dead:
                tq.get_client().refresh_topology()  # the restarted unit has a new address
            self._note_pids()

    def run_op(self, fn, client_args) -> None:
        """The operation under test: in this process, or in a child for client-side faults."""
        if self.side == "client":
            rc, stderr = run_client(client_args, {
                "TQ_ADDR": self.cfg["address"], "TQ_T": str(T), "TQTX_FAULTS": self.spec})
            if rc == 0:
                self.outcome = "ok"
            elif rc == -signal.SIGKILL:
                self.outcome = "died"
            else:
                self.outcome, self.error = "error", stderr[-3000:]
            return
        try:
            fn()
            self.outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - any failure is allowed; invariants decide
            self.outcome, self.error = "error", f"{type(exc).__name__}: {exc}"

    def check_fired(self) -> None:
        """The armed fault must really have happened (a case that never fires proves nothing)."""
        if self.trigger and self.action != "kill":
            # the operation fails by the trigger; a raise at the point shows in its error
            assert self.outcome == "error", (self.spec, self.outcome, self.error)
            point = self.point if self.action == "raise" else self.trigger.split("@")[0]
            assert f"fault injected at {point}" in self.error, (self.spec, self.error)
            return
        if self.action == "kill":
            if self.side == "client":
                assert self.outcome == "died", (self.spec, self.outcome, self.error)
            else:
                victim = "controller" if self.side == "controller" else f"unit {self.FAULTY_UNIT}"
                assert victim in self.dead(victim), (self.spec, self.outcome, self.error)
        elif self.action == "raise":
            if "RECORD_DUMP" in self.point:
                # the audit row is best effort: the published dump is reported as done
                assert self.outcome == "ok", (self.spec, self.error)
                return
            if "APPLY_STAGED" in self.point or self.point.startswith("unit.apply."):
                return  # after the commit decision the controller absorbs a unit's error
            assert self.outcome == "error" and "fault injected" in self.error, \
                (self.spec, self.outcome, self.error)
        elif self.action.startswith("delay"):
            assert self.outcome == "ok", (self.spec, self.error)

    def units_clean(self) -> None:
        client = tq.get_client()
        for u in range(self.num_units):
            st = client.unit(u).call("STATS")
            assert st["staged_restores"] == [], (u, st)
        assert tq.get_client().controller.call("STATS")["open_restores"] == []

    def close(self) -> None:
        tq.close()
        deadline = time.monotonic() + 10
        while [p for p in self.pids if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = [p for p in self.pids if alive(p)]
        assert not leaked, f"processes still running after close: {leaked}"
        assert_lock_free(os.path.join(self.state_dir, "controller.lock"))


# --------------------------------------------------------------------------- dump scenario
DUMP_KEYS = [f"s{i}" for i in range(12)]
OLD_KEYS, NEW_KEYS = DUMP_KEYS[:5], DUMP_KEYS[5:]


def _owners(pid: str, keys) -> dict:
    res = tq.get_client().controller.call("LOOKUP", {"partition_id": pid, "keys": list(keys)})
    return {k: i % res["num_units"] for k, i in zip(keys, res["indexes"])}


# requests only a background dump (block=False) makes: the first (blocking) dump never hits them
BACKGROUND_ONLY = ("DUMP_SNAPSHOT", "DUMP_WAIT", "TAKE_DUMP_TAGS")


def dump_case(tmp_path, point: str, action: str, role: str | None = None, *,
              background: bool = False) -> dict:
    # server-side points are hit once by the first (old) dump: fire on the second
    first = where(point) == "client" or point.endswith(BACKGROUND_ONLY)
    nth = 1 if first else 2
    run = Run(tmp_path, point, action, nth, role)
    d = tmp_path / "d"
    plant_user_files(tmp_path, "d")
    own = tqtx_own(tmp_path, d, dump_too=True)
    run.start()
    try:
        keys, td, tags = rollout_batch(len(DUMP_KEYS))
        tq.kv_batch_put(keys, "p", td, tags=tags)
        ref = tq.kv_batch_get(keys, "p")
        ref_rows = dict(zip(keys, rows_of(ref)))
        owner = _owners("p", keys)
        old = tq.dump_data_by_key(d, OLD_KEYS, "p")
        tree = treehash.snapshot(tmp_path)
        if background:
            run.run_op(lambda: tq.dump_data_by_key(d, NEW_KEYS, "p", block=False).result(60),
                       ["dump-bg", str(d), ",".join(NEW_KEYS)])
        else:
            run.run_op(lambda: tq.dump_data_by_key(d, NEW_KEYS, "p"),
                       ["dump", str(d), ",".join(NEW_KEYS)])
        run.check_fired()
        run.recover_processes()
        # next access recovers the dump (lock + dump journal replay)
        idx = tq.read_row_index(d)
        which = "old" if idx["dump_id"] == old["dump_id"] else "new"
        assert list(idx["rows"]) == (OLD_KEYS if which == "old" else NEW_KEYS)
        if run.outcome == "ok":
            assert which == "new", "a dump that reported success is not in place"
        v = fmt.verify_dump(d)
        assert v["ok"], v["errors"][:3]
        assert siblings(d) == [], siblings(d)
        assert_journals_final(run.cfg["state_dir"], d)
        assert_lock_free(str(d) + ".lock")
        treehash.assert_unchanged(tree, treehash.snapshot(tmp_path), own)
        # every listed key reads back unchanged, but for the rows of a restarted unit
        lost = set(range(run.num_units)) if "job" in run.restarted else {
            int(n.split()[1]) for n in run.restarted}
        assert_listed_readable({"p": ref_rows},
                               {("p", k) for k in keys if owner[k] in lost})
        if not run.restarted:
            # the dump never changes live data
            got = tq.kv_batch_get(keys, "p")
            for a, b in zip(rows_of(ref), rows_of(got)):
                for f in a:
                    assert_same_value(a[f], b[f], f)
            run.units_clean()
            # and the dump path is not blocked
            rep = tq.dump_data_by_key(d, NEW_KEYS[:2], "p")
            assert tq.read_row_index(d)["dump_id"] == rep["dump_id"]
        return {"which": which, "outcome": run.outcome, "restarted": sorted(run.restarted)}
    finally:
        run.close()


# --------------------------------------------------------------------------- restore scenario
def make_reference_dump(path) -> dict:
    """A dump of 10 of 16 rollout rows plus a tag-only key, written in-process."""
    from tqtx.testing import InProcessDeployment
    dep = InProcessDeployment(2, os.path.join(os.path.dirname(str(path)), "ref-state"))
    try:
        dep.activate()
        keys, td, tags = rollout_batch(16)
        tq.kv_batch_put(keys, "p", td, tags=tags)
        tq.kv_put("tag-only", "p", None, tag={"status": "running", "v": torch.tensor([7])})
        sel = [k for i, k in enumerate(keys) if i % 3]
        ref = tq.kv_batch_get(sel, "p")
        tq.dump_data_by_key(path, sel + ["tag-only"], "p")
        listed = tq.kv_list("p")["p"]
    finally:
        dep.stop()
    return {"path": str(path), "sel": sel, "rows": dict(zip(sel, rows_of(ref))),
            "tags": {k: listed[k] for k in sel + ["tag-only"]}}


def _copy_dump(src: str, dst) -> str:
    shutil.copytree(src, dst)
    shutil.copy2(src + ".journal.sqlite", str(dst) + ".journal.sqlite")
    return str(dst)


def _settle(run: Run, dump: str) -> bool:
    """recover_data_load until it settles; a restore stuck with a unit that never reports is
    cancelled (the documented escape) after 20 s. Returns True if cancel was needed."""
    deadline = time.monotonic() + 45
    while True:
        try:
            tq.recover_data_load(dump)
            return False
        except (RestorePendingError, PeerTimeoutError):  # a controller busy applying: wait
            if time.monotonic() > deadline:
                tq.recover_data_load(dump, cancel=True)
                return True
            time.sleep(0.5)


MINE = torch.full((4,), 3.0)


def restore_case(tmp_path, ref: dict, point: str, action: str, role: str | None = None, *,
                 trigger: str | None = None) -> dict:
    run = Run(tmp_path, point, action, 1, role, trigger)
    dump = _copy_dump(ref["path"], tmp_path / "dump")
    sel = ref["sel"]
    restored = set(sel) | {"tag-only"}
    plant_user_files(tmp_path, "dump")
    own = tqtx_own(tmp_path, dump, dump_too=False)   # a restore changes nothing in the dump
    tree = treehash.snapshot(tmp_path)
    run.start()
    try:
        client = tq.get_client()
        # bystanders: an existing key the dump overwrites, one it does not know, another partition
        tq.kv_put("s1", "p", {"obs": MINE}, tag={"status": "mine"})
        tq.kv_put("by", "p", {"obs": torch.ones(4)}, tag={"b": 1})
        tq.kv_put("z", "other", {"z": torch.arange(5)}, tag={"o": 2})
        owner = {k: i % run.num_units for k, i in zip(
            ["s1", "by", "z"],
            client.controller.call("LOOKUP", {"partition_id": "p", "keys": ["s1", "by"]})["indexes"]
            + client.controller.call("LOOKUP", {"partition_id": "other", "keys": ["z"]})["indexes"])}
        run.run_op(lambda: tq.load_data_by_key(dump), ["load", dump])
        run.check_fired()
        run.recover_processes()
        cancelled = _settle(run, dump)
        ctl = assert_journals_final(run.cfg["state_dir"], dump)
        committed = [r for r in ctl["restores"] if r["state"] == "committed"]
        assert len(committed) <= 1
        if run.outcome == "ok":
            assert committed, "load reported success but nothing is committed"
        lost = set() if not run.restarted else (
            set(range(run.num_units)) if "job" in run.restarted else {run.FAULTY_UNIT})
        visible = set(tq.kv_list("p").get("p", {}))
        new = restored - {"s1"}
        # all or nothing
        if "job" in run.restarted:
            # the whole job died: every unit's memory went with it, the journaled metadata did
            # not (issue 15). A restore whose commit was decided but not finished keeps the
            # buffer and is rolled forward from the dump; every other key that had rows is
            # lost: left out of kv_list, named by list_lost_keys. Without one, no unit kept a
            # row and the buffer starts empty, as TransferQueue's does (journaled, issue 34).
            dropped = [e for e in ctl["recovery_events"] if e["kind"] == "buffer"]
            if dropped:
                assert [e["action"] for e in dropped] == ["dropped"], dropped
                assert tq.kv_list() == {} and tq.list_lost_keys() == {}
            else:
                assert committed, "the buffer was kept without a restore to roll forward"
                assert new <= visible, f"committed but missing {sorted(new - visible)}"
                for k in sel:
                    got = rows_of(tq.kv_batch_get([k], "p",
                                                  select_fields=sorted(ref["rows"][k])))[0]
                    for f, v in ref["rows"][k].items():
                        assert_same_value(v, got[f], f"{k}.{f}")
                lost_named = tq.list_lost_keys("p").get("p", {})
                assert "by" not in visible and lost_named["by"]["tag"] == {"b": 1}
                for k in lost_named:
                    with pytest.raises(RowsLostError):
                        tq.kv_batch_get([k], "p")
        elif committed:
            assert new <= visible, f"committed but missing {sorted(new - visible)}"
            # every restored row reads back, on a unit that restarted too: a unit that came
            # back empty after the commit decision was rolled forward from the dump
            for k in sel:
                got = rows_of(tq.kv_batch_get([k], "p", select_fields=sorted(ref["rows"][k])))[0]
                for f, v in ref["rows"][k].items():
                    assert_same_value(v, got[f], f"{k}.{f}")
        else:
            assert not (new & visible), f"aborted but visible: {sorted(new & visible)}"
            if "job" not in run.restarted and owner["s1"] not in lost:
                assert torch.equal(tq.kv_batch_get(["s1"], "p", select_fields=["obs"])["obs"][0],
                                   MINE)
                assert tq.kv_list("p")["p"]["s1"] == {"status": "mine"}
        # bystanders unchanged wherever their unit survived
        if "job" not in run.restarted:
            # a bystander on a restarted unit is lost: left out of kv_list, named instead
            lost_named = tq.list_lost_keys()
            if owner["by"] not in lost:
                assert torch.equal(tq.kv_batch_get(["by"], "p")["obs"][0], torch.ones(4))
                assert tq.kv_list("p")["p"]["by"] == {"b": 1}
            else:
                assert lost_named["p"]["by"]["tag"] == {"b": 1}
            if owner["z"] not in lost:
                assert torch.equal(tq.kv_batch_get(["z"], "other")["z"][0], torch.arange(5))
                assert tq.kv_list("other")["other"] == {"z": {"o": 2}}
            else:
                assert lost_named["other"] == {"z": {"tag": {"o": 2}, "fields": ["z"],
                                                     "unit": owner["z"]}}
        run.units_clean()
        # no key is listed whose row cannot be read (a bystander on a restarted unit died
        # with that unit's memory: the one documented loss)
        if "job" not in run.restarted:
            expected = {"p": {"by": {"obs": torch.ones(4)}}, "other": {"z": {"z": torch.arange(5)}}}
            if committed:
                expected["p"].update({k: ref["rows"].get(k, {}) for k in restored})
            else:
                expected["p"]["s1"] = {"obs": MINE}
            exempt = {(p_, k) for (p_, k), u in [(("p", "s1"), owner["s1"]),
                                                 (("p", "by"), owner["by"]),
                                                 (("other", "z"), owner["z"])]
                      if u in lost and not (committed and k == "s1")}
            assert_listed_readable(expected, exempt)
        treehash.assert_unchanged(tree, treehash.snapshot(tmp_path), own)
        assert siblings(dump) == [] and fmt.verify_dump(dump)["ok"]
        assert_lock_free(dump + ".lock")
        # nothing is blocked: the same dump loads into a fresh partition
        tq.load_data_by_key(dump, partition_id="again")
        got = tq.kv_batch_get(sel, "again")
        for k, row in zip(sel, rows_of(got)):
            for f, v in ref["rows"][k].items():
                assert_same_value(v, row[f], f"again {k}.{f}")
        assert_journals_final(run.cfg["state_dir"], dump)
        return {"committed": bool(committed), "outcome": run.outcome,
                "restarted": sorted(run.restarted), "cancel_needed": cancelled}
    finally:
        run.close()


def client_lookup(keys) -> dict:
    res = tq.get_client().controller.call("LOOKUP", {"partition_id": "p", "keys": list(keys)})
    return dict(zip(keys, res["indexes"]))
