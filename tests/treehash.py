"""Hash the tree around a dump path, to prove tqtx changed nothing that is not its own.

``snapshot(root)`` records every entry below ``root`` (names, types, sizes, sha256 of file
contents, symlink targets; symlinks are not followed). ``assert_unchanged(before, after,
allowed)`` fails naming every entry added, removed or changed, except those ``allowed``
(a predicate on the path relative to ``root``); :func:`tqtx_own` builds the predicate for
"the dump itself and its lock and journal files".

Importable from any test (``tests/`` is on ``sys.path`` through the rootdir conftest):
``from treehash import snapshot, assert_unchanged, tqtx_own``.
"""
from __future__ import annotations

import hashlib
import os
import stat
from typing import Callable

Entry = tuple  # (type, size, digest or link target)


def _entry(path: str) -> Entry:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", 0, os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("dir", 0, "")
    if stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return ("file", st.st_size, h.hexdigest())
    return ("other", st.st_size, oct(stat.S_IFMT(st.st_mode)))


def snapshot(root: str | os.PathLike) -> dict[str, Entry]:
    """``{relative path: (type, size, sha256 | link target)}`` of everything below ``root``."""
    root = os.fspath(root)
    out: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinks
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = _entry(full)
    return out


def diff(before: dict[str, Entry], after: dict[str, Entry],
         allowed: Callable[[str], bool] = lambda rel: False) -> list[str]:
    """Human-readable differences between two snapshots, skipping ``allowed`` paths."""
    problems = []
    for rel in sorted(set(before) | set(after)):
        if allowed(rel):
            continue
        a, b = before.get(rel), after.get(rel)
        if a is None:
            problems.append(f"added {rel} {b[:2]}")
        elif b is None:
            problems.append(f"removed {rel} {a[:2]}")
        elif a != b:
            problems.append(f"changed {rel}: {a[:2]} -> {b[:2]}")
    return problems


def assert_unchanged(before: dict[str, Entry], after: dict[str, Entry],
                     allowed: Callable[[str], bool] = lambda rel: False) -> None:
    """Fail naming every entry that was added, removed or changed (unless ``allowed``)."""
    problems = diff(before, after, allowed)
    assert not problems, "files that are not tqtx's changed:\n  " + "\n  ".join(problems)


def tqtx_own(root: str | os.PathLike, *dumps: str | os.PathLike,
             dump_may_change: bool = True) -> Callable[[str], bool]:
    """Predicate: ``rel`` (relative to ``root``) is one of ``dumps`` or inside it, or its
    lock or journal file (``.lock``, ``.journal.sqlite``, ``-journal``, ``.migrate.lock``).
    With ``dump_may_change=False`` only the lock and journal files (a load reads the dump
    and must leave it byte-identical). ``.old`` and ``.tmp-*`` are deliberately not
    allowed: after a finished publication they must be gone, and a user's must be
    untouched."""
    names = set()
    for d in dumps:
        rel = os.path.relpath(os.path.abspath(d), os.path.abspath(root))
        names |= {rel + ".lock", rel + ".journal.sqlite", rel + ".journal.sqlite-journal",
                  rel + ".journal.sqlite.migrate.lock"}
        if dump_may_change:
            names.add(rel)

    def allowed(rel: str) -> bool:
        return any(rel == n or rel.startswith(n + os.sep) for n in names)
    return allowed
