"""Crash-safe publication of a dump directory.

A dump ``<dump>`` is never written in place. Writers fill a sibling staging directory
``<dump>.tmp-<attempt_id>``; :meth:`Publication.commit` fsyncs it, moves the previous dump to
``<dump>.old``, renames staging to ``<dump>`` and deletes ``.old``. Each step is journaled in
the dump journal ``<dump>.journal.sqlite`` *after* the filesystem step, so after a crash
:func:`recover_publications` can always leave ``<dump>`` as either the complete old or the
complete new dump. All of this runs under :func:`dump_lock` (``<dump>.lock``).

Only what tqtx can prove it made is ever renamed or deleted: the dump it replaces must be a
tqtx dump of the same kind or an empty directory (:func:`check_publish_target`,
re-checked in :meth:`Publication.commit`), and a ``.old`` or staging directory is touched
only when a publication row of the journal accounts for it. Sibling names live in
:mod:`tqtx.layout.paths` and are re-exported here.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from filelock import FileLock

from .. import faults
from ..layout import paths
from .. import states as st
from ..errors import ReadOnlyDumpError, TargetNotADumpError
from ..layout.fsutil import fsync_dir, fsync_tree
from .dump import DumpJournal
from ..layout.paths import old_path, staging_path

__all__ = ["Publication", "check_publish_target", "dump_lock", "publish_dir_size",
           "recover_publications"]


_abs = paths.abs_path


def check_publish_target(target: str | os.PathLike, kind: str) -> Path:
    """Refuse, before anything is touched, to publish a ``kind`` at ``target`` unless what is
    there is tqtx's to replace; returns the absolute target.

    Allowed: a missing path, an empty directory, a complete tqtx ``kind``. Refused with
    :class:`TargetNotADumpError`: anything else (a file, a symlink, a directory with other
    contents, a dump of the other kind, the root or the working directory unless it is a
    tqtx ``kind``), and a ``<target>.old`` no unfinished publication accounts for.
    :class:`ReadOnlyDumpError` when nothing can be written beside ``target``.
    """
    p = _abs(target)
    what = "checkpoint" if kind == "checkpoint" else "dump"

    def refuse(reason: str, path: Path = p) -> TargetNotADumpError:
        return TargetNotADumpError(
            f"{path}: {reason}; tqtx replaces only an empty directory or a tqtx {what} it "
            f"made, so it refuses to publish a {what} there (choose another path, or move "
            f"it away first)", path=str(path))

    if p == p.parent:
        raise refuse("is the filesystem root")
    if p.is_symlink():
        raise refuse(f"is a symbolic link (to {os.readlink(p)!r})")
    if p.exists():
        if not p.is_dir():
            raise refuse("is an existing file, not a directory")
        found = paths.manifest_kind(p)
        if found != kind:
            try:
                here = _abs(os.getcwd())
            except OSError:
                here = None
            if found is not None:
                raise refuse(f"is a tqtx {found}, not a {what}")
            if here is not None and (p == here or p in here.parents):
                raise refuse("is the working directory" if p == here
                             else "contains the working directory")
            names = sorted(e.name for e in os.scandir(p))
            if names:
                shown = ", ".join(repr(n) for n in names[:5])
                more = f" and {len(names) - 5} more" if len(names) > 5 else ""
                manifest = (paths.CHECKPOINT_MANIFEST if kind == "checkpoint"
                            else paths.DUMP_MANIFEST)
                count = f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}"
                raise refuse(f"is a directory holding {count} ({shown}{more}) "
                             f"and no valid {manifest}, so it is not a tqtx {what}")
    old = old_path(p)
    if ((old.exists() or old.is_symlink())
            and not DumpJournal.accounts_for_old(paths.dump_journal_path(p))):
        raise refuse(f"exists beside {p.name}, and no publication in the dump journal made "
                     f"it (tqtx needs that name while it swaps the {what} in)", old)
    parent = paths.nearest_existing_parent(p)
    if not parent.is_dir():
        raise refuse(f"cannot be created: {parent} is an existing file, not a directory")
    if not paths.siblings_writable(p):
        raise ReadOnlyDumpError(f"{p}: is on read-only storage (cannot create files in "
                                f"{p.parent}); a {what} cannot be published there",
                                path=str(p))
    return p


def dump_lock(dump_dir: str | os.PathLike, timeout: float | None = None, *,
              state_dir: str | os.PathLike | None = None) -> FileLock:
    """File lock on ``<dump_dir>.lock`` serializing publication and recovery of a dump.

    For a dump on read-only storage the lock lives in ``state_dir`` instead (see
    :func:`tqtx.layout.paths.records_location`); without one that raises ReadOnlyDumpError.
    ``timeout=None`` waits forever. Note: two FileLock objects for the same path in one
    process do not share ownership; do not nest acquisitions of the same dump.
    """
    path, _journal, relocated = paths.records_location(dump_dir, state_dir)
    if not relocated and not paths.siblings_writable(dump_dir):
        raise ReadOnlyDumpError(f"{_abs(dump_dir)}: is on read-only storage, and no controller "
                                f"state dir was given to keep its lock in", path=str(dump_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(os.fspath(path), timeout=-1 if timeout is None else timeout)


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
        self.phase = st.STAGING
        created = False
        try:
            self.staging_dir.mkdir(parents=True)  # FileExistsError: never reuse a dir not ours
            created = True
            fsync_dir(self.staging_dir.parent)
        except BaseException as exc:
            if created:
                _rmtree(self.staging_dir)
            self._set(st.FAILED, f"{type(exc).__name__}: {exc}")
            raise
        faults.hit("publish.after_staging")

    def _set(self, phase: str, error: str | None = None) -> None:
        self.journal.set_phase(self.attempt_id, phase, error)
        self.phase = phase

    def mark_written(self) -> None:
        """All writers are done with the staging directory."""
        self._set(st.WRITTEN)
        faults.hit("publish.after_written")

    def commit(self, *, files_synced: bool = False, on_published=None) -> int:
        """Make the staged directory the dump; returns the published size in bytes.

        ``files_synced``: every file in the staging directory was fsynced by its writer
        before it was closed, so only the directories are fsynced here.
        ``on_published(size)`` runs once the swap is durable, before the old dump is
        deleted (a caller's notice of the new dump overlaps that cleanup).
        Raises TargetNotADumpError (before ``synced``, so abort leaves everything as it
        was) if ``<dump>`` is no longer replaceable or a ``.old`` appeared: recovery ran
        under this lock, so a ``.old`` now is not tqtx's.
        """
        size = fsync_tree(self.staging_dir, files=not files_synced)
        # Checked once, after the fsync and right before "synced" (the last moment that
        # matters): a check before the fsync as well would only fail a refused target sooner.
        self._check_target()
        self._set(st.SYNCED)
        faults.hit("publish.after_synced")

        parent = self.dump_dir.parent
        if os.path.lexists(self.dump_dir):
            os.rename(self.dump_dir, self.old_dir)
            fsync_dir(parent)
        self._set(st.OLD_MOVED)
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
        self._set(st.PUBLISHED)
        faults.hit("publish.after_published")
        if on_published is not None:
            on_published(size)

        # No fsync after deleting .old: a leftover .old beside a published dump is garbage
        # that recovery deletes (its "published" row accounts for it), so the deletion
        # need not be durable.
        if self.old_dir.exists():
            _rmtree(self.old_dir)
        self._set(st.CLEANED)
        faults.hit("publish.after_cleaned")
        return size

    def _check_target(self) -> None:
        if os.path.lexists(self.old_dir):
            raise TargetNotADumpError(
                f"{self.old_dir}: exists beside {self.dump_dir.name} and is not tqtx's (no "
                f"unfinished publication accounts for it; tqtx needs that name to swap the "
                f"{self.kind} in); the {self.kind} was not published", path=str(self.old_dir))
        if os.path.lexists(self.dump_dir) and not paths.replaceable(self.dump_dir, self.kind):
            raise TargetNotADumpError(
                f"{self.dump_dir}: is not an empty directory or a tqtx {self.kind} (it may "
                f"have changed during the publication); the {self.kind} was not published",
                path=str(self.dump_dir))

    def abort(self, error: str) -> None:
        """Give up this attempt; ``<dump>`` is left as the complete old (or, once the
        new dump was already renamed into place, the complete new) dump."""
        row = self.journal.get_publication(self.attempt_id)
        phase = row["phase"] if row else self.phase
        if phase in st.PUBLICATION_FINAL:
            self.phase = phase
            return
        if phase == st.PUBLISHED:
            # The new dump is already in place: the only safe direction is forward.
            if self.old_dir.exists():
                _rmtree(self.old_dir)
            self._set(st.CLEANED, error)
            return
        if _settle(self.dump_dir, self.staging_dir, phase, forward=False) == "forward":
            self._set(st.PUBLISHED)
            self._set(st.CLEANED, error)
        else:
            self._set(st.FAILED if phase != st.OLD_MOVED else st.ROLLED_BACK, error)


def _settle(dump_dir: Path, staging: Path, phase: str, *, forward: bool = True) -> str:
    """Bring the filesystem to a consistent state for an attempt found at ``phase``
    (not published/final). With ``forward`` an old-moved attempt whose synced staging dir
    survives is completed; otherwise it is undone. Returns 'forward' if the new dump is now
    in place, else 'back'."""
    old = old_path(dump_dir)
    parent = dump_dir.parent
    # Before "synced" the attempt never touched <dump> or .old: whatever is there is not ours.
    moved = phase in (st.SYNCED, st.OLD_MOVED)
    if forward and phase == st.OLD_MOVED and staging.is_dir() and not dump_dir.exists():
        # Staging was synced before old-moved was journaled: finish the swap.
        os.rename(staging, dump_dir)
        fsync_dir(parent)
        if old.exists():
            _rmtree(old)
            fsync_dir(parent)
        return "forward"
    if phase == st.OLD_MOVED and not staging.exists() and dump_dir.exists():
        # Crashed after renaming staging into place, before journaling "published".
        if old.exists():
            _rmtree(old)
            fsync_dir(parent)
        return "forward"
    if staging.exists() or staging.is_symlink():
        _rmtree(staging)
    if moved and not dump_dir.exists() and old.exists():
        os.rename(old, dump_dir)
    if parent.is_dir():
        fsync_dir(parent)
    return "back"


def open_recovery_journal(dump_dir: str | os.PathLike,
                          state_dir: str | os.PathLike | None = None) -> DumpJournal | None:
    """The dump journal :func:`recover_publications` settles from, open; None when there is
    none, or when nothing beside the dump can be renamed (read-only storage)."""
    dump = _abs(dump_dir)
    if not paths.siblings_writable(dump):
        return None
    path = paths.find_dump_journal(dump, state_dir)
    return None if path is None else DumpJournal(dump, path=path)


def recover_publications(dump_dir: str | os.PathLike, journal: DumpJournal | None = None
                         ) -> list[dict]:
    """Settle every unfinished publication of ``dump_dir`` (caller holds :func:`dump_lock`).

    Decision per phase found: staging/written/synced -> remove staging, keep the old dump,
    ``rolled-back``; old-moved -> roll forward if the synced staging dir (or the new dump) is
    there, else put ``.old`` back and ``rolled-back``; published -> delete ``.old``,
    ``cleaned``. Only journaled debris is touched: a ``<dump>.old`` or ``<dump>.tmp-*`` that
    no row accounts for is left alone (it is not tqtx's), and so is a row whose staging path
    is not ``<dump>.tmp-<its attempt id>``. A dump on read-only storage is left as it is.
    Idempotent; returns the actions taken.
    """
    dump = _abs(dump_dir)
    target = os.fspath(dump)
    actions: list[dict] = []

    def act(action: str, detail: str) -> None:
        actions.append({"kind": "publication", "target": target, "action": action,
                        "detail": detail})

    own = journal is None
    if own:
        journal = open_recovery_journal(dump)
        if journal is None:
            return actions
    elif not paths.siblings_writable(dump):
        return actions  # nothing can be renamed there, and nothing was published there since
    try:
        for pub in journal.unfinished_publications():
            aid, phase = pub["attempt_id"], pub["phase"]
            staging = _journaled_staging(dump, pub)
            if staging is None:
                journal.set_phase(aid, st.CLEANED if phase == st.PUBLISHED else st.ROLLED_BACK,
                                  f"staging path {pub['staging_dir']!r} is not beside "
                                  f"{dump.name}; nothing touched")
                act("ignored", f"attempt {aid}: staging path {pub['staging_dir']!r} is not "
                               f"{dump.name}{paths.STAGING_INFIX}{aid}; nothing touched")
                continue
            if phase == st.PUBLISHED:
                old = old_path(dump)
                if old.exists() or old.is_symlink():
                    _rmtree(old)
                    fsync_dir(dump.parent)
                journal.set_phase(aid, st.CLEANED)
                act(st.CLEANED, f"attempt {aid}: found published; removed {old.name}")
                continue
            direction = _settle(dump, staging, phase)
            if direction == "forward":
                journal.set_phase(aid, st.PUBLISHED)
                journal.set_phase(aid, st.CLEANED)
                act("rolled-forward", f"attempt {aid}: found {phase}; new dump published")
            else:
                journal.set_phase(aid, st.ROLLED_BACK, f"recovered from phase {phase}")
                act(st.ROLLED_BACK, f"attempt {aid}: found {phase}; staging removed, "
                                   f"{'old dump kept' if dump.exists() else 'no dump'}")
        return actions
    finally:
        if own:
            journal.close()


def _journaled_staging(dump: Path, pub: dict) -> Path | None:
    """The staging dir a publication row names, if it is ``<dump>.tmp-<attempt id>``."""
    aid = pub["attempt_id"]
    if not aid or "/" in aid or "\\" in aid or "\0" in aid or aid in (".", ".."):
        return None
    staging = staging_path(dump, aid)
    if os.path.abspath(pub["staging_dir"] or "") != os.fspath(staging):
        return None
    return staging
