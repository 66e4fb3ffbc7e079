"""Every file name tqtx uses beside a dump or in a state dir.

Beside a dump ``<dump>`` (siblings, never inside it): ``<dump>.lock`` (the dump lock),
``<dump>.journal.sqlite`` (with SQLite's ``-journal`` file and, once it was upgraded from
an older schema, ``.migrate.lock``) and, only
while a publication runs or after it crashed, ``<dump>.tmp-<attempt>`` (staging) and
``<dump>.old`` (the previous dump during the swap). Inside a dump: ``dump_info.json``,
``rows.msgpack``, ``shards/unit-<k>.bin`` and ``.index``; inside a checkpoint:
``checkpoint_info.json``, ``controller.msgpack``, ``metadata.json``, ``units/unit-<k>.bin``
and ``.index``. In a state dir: ``journal.sqlite``, ``controller.lock``,
``controller.owner``, ``deployment.json`` and ``init.lock`` (create-or-attach),
``logs/controller.log`` and ``logs/unit-<k>.log``, and, for dumps on read-only storage,
``dumps/<sha256>.lock`` and ``dumps/<sha256>.journal.sqlite`` (see :func:`records_location`).

What tqtx may replace is decided by :func:`tqtx.journal.publish.check_publish_target` from these
names and the dump journal.

A torch-free leaf module: it imports nothing from tqtx.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path


log = logging.getLogger("tqtx.layout.paths")

DUMP_MANIFEST = "dump_info.json"
ROW_INDEX = "rows.msgpack"
SHARDS_DIR = "shards"
CHECKPOINT_MANIFEST = "checkpoint_info.json"
CHECKPOINT_KIND = "tqtx-checkpoint"
CHECKPOINT_METADATA = "controller.msgpack"
CHECKPOINT_USER_METADATA = "metadata.json"  # TransferQueue's name and layout
CHECKPOINT_UNITS_DIR = "units"
DEPLOYMENT_RECORD = "deployment.json"
INIT_LOCK = "init.lock"
CONTROLLER_OWNER = "controller.owner"
UNITS_DIR = "units"
LOGS_DIR = "logs"
LOCK_SUFFIX = ".lock"
OLD_SUFFIX = ".old"
STAGING_INFIX = ".tmp-"
JOURNAL_SUFFIX = ".journal.sqlite"
MIGRATE_LOCK_SUFFIX = ".migrate.lock"
SQLITE_JOURNAL_SUFFIX = "-journal"  # SQLite's rollback journal next to a database file
RELOCATED_DIR = "dumps"


# --------------------------------------------------------------------------- names


def abs_path(path: str | os.PathLike) -> Path:
    """``path`` made absolute (not resolved: a symlink stays a symlink)."""
    return Path(os.path.abspath(os.fspath(path)))


def check_path_arg(path, what: str = "dump_dir") -> str:
    """The absolute form of a user-given path; ValueError for an empty or blank one
    (``os.path.abspath("")`` is the working directory)."""
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if not p.strip():
        raise ValueError(f"{what} must be a non-empty path, got {path!r} (an empty path "
                         f"would mean the working directory)")
    return os.path.abspath(p)


def sibling(dump_dir: str | os.PathLike, suffix: str) -> Path:
    """``<dump_dir><suffix>``, beside the dump."""
    p = abs_path(dump_dir)
    return p.with_name(p.name + suffix)


def lock_path(dump_dir: str | os.PathLike) -> Path:
    """``<dump_dir>.lock``."""
    return sibling(dump_dir, LOCK_SUFFIX)


def old_path(dump_dir: str | os.PathLike) -> Path:
    """``<dump_dir>.old`` (the previous dump while a new one is being swapped in)."""
    return sibling(dump_dir, OLD_SUFFIX)


def staging_path(dump_dir: str | os.PathLike, attempt_id: str) -> Path:
    """``<dump_dir>.tmp-<attempt_id>``."""
    return sibling(dump_dir, f"{STAGING_INFIX}{attempt_id}")


def dump_journal_path(dump_dir: str | os.PathLike) -> Path:
    """``<dump_dir>.journal.sqlite``: a sibling of the dump directory, not inside it."""
    return sibling(dump_dir, JOURNAL_SUFFIX)


def migrate_lock_path(db_path: str | os.PathLike) -> Path:
    """``<db>.migrate.lock``, serializing schema upgrades of one journal file."""
    return Path(os.fspath(db_path) + MIGRATE_LOCK_SUFFIX)


def default_state_dir() -> Path:
    """``$TQTX_STATE_DIR``, else ``$XDG_STATE_HOME/tqtx/default``, else ``~/.local/state/tqtx/default``."""
    env = os.environ.get("TQTX_STATE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "tqtx" / "default"


def controller_journal_path(state_dir: str | os.PathLike) -> Path:
    """Path of the controller journal inside ``state_dir``."""
    return Path(state_dir) / "journal.sqlite"


def shard_file_name(unit) -> str:
    """Relative path of the shard holding unit ``unit``'s records, inside a dump."""
    return f"{SHARDS_DIR}/unit-{unit}.bin"


