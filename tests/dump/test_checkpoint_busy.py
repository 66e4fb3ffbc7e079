"""load_checkpoint tries again when a unit is busy with other calls' staged loads
(CheckpointBusyError: nothing was staged by that unit), dropping what the others staged
first; any other failure is raised at once, also after dropping."""
from __future__ import annotations

import pytest

from tqtx.dump import checkpoint
from tqtx.errors import CheckpointBusyError, DumpFormatError


class _Client:
    def __init__(self, failures):
        self.failures = list(failures)
        self.staged: list[str] = []
        self.dropped: list[str] = []

    def fan_out(self, op, per_unit):
        assert op == "LOAD_CHECKPOINT"
        load_id = next(iter(per_unit.values()))["load_id"]
        self.staged.append(load_id)
        if self.failures:
            raise self.failures.pop(0)

    def unit(self, uid):
        return uid


def _fake_call_many(client):
    def call_many(calls, raise_first, timeout):
        client.dropped += [body["load_id"] for _peer, _op, body in calls]
    return call_many


def test_a_busy_unit_makes_the_load_try_again_with_a_new_load_id(monkeypatch):
    client = _Client([CheckpointBusyError("unit 1 holds 2 checkpoint loads"),
                      CheckpointBusyError("unit 0 holds 2 checkpoint loads")])
    monkeypatch.setattr(checkpoint, "call_many", _fake_call_many(client))
    monkeypatch.setattr(checkpoint, "fence_pause", lambda attempt: None)
    load_id = checkpoint._stage_everywhere(client, {0: {}, 1: {}})
    assert client.staged[-1] == load_id and len(set(client.staged)) == 3
    # every unit was asked to drop each refused attempt's staged rows, never the last one's
    assert client.dropped == [client.staged[0]] * 2 + [client.staged[1]] * 2


def test_a_unit_still_busy_after_every_try_raises_it(monkeypatch):
    busy = [CheckpointBusyError("busy")] * checkpoint.FENCE_ATTEMPTS
    client = _Client(busy)
    monkeypatch.setattr(checkpoint, "call_many", _fake_call_many(client))
    monkeypatch.setattr(checkpoint, "fence_pause", lambda attempt: None)
    with pytest.raises(CheckpointBusyError, match="busy"):
        checkpoint._stage_everywhere(client, {0: {}})
    assert len(client.staged) == checkpoint.FENCE_ATTEMPTS
    assert sorted(set(client.dropped)) == sorted(client.staged)


def test_another_failure_is_raised_at_once(monkeypatch):
    client = _Client([DumpFormatError("unit 0: bad record")])
    monkeypatch.setattr(checkpoint, "call_many", _fake_call_many(client))
    with pytest.raises(DumpFormatError, match="bad record"):
        checkpoint._stage_everywhere(client, {0: {}, 1: {}})
    assert len(client.staged) == 1 and set(client.dropped) == set(client.staged)
