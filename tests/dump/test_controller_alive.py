"""Whether a restore's controller is still alive, as the dump side asks it of a state dir
(the controller's lock is the one probe, tqtx.layout.paths.controller_running)."""
from __future__ import annotations

import os

from filelock import FileLock

from tqtx.dump.load import _controller_alive
from tqtx.journal.controller import ControllerJournal
from tqtx.layout.paths import controller_lock_path


def test_no_state_dir_or_no_journal_cannot_tell(tmp_path):
    assert _controller_alive(None) is None
    assert _controller_alive("") is None
    assert _controller_alive(str(tmp_path / "never")) is None


def test_a_free_lock_is_a_gone_controller_and_a_held_one_a_live_one(tmp_path):
    state = tmp_path / "state"
    ControllerJournal(state).close()
    assert _controller_alive(str(state)) is False
    held = FileLock(os.fspath(controller_lock_path(state)))
    with held:
        assert _controller_alive(str(state)) is True
    assert _controller_alive(str(state)) is False