def shard_index_name(unit) -> str:
    """Relative path of the index of unit ``unit``'s shard, inside a dump."""
    return f"{SHARDS_DIR}/unit-{unit}.index"


def checkpoint_unit_file(unit) -> str:
    """Relative path of unit ``unit``'s rows inside a checkpoint."""
    return f"{CHECKPOINT_UNITS_DIR}/unit-{unit}.bin"


def checkpoint_unit_log_dir(unit) -> str:
    """Relative path of the directory of unit ``unit``'s row log files inside a checkpoint
    (a unit with a row log saves by linking them, ``docs/checkpoint.md``)."""
    return f"{CHECKPOINT_UNITS_DIR}/unit-{unit}"


def checkpoint_unit_index(unit) -> str:
    """Relative path of the index of unit ``unit``'s rows inside a checkpoint."""
    return f"{CHECKPOINT_UNITS_DIR}/unit-{unit}.index"


def log_dir(state_dir: str | os.PathLike) -> str:
    """``<state_dir>/logs``: the logs of the deployment's processes."""
    return os.path.join(os.fspath(state_dir), LOGS_DIR)


def process_log(state_dir: str | os.PathLike, name: str) -> str:
    """``<state_dir>/logs/<name>.log`` (``controller``, ``unit-<k>``)."""
    return os.path.join(log_dir(state_dir), f"{name}.log")


def unit_data_root(state_dir: str | os.PathLike) -> str:
    """``<state_dir>/units``: where units keep their row logs (durability ``buffer`` and
    ``sync``) unless ``$TQTX_UNIT_DATA_DIR`` names another place; unit ``k`` uses
    ``unit-<k>/`` under it (:func:`tqtx.durability.unit_dir`)."""
    return os.path.join(os.fspath(state_dir), UNITS_DIR)


def controller_owner_path(state_dir: str | os.PathLike) -> Path:
    """``<state_dir>/controller.owner``: who holds the controller lock (pid, host, address)."""
    return abs_path(state_dir) / CONTROLLER_OWNER


def controller_lock_path(state_dir: str | os.PathLike) -> Path:
    """The file lock a running controller holds on its ``state_dir``."""
    return Path(state_dir) / "controller.lock"


def controller_running(state_dir: str | os.PathLike, timeout: float = 0.0) -> bool | None:
    """Does a controller run on ``state_dir``? It holds :func:`controller_lock_path` for its
    whole life: True while another holds it (after waiting up to ``timeout`` seconds for it
    to go), False once it is free, None when the lock file cannot even be opened (a
    read-only state dir: cannot tell)."""
    import filelock

    lock = filelock.FileLock(os.fspath(controller_lock_path(state_dir)))
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:  # before OSError: a Timeout is one
        return True
    except OSError:
        return None
    lock.release()
    return False


def is_own_sibling(name: str, dump_name: str) -> bool:
    """Is ``name`` (an entry beside the dump ``dump_name``) one of tqtx's own sibling files:
    lock, journal files, staging or ``.old``? (Staging and ``.old`` are tqtx's only when a
    journal row accounts for them; this only matches the names.)"""
    if not name.startswith(dump_name) or name == dump_name:
        return False
    rest = name[len(dump_name):]
    journal = (JOURNAL_SUFFIX, JOURNAL_SUFFIX + SQLITE_JOURNAL_SUFFIX,
               JOURNAL_SUFFIX + MIGRATE_LOCK_SUFFIX)
    return rest in (LOCK_SUFFIX, OLD_SUFFIX, *journal) or rest.startswith(STAGING_INFIX)


