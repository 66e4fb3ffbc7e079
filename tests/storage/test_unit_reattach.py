"""A storage unit's REGISTER_UNIT report, the drops its reply asks for, and re-attach to a
restarted controller, against a fake controller (an rpc Server in a thread, loopback only)."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from tqtx import faults
from tqtx.errors import StaleRowsError
from tqtx.storage.attach import held_report
from tqtx.storage.unit import StorageUnit
from tqtx.wire.peer import Peer
from tqtx.wire.rpc import Server
from tqtx.wire.values import RawTensor

pytestmark = pytest.mark.timeout(60)

ROW = 64  # bytes of field "a"


class FakeController:
    """Answers PING with its incarnation and REGISTER_UNIT with ``reply``, recording each
    registration; with ``hold`` set, REGISTER_UNIT replies only when ``release`` is called."""

    def __init__(self, incarnation: int = 1, port: int = 0):
        self.incarnation = incarnation
        self.reply: dict = {}
        self.registrations: list[dict] = []
        self.pings = 0
        self.hold = False
        self.held: list = []
        self.got = threading.Event()
        self.server = Server("fakectl", "127.0.0.1", port)
        self.address = self.server.address
        self.server.add("PING", self._ping)
        self.server.add("REGISTER_UNIT", self._register, mutating=True)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(20,),
                                       daemon=True)
        self.thread.start()

    def _ping(self, body, req):
        self.pings += 1
        return {"incarnation": self.incarnation}

    def _register(self, body, req):
        self.registrations.append(body)
        self.got.set()
        if self.hold:
            deferred = self.server.deferred(req, self.server.current_ident)
            self.held.append(deferred)
            return deferred
        return {"incarnation": self.incarnation, **self.reply}

    def release(self) -> None:
        for deferred in self.held:
            deferred.reply({"incarnation": self.incarnation, **self.reply})
        self.held = []

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)


@pytest.fixture
def ctl():
    c = FakeController()
    yield c
    c.stop()


@pytest.fixture
def unit(ctl):
    u = StorageUnit(0, ctl.address)
    t = threading.Thread(target=u.serve_forever, daemon=True)
    t.start()
    u.attach.register(timeout=10)
    yield u
    u.server.stop()
    t.join(10)
    assert not t.is_alive()


@pytest.fixture
def peer(unit):
    p = Peer(unit.address, "unit 0", timeout=10)
    yield p
    p.close()


def _tensor(i: int) -> RawTensor:
    return RawTensor("uint8", (ROW,), bytes([i % 256]) * ROW)


def _gen(i: int) -> int:
    """The generation these tests' rows are put at: one per index."""
    return 100 + i


def _put(peer, rows: dict[int, dict]):
    body = {"rows": [[i, v] for i, v in rows.items()], "gens": [_gen(i) for i in rows]}
    return peer.call("PUT_ROWS", body)


def _get(peer, indexes: list[int], fields: list[str]):
    return peer.call("GET_ROWS", {"indexes": indexes, "gens": [_gen(i) for i in indexes],
                                  "fields": fields})


def _drop(indexes: list[int]) -> list[list[int]]:
    """A REGISTER_UNIT reply's drop list of ``indexes`` at their generations."""
    return [[i, _gen(i)] for i in indexes]


