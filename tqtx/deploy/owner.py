"""Who owns a state dir: the owner record ``<state_dir>/deployment.json`` and ``init.lock``.

Every process of a job calls a bare ``tq.init()``; the first one creates the deployment,
the others attach to it. Race-free: each caller takes the creation lock
``<state_dir>/init.lock``, then looks for a *live* owner record (the creating process is
alive and the controller at the recorded address answers with the recorded state dir and
incarnation). Live: attach. Otherwise start a deployment and write its record (tmp file +
``os.replace``) before the lock is released. A stale record (dead creator, a controller
that does not answer) is overwritten. The creator removes its record when it stops the
deployment; nobody else ever deletes it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from ..layout import fsutil, paths
from ..errors import TqtxError
from ..process.pids import process_alive, process_started  # noqa: F401  (owner.process_started)

log = logging.getLogger("tqtx.owner")

RECORD_NAME = paths.DEPLOYMENT_RECORD
LOCK_NAME = paths.INIT_LOCK
RECORD_VERSION = 1
LOCK_TIMEOUT = 180.0   # a creator holds the lock while its processes start (<= 60 s each)
PROBE_TIMEOUT = 3.0    # how long a recorded controller may take to answer TOPOLOGY

_locks: dict[str, object] = {}
_locks_guard = threading.Lock()


def record_path(state_dir: str) -> str:
    return os.path.join(os.path.abspath(state_dir), RECORD_NAME)


def creation_lock(state_dir: str):
    """The state dir's ``init.lock`` (one FileLock object per path, so it is reentrant)."""
    import filelock

    path = os.path.join(os.path.abspath(state_dir), LOCK_NAME)
    with _locks_guard:
        lock = _locks.get(path)
        if lock is None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock = _locks[path] = filelock.FileLock(path)
        return lock


def acquire(lock, timeout: float = LOCK_TIMEOUT):
    """Take ``lock`` or raise TqtxError naming the lock file and the recorded owner."""
    import filelock

    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        raise TqtxError(f"could not take {lock.lock_file} within {timeout:.0f}s: another "
                        f"process keeps starting or stopping the deployment of this state "
                        f"dir") from None


# ---------------------------------------------------------------- the record
def read_record(state_dir: str) -> dict | None:
    """The owner record, or None when there is none or it is unreadable (then it is stale)."""
    path = record_path(state_dir)
    try:
        with open(path) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable owner record %s: %s", path, exc)
        return None
    if not isinstance(rec, dict) or rec.get("version") != RECORD_VERSION:
        log.warning("ignoring owner record %s of an unknown format", path)
        return None
    return rec


def write_record(state_dir: str, record: dict) -> None:
    """Write the owner record atomically (tmp + fsync + os.replace), mode 0600."""
    fsutil.replace_file_synced(record_path(state_dir),
                               json.dumps(record, indent=1, sort_keys=True).encode(), mode=0o600)


def _deployment_curve(dep) -> tuple[bool, str | None, str | None]:
    """(uses CURVE, server public key, keys dir) as the deployment's processes decide it."""
    from ..wire import security

    forced = dep.env.get("TQTX_CURVE") == "1"
    if not (forced or not security.is_loopback(dep.host)):
        return False, None, None
    keys_dir = dep.env.get("TQTX_KEYS_DIR") or os.path.join(dep.state_dir, security.KEYS_SUBDIR)
    if not security.has_server_keys(keys_dir):
        return False, None, None  # --insecure: plain connections
    return True, security.server_public_key(keys_dir), os.path.abspath(keys_dir)