# --------------------------------------------------------------------------- read-only dumps


def nearest_existing_parent(path: str | os.PathLike) -> Path:
    """The nearest ancestor of ``path`` that exists (``/`` at the last)."""
    parent = abs_path(path).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def siblings_writable(dump_dir: str | os.PathLike) -> bool:
    """Can files be created beside ``dump_dir``? (Its nearest existing ancestor is a
    writable directory; ``os.access`` reports a read-only mount even to root.)"""
    parent = nearest_existing_parent(dump_dir)
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def relocated_path(state_dir: str | os.PathLike, dump_dir: str | os.PathLike,
                   suffix: str) -> Path:
    """``<state_dir>/dumps/<sha256 of the absolute dump path><suffix>``."""
    digest = hashlib.sha256(os.fsencode(str(abs_path(dump_dir)))).hexdigest()
    return Path(os.path.abspath(os.fspath(state_dir))) / RELOCATED_DIR / (digest + suffix)


_relocated_lock = threading.Lock()
_relocated: dict[str, str] = {}  # dump dir -> state dir its records were moved to (this process)


def records_location(dump_dir: str | os.PathLike, state_dir: str | os.PathLike | None = None
                     ) -> tuple[Path, Path, bool]:
    """``(lock, journal, relocated)`` for ``dump_dir``: its siblings where they can be
    written, else the files in ``state_dir`` (the controller's) named by
    :func:`relocated_path` -- logged as a WARNING once per dump and process. Without a
    ``state_dir`` the one this process used before for that dump is taken; failing that the
    (unwritable) siblings are returned with ``relocated`` False."""
    dump = abs_path(dump_dir)
    if siblings_writable(dump):
        return lock_path(dump), dump_journal_path(dump), False
    key = str(dump)
    with _relocated_lock:
        if state_dir is None:
            state_dir = _relocated.get(key)
            if state_dir is None:
                return lock_path(dump), dump_journal_path(dump), False
        state_dir = os.path.abspath(os.fspath(state_dir))
        first = _relocated.get(key) != state_dir
        _relocated[key] = state_dir
    lock = relocated_path(state_dir, dump, LOCK_SUFFIX)
    journal = relocated_path(state_dir, dump, JOURNAL_SUFFIX)
    if first:
        log.warning("dump %s: its directory is read-only, so its lock and journal are kept "
                    "in the controller's state dir instead: %s, %s", dump, lock, journal)
    return lock, journal, True


def find_dump_journal(dump_dir: str | os.PathLike, state_dir: str | os.PathLike | None = None
                      ) -> Path | None:
    """The existing dump journal of ``dump_dir`` where tqtx writes it (beside the dump, or
    relocated into ``state_dir`` for a read-only dump), or None."""
    journal = records_location(dump_dir, state_dir)[1]
    return journal if journal.exists() else None


# --------------------------------------------------------------------------- replace rule


def manifest_kind(path: str | os.PathLike) -> str | None:
    """``"dump"`` or ``"checkpoint"`` if ``path`` is a directory (not a symlink) whose
    manifest parses as a tqtx dump / checkpoint, else None. Reads only the manifest."""
    p = abs_path(path)
    if p.is_symlink() or not p.is_dir():
        return None
    m = _read_json(p / DUMP_MANIFEST)
    if (isinstance(m, dict) and _is_int(m.get("format_version"))
            and isinstance(m.get("dump_id"), str) and isinstance(m.get("partition_id"), str)
            and isinstance(m.get("row_index"), dict) and isinstance(m.get("shards"), list)):
        return "dump"
    m = _read_json(p / CHECKPOINT_MANIFEST)
    if isinstance(m, dict) and m.get("kind") == CHECKPOINT_KIND and _is_int(m.get("format_version")):
        return "checkpoint"
    return None


def replaceable(path: str | os.PathLike, kind: str) -> bool:
    """May a new ``kind`` ("dump" or "checkpoint") replace what is at ``path``? True for a
    tqtx ``kind`` or an empty directory (it holds nothing to lose)."""
    p = abs_path(path)
    if p.is_symlink() or not p.is_dir():
        return False
    return manifest_kind(p) == kind or not any(os.scandir(p))


def _read_json(path: Path):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(16 << 20) or b"null")
    except (OSError, ValueError):
        return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