def _wait(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _held(report: dict) -> dict[int, set]:
    h = report["held"]
    assert len(h["indexes"]) == len(h["fields_of"])
    return {i: set(h["field_sets"][s]) for i, s in zip(h["indexes"], h["fields_of"])}


def _register_again(unit, ctl) -> dict:
    n = len(ctl.registrations)
    unit.attach.register(timeout=10)
    assert len(ctl.registrations) == n + 1
    return ctl.registrations[-1]


def _stats(peer) -> dict:
    return peer.call("GET_STATS")


def test_held_report_groups_field_sets():
    rep = held_report({3: {"a": 1, "b": 2}, 5: {"b": 2, "a": 1}, 7: {"a": 1}, 9: {}},
                      {3: 13, 5: 15, 7: 17, 9: 19})
    assert rep["indexes"] == [3, 5, 7, 9] and rep["gens"] == [13, 15, 17, 19]
    assert sorted(map(tuple, rep["field_sets"])) == [(), ("a",), ("a", "b")]
    sets = [tuple(rep["field_sets"][s]) for s in rep["fields_of"]]
    assert sets == [("a", "b"), ("a", "b"), ("a",), ()]


def test_register_reports_exactly_the_rows_and_fields_held(unit, ctl, peer):
    first = ctl.registrations[0]
    assert first["unit_id"] == 0 and first["address"] == unit.address
    assert _held(first) == {} and first["staged"] == []
    _put(peer, {i: {"a": _tensor(i)} for i in range(4)})
    _put(peer, {10: {"a": _tensor(10), "b": "x"}, 11: {"b": "y"}})
    _put(peer, {2: {"b": "z"}})  # the same generation: adds a field to row 2
    body = _register_again(unit, ctl)
    assert _held(body) == {0: {"a"}, 1: {"a"}, 2: {"a", "b"}, 3: {"a"}, 10: {"a", "b"},
                           11: {"b"}}
    assert sorted(map(sorted, body["held"]["field_sets"])) == [["a"], ["a", "b"], ["b"]]
    assert unit.attach.incarnation == ctl.incarnation


def test_drop_removes_rows_and_their_bytes(unit, ctl, peer):
    _put(peer, {i: {"a": _tensor(i)} for i in range(6)})
    assert _stats(peer)["bytes"] == 6 * ROW
    ctl.reply = {"drop": _drop([1, 4, 99]) + [[0, 7]]}  # 99: not held; 0: another generation
    _register_again(unit, ctl)
    _wait(lambda: _stats(peer)["rows"] == 4, "the drop")
    st = _stats(peer)
    assert st["bytes"] == 4 * ROW
    with pytest.raises(StaleRowsError, match=r"global index\(es\) \[4\]") as ei:
        _get(peer, [0, 4], ["a"])
    assert ei.value.indexes == [4]
    got = _get(peer, [0, 5], ["a"])
    assert len(got["columns"]) == 1
    # the drop ran on the request loop, not as a request: PUT_ROWS/GET_ROWS counts only
    assert "DROP_ROWS" not in st["ops"]


def test_old_controller_reply_drops_nothing(unit, ctl, peer):
    _put(peer, {i: {"a": _tensor(i)} for i in range(3)})
    ctl.reply = {}  # today's controller: {"incarnation": ...} only
    _register_again(unit, ctl)
    peer.call("PING")  # the loop has run any queued drop by the time it answers
    assert _stats(peer)["rows"] == 3


def test_row_put_after_the_snapshot_survives_the_drop(unit, ctl, peer):
    _put(peer, {i: {"a": _tensor(i)} for i in range(3)})
    ctl.hold = True
    ctl.got.clear()
    t = threading.Thread(target=unit.attach.register, kwargs={"timeout": 10})
    t.start()
    assert ctl.got.wait(10)  # the report is built: its snapshot is taken
    assert set(_held(ctl.registrations[-1])) == {0, 1, 2}
    _put(peer, {7: {"a": _tensor(7)}})            # new row, after the snapshot
    _put(peer, {1: {"a": _tensor(100)}})          # row 1 rewritten after the snapshot
    ctl.reply = {"drop": _drop([0, 1, 7])}  # a controller that knows none of them
    ctl.release()
    t.join(10)
    _wait(lambda: _stats(peer)["rows"] == 3, "the drop")
    st = _stats(peer)
    assert st["bytes"] == 3 * ROW
    with pytest.raises(StaleRowsError, match=r"global index\(es\) \[0\]"):
        _get(peer, [0], ["a"])
    _get(peer, [1, 2, 7], ["a"])
    assert unit.attach.write_watch == []  # no watch left behind


def test_fault_point_after_snapshot(unit, ctl, peer):
    _put(peer, {0: {"a": _tensor(0)}})
    faults.configure("unit.register.after_snapshot:raise")
    try:
        with pytest.raises(faults.InjectedFault):
            unit.attach.register(timeout=10)
    finally:
        faults.configure("")
    peer.call("PING")
    assert unit.attach.write_watch == []


def test_drop_staged_drops_staged_rows(unit, ctl, peer):
    with unit.restore.lock:
        unit.restore.staging["r-keep"] = {5: (_gen(5), {"a": _tensor(5)})}
        unit.restore.staging["r-gone"] = {6: (_gen(6), {"a": _tensor(6)})}
    ctl.reply = {"drop_staged": ["r-gone"]}
    body = _register_again(unit, ctl)
    assert sorted(body["staged"]) == ["r-gone", "r-keep"]
    _wait(lambda: _stats(peer)["staged_restores"] == ["r-keep"], "the staged drop")
    res = peer.call("APPLY_STAGED", {"restore_id": "r-gone"})
    assert res.get("lost") is True  # nothing staged any more
    assert "r-gone" in unit.restore.dropped


def test_new_incarnation_on_ping_registers_once(unit, ctl, peer):
    _put(peer, {0: {"a": _tensor(0)}})
    unit.attach.start_heartbeat(period=0.05)
    _wait(lambda: ctl.pings >= 3, "heartbeat PINGs")
    assert len(ctl.registrations) == 1  # same incarnation: no re-registration
    ctl.incarnation = 2
    _wait(lambda: len(ctl.registrations) == 2, "the re-registration")
    pings = ctl.pings
    _wait(lambda: ctl.pings >= pings + 5, "more PINGs")
    assert len(ctl.registrations) == 2
    assert set(_held(ctl.registrations[-1])) == {0}
    assert unit.attach.incarnation == 2
    # the unit's own request counters do not see the heartbeat
    assert set(_stats(peer)["ops"]) <= {"PUT_ROWS", "GET_STATS"}


def test_heartbeat_rides_out_a_controller_restart(caplog):
    ctl = FakeController(incarnation=1)
    port = int(ctl.address.rsplit(":", 1)[1])
    u = StorageUnit(0, ctl.address)
    t = threading.Thread(target=u.serve_forever, daemon=True)
    t.start()
    beats: list[str] = []  # what each heartbeat beat found ("" when all was well)
    beat_once = u.attach._beat

    def counted(peer, wait):
        found = beat_once(peer, wait)
        beats.append(found[0])
        return found
    u.attach._beat = counted

    def lines(text):
        return [r for r in list(caplog.records) if text in r.getMessage()]
    try:
        u.attach.register(timeout=10)
        caplog.set_level(logging.INFO, logger="tqtx.unit")
        beat = u.attach.start_heartbeat(period=0.05)
        _wait(lambda: ctl.pings >= 2, "heartbeat PINGs")
        ctl.stop()
        _wait(lambda: beats.count("ping") >= 3, "three beats with a failed PING",
              timeout=20)
        ctl = FakeController(incarnation=2, port=port)
        # the unit has read the new controller's reply, and its heartbeat said so
        _wait(lambda: u.attach.incarnation == 2, "the unit to take the new incarnation", timeout=20)
        _wait(lambda: lines("reachable and registered again"), "the unit's 'back' line")
        pings = ctl.pings
        _wait(lambda: ctl.pings >= pings + 3, "PINGs after the re-registration")
        warnings = [r for r in lines("unreachable") if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per beat
        assert len(lines("reachable and registered again")) == 1
        assert len(ctl.registrations) == 1
    finally:
        u.server.stop()
        t.join(10)
        ctl.stop()
    beat.join(5)
    assert not beat.is_alive()  # the heartbeat ends with the unit
