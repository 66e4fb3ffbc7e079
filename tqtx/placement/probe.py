"""Can every unit reach a dump or checkpoint target? One tiny round trip before writing.

Units write their shards themselves, so the target's parent must be on a filesystem that
every unit's node shares with the client. The client writes a probe file with a random
token in the parent; each unit (``PROBE_PATH``) reads it back (it sees the client's
filesystem) and writes its own probe file there (it can write, and the client sees it).
The client checks the units' files and removes every probe. Any failure names the unit,
its node and the path, before anything of the dump is written.

Skipped when every unit is a child process of this host (the embedded deployment, or an
attached one on this host): they share this host's filesystem by construction.
"""
from __future__ import annotations

import os
import socket
import uuid

from ..errors import TqtxError

PROBE_PREFIX = ".tqtx-probe-"
PROBE_TIMEOUT = 30.0


class TargetUnreachableError(TqtxError, OSError):
    """A unit cannot read or write the directory a dump or checkpoint goes to."""


def node_name() -> str:
    """This process's node as reported in stats and errors: ``$TQTX_NODE`` or the hostname."""
    return os.environ.get("TQTX_NODE") or socket.gethostname()


# ---------------------------------------------------------------- unit side
def unit_probe(unit_id: int, body: dict) -> dict:
    """PROBE_PATH: read the client's probe ``dir/name`` (token must match), write our own."""
    directory, name, token = body["dir"], body["name"], body["token"]
    if not (isinstance(name, str) and name.startswith(PROBE_PREFIX) and "/" not in name):
        raise ValueError(f"PROBE_PATH: {name!r} is not a probe file name")
    theirs = os.path.join(directory, name)
    try:
        with open(theirs) as f:
            seen = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{theirs} (written by the client) does not exist here: "
                                f"{directory} is not on a filesystem shared with the client")
    if seen != token:
        raise FileNotFoundError(f"{theirs} holds another token here: {directory} is a "
                                f"different directory than the client's")
    mine = os.path.join(directory, f"{name}.unit-{unit_id}")
    with open(mine, "w") as f:
        f.write(f"{token} {unit_id}")
    return {"unit_id": unit_id, "node": node_name(), "file": mine}


# ---------------------------------------------------------------- client side
def units_are_local(client) -> bool:
    """True when every unit surely shares this host's filesystem (no probe needed)."""
    dep = client.deployment
    if dep is None:
        return False
    if getattr(dep, "units_local", None) is not None:
        return bool(dep.units_local)
    from ..deploy.local import LocalDeployment
    if isinstance(dep, LocalDeployment):
        return True
    return bool(getattr(dep, "local", False))  # owner.RecordedDeployment of this host


def check_units_reach(client, target: str, what: str, units=None) -> None:
    """Raise TargetUnreachableError naming each unit (and node) that cannot reach
    ``target``'s parent; no-op when all units are local to this host."""
    if units_are_local(client):
        return
    from ..wire.peer import call_many
    parent = os.path.dirname(os.path.abspath(target))
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    token = uuid.uuid4().hex
    ours = os.path.join(parent, name)
    uids = sorted(range(client.num_units) if units is None else units)
    with open(ours, "w") as f:  # the parent exists: check_publish_target said so
        f.write(token)
    try:
        results = call_many([(client.unit(u), "PROBE_PATH",
                              {"dir": parent, "name": name, "token": token}) for u in uids],
                            timeout=PROBE_TIMEOUT, raise_first=False)
        problems = []
        for u, r in zip(uids, results):
            where = _unit_where(client, u)
            if isinstance(r, BaseException):
                problems.append(f"unit {u}{where} cannot reach {parent}: {r}")
                continue
            try:
                with open(os.path.join(parent, f"{name}.unit-{u}")) as f:
                    ok = f.read() == f"{token} {u}"
            except OSError:
                ok = False
            if not ok:
                problems.append(f"unit {u} (node {r.get('node')}) wrote its probe in {parent} "
                                f"but this client does not see it: not a shared filesystem")
        if problems:
            raise TargetUnreachableError(
                f"{what} target {target}: " + "; ".join(problems) + ". Every unit must reach "
                f"the directory (a filesystem shared by all nodes, see docs/deployment.md), "
                f"or use via=\"client\"")
    finally:
        for path in [ours] + [os.path.join(parent, f"{name}.unit-{u}") for u in uids]:
            try:
                os.unlink(path)
            except OSError:
                pass


def _unit_where(client, uid: int) -> str:
    describe = getattr(client.deployment, "unit_node", None)
    node = describe(uid) if describe is not None else None
    return f" (node {node})" if node else f" at {client.unit_addresses[uid]}"
