"""Which process a pid is: its start time, so a record of a process can tell when the
process is gone even after its pid was reused (owner records, same-host reply inboxes)."""
from __future__ import annotations

import os


def process_started(pid: int) -> str | None:
    """An identity of a running process that changes when ``pid`` is reused (Linux start
    time); None if the process does not exist or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return _alive_by_signal(pid)
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # starttime, field 22 of /proc/<pid>/stat


def _alive_by_signal(pid: int) -> str | None:
    if os.path.isdir("/proc"):
        return None  # Linux without /proc/<pid>: gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "?"


def process_alive(pid, started) -> bool:
    """True if ``pid`` runs and is the process that had start time ``started`` (None or
    "?": any process with that pid)."""
    if not isinstance(pid, int):
        return False
    now = process_started(pid)
    return now is not None and (started in (None, "?") or now == "?" or now == started)
