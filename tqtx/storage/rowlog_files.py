"""The row log writer's view of its files, for compaction: each file's size, the file each
live row began in, the file of each live mark, and the files that hold nothing live any more.

A row *begins* in the file of its first entry of its generation; later entries of that
generation merge into it, so all of them are needed unless the whole row is logged again
(a compaction's entry), which makes the row begin there. A file in which no live row
begins holds only entries that later ones replaced, dropped or reset: once everything
written after it is fsynced it can go. (The drops and resets in it only concern rows of
older files, which went before it.) A mark (an applied restore or checkpoint load) is live
while a unit could be asked about it again: the last checkpoint load's, and the last
:data:`RESTORE_MARKS` restores' (as many as a unit remembers); a compaction logs the live
marks of a file again, with its rows. Used by :mod:`tqtx.storage.rowlog`'s writer thread only.
"""
from __future__ import annotations

from collections import OrderedDict

from ..format import rowlog as fl

RESTORE_MARKS = 1024  # as many as storage.restore.AppliedRestores keeps

FileKey = tuple[int, int]  # (number, 0) for a base file, (number, 1) for a segment


def file_key(kind: str, number: int) -> FileKey:
    return number, 0 if kind == fl.BASE else 1


def file_name(key: FileKey) -> str:
    return fl.file_name(fl.BASE if key[1] == 0 else fl.SEGMENT, key[0])


class LogFiles:
    """Sizes, where the live rows began, and dead files (see the module docstring)."""

    def __init__(self):
        self.sizes: dict[FileKey, int] = {}
        self._home: dict[int, tuple[int, FileKey]] = {}   # index -> (generation, file)
        self._began: dict[FileKey, set] = {}              # file -> indexes begun there
        # the live marks: restore id -> (rows, file), oldest first; the checkpoint load's
        self._marks: OrderedDict[str, tuple[int, FileKey]] = OrderedDict()
        self._checkpoint: tuple[str, int, FileKey] | None = None
        self.dead: list[FileKey] = []                      # to delete after the next fsync

    # ---------------------------------------------------------------- entries
    def row(self, idx: int, gen: int, key: FileKey, whole: bool) -> None:
        """Row ``idx`` of ``gen`` was logged in file ``key``: it begins there unless an
        earlier entry of that generation began it (and this one is not the whole row)."""
        held = self._home.get(idx)
        if held is not None:
            if held[0] > gen or (held[0] == gen and not whole):
                return
            self._began[held[1]].discard(idx)
        self._home[idx] = (gen, key)
        began = self._began.get(key)
        if began is None:
            began = self._began[key] = set()
        began.add(idx)

    def drop(self, idx: int, gen: int) -> None:
        held = self._home.get(idx)
        if held is not None and held[0] == gen:
            del self._home[idx]
            self._began[held[1]].discard(idx)

    def reset(self) -> None:
        self._home.clear()
        self._began.clear()

    def mark(self, what: str, ident: str, rows: int, key: FileKey) -> None:
        """A mark was logged in file ``key``: it is the live one of its ``(what, id)``; an
        earlier checkpoint load's mark, and restore marks past RESTORE_MARKS, are not."""
        if what == fl.MARK_CHECKPOINT:
            self._checkpoint = (ident, rows, key)
            return
        marks = self._marks
        marks[ident] = (rows, key)  # logged again by a compaction: it keeps its place
        if len(marks) > RESTORE_MARKS:
            marks.popitem(last=False)

    # ---------------------------------------------------------------- compaction
    def live_disk(self, disk: int) -> int:
        """``disk`` (the files' bytes) less the dead files'."""
        return disk - sum(self.sizes.get(k, 0) for k in self.dead)

    def oldest(self, open_key: FileKey) -> FileKey | None:
        """The oldest file that is neither dead nor the open segment."""
        return min((k for k in self.sizes if k != open_key and k not in self.dead),
                   default=None)

    def live_rows_of(self, key: FileKey) -> dict[int, int]:
        """The rows that began in ``key``: index -> generation."""
        return {idx: self._home[idx][0] for idx in self._began.get(key, ())}

    def live_marks_of(self, key: FileKey) -> list[tuple[str, str, int]]:
        """The live marks logged in ``key``: ``(what, id, rows)``, oldest first."""
        out = [(fl.MARK_RESTORE, ident, rows) for ident, (rows, k) in self._marks.items()
               if k == key]
        if self._checkpoint is not None and self._checkpoint[2] == key:
            out.append((fl.MARK_CHECKPOINT, *self._checkpoint[:2]))
        return out

    def forget_marks(self, key: FileKey) -> None:
        """The marks still in ``key`` are not live (a compaction did not log them again)."""
        for ident in [i for i, (_rows, k) in self._marks.items() if k == key]:
            del self._marks[ident]
        if self._checkpoint is not None and self._checkpoint[2] == key:
            self._checkpoint = None

    def kill(self, key: FileKey) -> bool:
        """Mark ``key`` dead if no live row begins in it and no live mark is in it;
        whether it is."""
        if self._began.get(key) or self.live_marks_of(key):
            return False
        self._began.pop(key, None)
        self.dead.append(key)
        return True

    def removed(self, key: FileKey) -> int:
        """A dead file was deleted: its size."""
        self.dead.remove(key)
        return self.sizes.pop(key, 0)
