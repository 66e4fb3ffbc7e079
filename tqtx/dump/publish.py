"""Crash-safe publication of a dump directory.

A dump ``<dump>`` is never written in place. Writers fill a sibling staging directory
``<dump>.tmp-<attempt_id>``; :meth:`Publication.commit` fsyncs it, moves the previous dump to
``<dump>.old``, renames staging to ``<dump>`` and deletes ``.old``. Each step is journaled in
the dump journal ``<dump>.journal.sqlite`` *after* the filesystem step, so after a crash
:func:`recover_publications` can always leave ``<dump>`` as either the complete old or the
complete new dump. All of this runs under :func:`dump_lock` (``<dump>.lock``).
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from filelock import FileLock

from .. import faults
from ..journal.store import DumpJournal, dump_journal_path
from .format import fsync_dir

__all__ = [
    "Publication", "dump_lock", "fsync_dir", "fsync_file", "lock_path", "old_path",
    "publish_dir_size", "recover_publications", "staging_path",
]


def _abs(dump_dir: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.fspath(dump_dir)))


def _sibling(dump_dir: str | os.PathLike, suffix: str) -> Path:
    p = _abs(dump_dir)
    return p.with_name(p.name + suffix)


def lock_path(dump_dir: str | os.PathLike) -> Path:
    """``<dump_dir>.lock``."""
    return _sibling(dump_dir, ".lock")


def old_path(dump_dir: str | os.PathLike) -> Path:
    """``<dump_dir>.old`` (the previous dump while a new one is being swapped in)."""
    return _sibling(dump_dir, ".old")


def staging_path(dump_dir: str | os.PathLike, attempt_id: str) -> Path:
    """``<dump_dir>.tmp-<attempt_id>``."""
    return _sibling(dump_dir, f".tmp-{attempt_id}")


def dump_lock(dump_dir: str | os.PathLike, timeout: float | None = None) -> FileLock:
    """File lock on ``<dump_dir>.lock`` serializing publication and recovery of a dump.

    ``timeout=None`` waits forever. Note: two FileLock objects for the same path in one
    process do not share ownership; do not nest acquisitions of the same dump.
    """
    path = lock_path(dump_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(os.fspath(path), timeout=-1 if timeout is None else timeout)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync one regular file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)




def _fsync_tree(root: Path) -> int:
    """One bottom-up pass: fsync every file, then its directory. Returns total file bytes."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fsync_file(p)
                total += os.path.getsize(p)
        fsync_dir(dirpath)
    return total