# Environment variables that name the job a process belongs to, first match wins.
# torchrun's default run id is the literal "none", which names no job.
JOB_ENV = ("TQTX_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def job_identity() -> str | None:
    """The job this process belongs to, as its environment names it (None: unknown)."""
    for name in JOB_ENV:
        value = os.environ.get(name, "").strip()
        if value and value != "none":
            return f"{name}={value}"
    return None


def check_same_job(rec: dict) -> None:
    """Refuse to attach to a deployment another job created (StateDirInUseError).

    Two jobs of one user that share a state dir would otherwise share one buffer, and
    their partitions with it. Only a known job identity on both sides can tell them apart.
    """
    from ..errors import StateDirInUseError

    theirs, mine = rec.get("job"), job_identity()
    if theirs and mine and theirs != mine:
        raise StateDirInUseError(
            f"state dir {rec.get('state_dir')} is in use by the deployment of another job "
            f"({theirs}, created by pid {rec.get('owner_pid')} at {rec.get('address')}); this "
            f"process belongs to {mine}. Give each job its own TQTX_STATE_DIR (or state_dir), "
            f"or attach by address explicitly")


def publish(dep) -> dict:
    """Write the owner record of LocalDeployment ``dep`` (this process is its creator).

    Also exports ``TQTX_STATE_DIR`` (when unset) so that the processes this one starts
    later, calling a bare ``tq.init()``, find this deployment.
    """
    os.environ.setdefault("TQTX_STATE_DIR", dep.state_dir)
    curve, server_key, keys_dir = _deployment_curve(dep)
    rec = {"version": RECORD_VERSION, "state_dir": dep.state_dir, "address": dep.address,
           "job": job_identity(),
           "incarnation": dep.incarnation, "num_units": dep.num_units, "pids": dict(dep.pids),
           "owner_pid": os.getpid(), "owner_started": process_started(os.getpid()),
           "hostname": socket.gethostname(), "curve": curve, "server_key": server_key,
           "keys_dir": keys_dir, "created": time.time()}
    setting = getattr(dep, "durability", None)
    if setting is not None:  # what `tqtx journal show` reports the state dir ran with
        rec.update(setting.record(dep.state_dir))
    write_record(dep.state_dir, rec)
    return rec


def withdraw(dep, record: dict) -> None:
    """Remove ``record`` if the file still holds it (never a newer deployment's record)."""
    on_disk = read_record(dep.state_dir)
    if on_disk is None or (on_disk.get("owner_pid"), on_disk.get("incarnation")) != (
            record.get("owner_pid"), record.get("incarnation")):
        return
    try:
        os.unlink(record_path(dep.state_dir))
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- attaching
def record_curve(rec: dict, cfg: dict):
    """The client socket configurator for the recorded deployment (None: plain)."""
    if not rec.get("curve"):
        return None
    from ..wire.security import client_curve_for
    return client_curve_for(rec["state_dir"], server_key=cfg.get("server_key") or rec["server_key"],
                            keys_dir=cfg.get("keys_dir") or rec.get("keys_dir"),
                            client_key_file=cfg.get("client_key"))


class RecordedDeployment:
    """Liveness of a deployment this process attached to through its owner record.

    Its processes stop when their creator exits, so a request to them fails fast with
    PeerDiedError saying so instead of waiting for the whole timeout.
    """

    def __init__(self, rec: dict):
        self.record = rec
        self.local = rec.get("hostname") == socket.gethostname()

    def creator_gone(self) -> str | None:
        rec = self.record
        if self.local and not process_alive(rec.get("owner_pid"), rec.get("owner_started")):
            return (f"the process that created this deployment, pid {rec.get('owner_pid')}, "
                    f"exited; its controller and units stop with it")
        return None

    def liveness(self, name: str):
        def check():
            why = self.creator_gone()
            if why:
                return why
            pid = self.record.get("pids", {}).get(name)
            if not self.local or not isinstance(pid, int) or process_started(pid) is not None:
                return None
            # The creator may have restarted that unit, or the controller (a new
            # incarnation at the same address), and rewritten the record.
            now = read_record(self.record["state_dir"])
            same = ("owner_pid", "owner_started", "address")
            if now is not None and all(now.get(k) == self.record.get(k) for k in same):
                self.record = now
                new = now.get("pids", {}).get(name)
                if isinstance(new, int) and new != pid and process_started(new) is not None:
                    return None
            return f"pid {pid} exited"
        return check


def probe(rec: dict, state_dir: str, cfg: dict) -> str | None:
    """None if ``rec`` describes a live deployment of ``state_dir``, else why it is stale."""
    from ..wire.peer import Peer

    if os.path.abspath(rec.get("state_dir") or "") != os.path.abspath(state_dir):
        return f"it names another state dir ({rec.get('state_dir')})"
    why = RecordedDeployment(rec).creator_gone()
    if why:
        return why
    peer = Peer(rec["address"], "controller", timeout=PROBE_TIMEOUT, curve=record_curve(rec, cfg))
    try:
        topo = peer.call("TOPOLOGY", timeout=PROBE_TIMEOUT)
    except Exception as exc:
        silent = f"its controller at {rec['address']} does not answer ({type(exc).__name__}: {exc})"
        if rec.get("hostname") not in (None, socket.gethostname()):
            # Made on another host (a shared state dir): this host cannot tell whether it
            # lives, and a second deployment here would be invisible to that one's processes.
            raise TqtxError(
                f"state dir {state_dir}: its deployment was made on host {rec['hostname']!r} "
                f"(pid {rec.get('owner_pid')}) and {silent} from this host "
                f"({socket.gethostname()!r}); refusing to start a second deployment the job's "
                f"other processes would not see. Attach by address (config 'address' or "
                f"$TQTX_ADDRESS, reachable from here), use one state dir per host, or run the "
                f"job on Ray (a bare tq.init() in a Ray job uses the cluster); if that "
                f"deployment is gone, remove {record_path(state_dir)}") from exc
        return silent
    finally:
        peer.close()
    if (os.path.abspath(str(topo.get("state_dir"))) != os.path.abspath(state_dir)
            or topo.get("incarnation") != rec.get("incarnation")):
        return (f"{rec['address']} is now another deployment (state dir {topo.get('state_dir')}, "
                f"incarnation {topo.get('incarnation')})")
    return None


def live_record(state_dir: str, cfg: dict) -> dict | None:
    """The owner record of ``state_dir`` if its deployment is live (call under the lock)."""
    rec = read_record(state_dir)
    if rec is None:
        return None
    why = probe(rec, state_dir, cfg)
    if why is None:
        check_same_job(rec)
    if why:
        log.warning("owner record %s is stale (%s): starting a new deployment",
                    record_path(state_dir), why)
        return None
    return rec