def publish_dir_size(path: str | os.PathLike) -> int:
    """Total size in bytes of the regular files under ``path``."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class Publication:
    """One attempt at publishing ``dump_dir``; create and use it under :func:`dump_lock`."""

    def __init__(self, dump_dir: str | os.PathLike, *, kind: str = "dump", dump_id: str | None,
                 journal: DumpJournal):
        self.dump_dir = _abs(dump_dir)
        self.kind = kind
        self.dump_id = dump_id
        self.journal = journal
        self.attempt_id = uuid.uuid4().hex[:12]
        self.staging_dir = staging_path(self.dump_dir, self.attempt_id)
        self.old_dir = old_path(self.dump_dir)
        # Journal the attempt before its staging dir exists, so every failure (even of
        # the mkdir) is recorded and recovery knows which directory to remove.
        journal.begin_publication(attempt_id=self.attempt_id, kind=kind, dump_id=dump_id,
                                  staging_dir=self.staging_dir)
        self.phase = "staging"
        try:
            self.staging_dir.mkdir(parents=True)
            fsync_dir(self.staging_dir.parent)
        except BaseException as exc:
            _rmtree(self.staging_dir)
            self._set("failed", f"{type(exc).__name__}: {exc}")
            raise
        faults.hit("publish.after_staging")

    def _set(self, phase: str, error: str | None = None) -> None:
        self.journal.set_phase(self.attempt_id, phase, error)
        self.phase = phase

    def mark_written(self) -> None:
        """All writers are done with the staging directory."""
        self._set("written")
        faults.hit("publish.after_written")

    def commit(self) -> int:
        """Make the staged directory the dump; returns the published size in bytes."""
        size = _fsync_tree(self.staging_dir)
        self._set("synced")
        faults.hit("publish.after_synced")

        parent = self.dump_dir.parent
        if self.old_dir.exists() or self.old_dir.is_symlink():
            if self.dump_dir.exists():
                _rmtree(self.old_dir)  # stale leftover of an earlier, finished swap
            else:
                # A crashed swap that nobody recovered: put the old dump back first.
                os.rename(self.old_dir, self.dump_dir)
        if self.dump_dir.exists():
            os.rename(self.dump_dir, self.old_dir)
            fsync_dir(parent)
        self._set("old-moved")
        faults.hit("publish.after_old_moved")

        os.rename(self.staging_dir, self.dump_dir)
        try:
            fsync_dir(parent)  # the point of no return: the swap is durable
        except OSError:
            # Not durable: undo the swap, so the error we raise leaves the old dump in place.
            os.rename(self.dump_dir, self.staging_dir)
            if self.old_dir.exists():
                os.rename(self.old_dir, self.dump_dir)
            raise
        self._set("published")
        faults.hit("publish.after_published")

        # No fsync after deleting .old: a leftover .old beside a published dump is garbage
        # that recovery deletes, so the deletion need not be durable.
        if self.old_dir.exists():
            _rmtree(self.old_dir)
        self._set("cleaned")
        faults.hit("publish.after_cleaned")
        return size

    def abort(self, error: str) -> None:
        """Give up this attempt; ``<dump>`` is left as the complete old (or, once the
        new dump was already renamed into place, the complete new) dump."""
        row = self.journal.get_publication(self.attempt_id)
        phase = row["phase"] if row else self.phase
        if phase in ("cleaned", "failed", "rolled-back"):
            self.phase = phase
            return
        if phase in ("published",):
            # The new dump is already in place: the only safe direction is forward.
            if self.old_dir.exists():
                _rmtree(self.old_dir)
            self._set("cleaned", error)
            return
        if _settle(self.dump_dir, self.staging_dir, phase, forward=False) == "forward":
            self._set("published")
            self._set("cleaned", error)
        else:
            self._set("failed" if phase != "old-moved" else "rolled-back", error)


def _settle(dump_dir: Path, staging: Path, phase: str, *, forward: bool = True) -> str:
    """Bring the filesystem to a consistent state for an attempt found at ``phase``
    (not published/final). With ``forward`` an old-moved attempt whose synced staging dir
    survives is completed; otherwise it is undone. Returns 'forward' if the new dump is now
    in place, else 'back'."""
    old = old_path(dump_dir)
    parent = dump_dir.parent
    if forward and phase == "old-moved" and staging.is_dir() and not dump_dir.exists():
        # Staging was synced before old-moved was journaled: finish the swap.
        os.rename(staging, dump_dir)
        fsync_dir(parent)
        if old.exists():
            _rmtree(old)
            fsync_dir(parent)
        return "forward"
    if phase == "old-moved" and not staging.exists() and dump_dir.exists():
        # Crashed after renaming staging into place, before journaling "published".
        if old.exists():
            _rmtree(old)
            fsync_dir(parent)
        return "forward"
    if staging.exists() or staging.is_symlink():
        _rmtree(staging)
    if not dump_dir.exists() and old.exists():
        os.rename(old, dump_dir)
    fsync_dir(parent)
    return "back"


def recover_publications(dump_dir: str | os.PathLike, journal: DumpJournal | None = None
                         ) -> list[dict]:
    """Settle every unfinished publication of ``dump_dir`` (caller holds :func:`dump_lock`).

    Decision per phase found: staging/written/synced -> remove staging, keep the old dump,
    ``rolled-back``; old-moved -> roll forward if the synced staging dir (or the new dump) is
    there, else put ``.old`` back and ``rolled-back``; published -> delete ``.old``,
    ``cleaned``. Then, journal or not: restore a lone ``.old`` when ``<dump>`` is missing and
    delete stray ``<dump>.tmp-*`` and ``<dump>.old``. Idempotent; returns the actions taken.
    """
    dump = _abs(dump_dir)
    target = os.fspath(dump)
    actions: list[dict] = []

    def act(action: str, detail: str) -> None:
        actions.append({"kind": "publication", "target": target, "action": action,
                        "detail": detail})

    own = False
    if journal is None and dump_journal_path(dump).exists():
        journal = DumpJournal(dump)
        own = True
    try:
        if journal is not None:
            for pub in journal.unfinished_publications():
                aid, phase = pub["attempt_id"], pub["phase"]
                staging = Path(pub["staging_dir"])
                if phase == "published":
                    old = old_path(dump)
                    if old.exists():
                        _rmtree(old)
                        fsync_dir(dump.parent)
                    journal.set_phase(aid, "cleaned")
                    act("cleaned", f"attempt {aid}: found published; removed {old.name}")
                    continue
                direction = _settle(dump, staging, phase)
                if direction == "forward":
                    journal.set_phase(aid, "published")
                    journal.set_phase(aid, "cleaned")
                    act("rolled-forward", f"attempt {aid}: found {phase}; new dump published")
                else:
                    journal.set_phase(aid, "rolled-back", f"recovered from phase {phase}")
                    act("rolled-back", f"attempt {aid}: found {phase}; staging removed, "
                                       f"{'old dump kept' if dump.exists() else 'no dump'}")
        # Journal-independent sweep (also covers a crash before the journal row existed).
        old = old_path(dump)
        if not dump.exists() and old.is_dir():
            os.rename(old, dump)
            fsync_dir(dump.parent)
            act("restored-old", f"{old.name} renamed back to {dump.name}")
        elif dump.exists() and (old.exists() or old.is_symlink()):
            _rmtree(old)
            act("removed-old", f"removed stray {old.name}")
        if dump.parent.is_dir():
            prefix = dump.name + ".tmp-"
            for entry in sorted(dump.parent.iterdir()):
                if entry.name.startswith(prefix):
                    _rmtree(entry)
                    act("removed-staging", f"removed stray {entry.name}")
        return actions
    finally:
        if own:
            journal.close()
