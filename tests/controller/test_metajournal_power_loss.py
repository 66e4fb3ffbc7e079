"""A power loss under the controller's metadata journal (tqtx.journal.meta): what survives is
what the durability setting promised.

SQLite fsyncs inside C, so its fsyncs cannot be recorded as tests/storage/test_rowlog.py
does. Instead the durable image of the journal (the db file and its -wal) is taken right
after each MetaJournal.cut returns: the cut fsyncs the WAL, which holds every commit since
the last checkpoint; the db file changes only in checkpoints, which fsync it before they
end (nothing here holds a read snapshot, so each one ends). The
-shm is no part of an image: SQLite rebuilds it from the WAL. A power loss is played by
writing an image -- or the WAL of a later moment, torn -- into a new state dir and opening a
new journal there, as a restarted controller does (the live connections stay untouched).
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import pytest

from tqtx.controller.group_commit import GroupCommit
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.meta import MetaChange, MetaJournal
from tqtx.wire import codec
from tqtx.wire.rpc import Server

_CUT_AFTER = {2, 3, 9, 16, 17, 25, 33}  # irregular; 3 after 2: a cut covering one commit
_WAL_HEADER, _FRAME_HEADER = 32, 24


def _change(i: int) -> MetaChange:
    """Transaction i touches every metadata table: keys (upserts, a delete every 4th), schemas,
    the next index counter, markers, blobs (every 5th over several pages: a torn WAL can end
    inside it) and the answered requests; partition "tmp" comes and is dropped again."""
    pid = f"p{i % 3}"
    tag = {"i": i} if i % 2 else {}
    change = MetaChange(
        rows=[(pid, f"k{i}.{j}", 4 * i + j, frozenset({"x", f"y{j}"}), tag,
               1 if j == 1 and i % 3 == 0 else None, (1 << 40) + i) for j in range(3)],
        schemas=[(pid, "x", {"dtype": "int64", "shape": [i % 5]})],
        next_index=4 * i + 4, markers={"step": i},
        blobs={f"b{i % 4}": bytes([i]) * (20_000 if i % 5 == 4 else 64)},
        answered=(f"req{i}", codec.packb({"i": i})))
    if i % 4 == 3:
        change.deleted.append((f"p{(i - 1) % 3}", f"k{i - 1}.0"))
    if i % 7 == 3:
        change.rows.append(("tmp", f"t{i}", 4 * i + 3, frozenset({"z"}), {}, None, 1))
        change.schemas.append(("tmp", "z", {"dtype": "float32"}))
    elif i % 7 == 6:
        change.deleted.append(("tmp", f"t{i - 3}"))
        change.dropped.append("tmp")
    return change


class _Recorder:
    """The live journal, the state after every commit (``states``, ``states[0]`` as opened)
    and ``images``: per cut (and one at opening: the migrations committed under FULL) the db
    file, the WAL, the index of its state, and ``crash``: the WAL and -shm of the latest
    moment before the next cut (or the end) with the index of the state then."""

    def __init__(self, cj: ControllerJournal):
        self.cj, self.path, self.states, self.images = cj, str(cj.path), [], []

    def open(self, durability: str) -> MetaJournal:
        self.durability, self.mj = durability, MetaJournal(self.cj.engine, durability)
        self.states.append(self.mj.load())
        self.crash(image=True)
        return self.mj

    def files(self) -> list[bytes]:
        return [Path(self.path + s).read_bytes() if os.path.exists(self.path + s) else b""
                for s in ("", "-wal", "-shm")]

    def crash(self, image: bool = False) -> None:
        """Now is the latest image's crash moment; ``image``: right after a cut, a new one."""
        db, wal, shm = self.files()
        if image:
            self.images.append({"db": db, "wal": wal, "at": len(self.states) - 1})
        self.images[-1]["crash"] = (wal, shm, len(self.states) - 1)

    def commit(self, change: MetaChange) -> None:
        self.mj.write(change)
        self.states.append(self.mj.load())


@pytest.fixture
def rec(tmp_path, monkeypatch):
    real_cut = MetaJournal.cut

    def cut(mj):  # every cut, also GroupCommit's
        rec.crash()  # the WAL a power loss just before this cut would find
        done = real_cut(mj)
        if done:  # a cut changes nothing: its image is of the last commit's state
            rec.crash(image=True)
        return done

    monkeypatch.setattr(MetaJournal, "cut", cut)
    with ControllerJournal(tmp_path / "state") as cj:
        rec = _Recorder(cj)
        yield rec
        rec.mj.close()


def _recover(tmp_path, db: bytes, wal: bytes, shm: bytes, durability: str) -> dict:
    """What a controller restarted on these files loads (no -shm unless ``shm``)."""
    where = Path(tempfile.mkdtemp(dir=tmp_path))
    for suffix, data in (("", db), ("-wal", wal), ("-shm", shm)):
        if data:
            (where / f"journal.sqlite{suffix}").write_bytes(data)
    try:
        with ControllerJournal(where) as cj, closing(MetaJournal(cj.engine, durability)) as mj:
            return mj.load()
    finally:
        shutil.rmtree(where)


def _generation(wal: bytes, size: int) -> list[int]:
    """Offsets of the frames (of ``size`` bytes) of the WAL's current generation: those that
    carry its header's salts. A restarted WAL keeps older frames past its end."""
    offs = range(_WAL_HEADER, len(wal) - size + 1, size)
    return list(itertools.takewhile(lambda o: wal[o + 8:o + 16] == wal[16:24], offs))


def _check_cuts(rec: _Recorder, tmp_path) -> None:
    """Power loss right after each cut: its image gives exactly the state of the cut, with no
    -shm and with the stale -shm of the crash moment (which describes later frames)."""
    for image in rec.images:
        for shm in (b"", image["crash"][1]):
            got = _recover(tmp_path, image["db"], image["wal"], shm, rec.durability)
            assert got == rec.states[image["at"]], f"image at state {image['at']}"


def _check_torn(rec: _Recorder, tmp_path) -> list[tuple[int, int, int, bool]]:
    """Power loss keeping part of what followed a cut: the crash moment's WAL torn at seeded
    lengths from the image's end on (past the tear: the image's bytes, e.g. frames of an older
    generation), some with a byte flipped past the image. The load must give the state after
    the last transaction wholly before the tear and the flip: never half, never before the
    cut. Images whose WAL a checkpoint restarted by the crash are left out (the db changed
    too). Per variant: (cut state, recovered state, last state, older frames followed?)."""
    played = []
    for k, image in enumerate(rec.images):
        base, at = image["wal"], image["at"]
        crash, _shm, last = image["crash"]
        size = _FRAME_HEADER + int.from_bytes(base[8:12], "big")
        valid = _WAL_HEADER + size * len(_generation(base, size))
        if len(base) < _WAL_HEADER or crash[:valid] != base[:valid]:
            continue
        ends = [o + size for o in _generation(crash, size)
                if int.from_bytes(crash[o + 4:o + 8], "big")]  # db size set: a commit frame
        rng = random.Random(k)
        lengths = {valid, len(crash)} | {rng.randint(valid, len(crash)) for _ in range(3)}
        for n in sorted(lengths):
            for flip in [None] + ([rng.randrange(valid, n)] if n > valid else []):
                wal, end = bytearray(crash[:n] + base[n:]), n
                if flip is not None:
                    wal[flip] ^= 0xFF  # this frame fails its checksum: it and all after it go
                    end = flip - (flip - _WAL_HEADER) % size
                want = at + sum(valid < e <= end for e in ends)
                assert at <= want <= last
                got = _recover(tmp_path, image["db"], bytes(wal), b"", rec.durability)
                assert got == rec.states[want], f"cut {at}, WAL {n} bytes, flip {flip}"
                played.append((at, want, last, len(base) > valid))
    return played


def _buffer_run(rec: _Recorder, checkpoints: bool = False) -> MetaJournal:
    mj = rec.open("buffer")
    if checkpoints:  # what SQLite does at 1000 pages, at 128 (a transaction: ~10 pages)
        mj._db.execute("PRAGMA wal_autocheckpoint=128")
    for i in range(40):
        rec.commit(_change(i))
        if checkpoints and i == 20:  # and one that empties the WAL, between two cuts
            assert mj._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        if i in _CUT_AFTER:
            assert mj.cut()
    rec.crash()  # the power goes 6 commits after the last cut
    assert len(rec.images) == 1 + len(_CUT_AFTER) and mj.cuts == len(_CUT_AFTER)
    # each state differs from the one before: equal states name one transaction
    assert all(a != b for a, b in zip(rec.states, rec.states[1:]))
    return mj


def test_buffer_power_loss_after_a_cut_keeps_exactly_the_cut(rec, tmp_path):
    _buffer_run(rec)
    _check_cuts(rec, tmp_path)
    # nothing after the cut came back: the last cut's state has no key of the later commits
    last = rec.states[rec.images[-1]["at"]]
    assert last["next_index"] == 4 * 33 + 4 and last["answered"][-1][0] == "req33"


def test_buffer_torn_tails_recover_whole_transactions_from_the_cut_on(rec, tmp_path):
    _buffer_run(rec)
    # no checkpoint ran (the WAL stays under 1000 pages): every cut can be torn after
    assert all(i["crash"][0].startswith(i["wal"]) for i in rec.images)
    played = _check_torn(rec, tmp_path)
    assert {p[0] for p in played} == {i["at"] for i in rec.images}
    # the variants cover a loss of everything after the cut, a partial and a complete tail
    assert any(at == want < last for at, want, last, _ in played)
    assert any(at < want < last for at, want, last, _ in played)
    assert any(at < want == last for at, want, last, _ in played)


def test_checkpoints_between_cuts_keep_each_cut(rec, tmp_path):
    _buffer_run(rec, checkpoints=True)
    images = rec.images
    # checkpoints rewrote the db file between cuts, and restarted the WAL after some cut
    assert any(a["db"] != b["db"] for a, b in zip(images, images[1:]))
    assert any(not i["crash"][0].startswith(i["wal"]) for i in images)
    _check_cuts(rec, tmp_path)
    # where the WAL was not restarted since the cut, torn tails still hold, also over the
    # frames an earlier generation left past the image's (their salts tell them apart)
    played = _check_torn(rec, tmp_path)
    assert any(stale and at < want for at, want, _, stale in played)


def test_sync_answers_a_request_only_once_a_power_loss_keeps_it(rec, tmp_path):
    mj = rec.open("sync")
    # what GroupCommit uses of tqtx.wire.rpc.Server, turns played by hand; a reply records
    # when it was sent: how many durable images existed then
    sent: list = []
    server = SimpleNamespace(turn_hooks=[], current_ident=b"client", deferred=(
        lambda req, ident: SimpleNamespace(reply_on_loop=lambda result=None, error=None:
                                           sent.append((req, result, error, len(rec.images))))))
    server.hold = lambda req, reply, until: Server.hold(server, req, reply, until)
    group = GroupCommit(server, mj)

    def put(i, req):
        rec.commit(_change(i))
        return {"state": len(rec.states) - 1}
    handler, i = group.wrap(put), 0
    for turn, requests in enumerate([1, 3, 2, 4, 1, 2]):
        for _ in range(requests):
            assert not isinstance(handler(i, {"i": i}), dict)  # deferred to the turn's cut
            i += 1
        if turn < 5:  # the last turn never ends: the power goes before its cut
            for hook in server.turn_hooks:
                hook()
            assert mj.cuts == turn + 1 and len(sent) == i
    rec.crash()
    assert [req["i"] for req, *_ in sent] == list(range(11))  # the last 2 never answered
    for req, result, error, images in sent:
        assert error is None  # and the newest image then holds the request's commit
        assert rec.images[images - 1]["at"] >= result["state"]
    _check_cuts(rec, tmp_path)
    played = _check_torn(rec, tmp_path)
    assert any(at < want for at, want, _, _ in played)  # unanswered requests may survive too


def test_controller_setting_promises_a_process_crash_not_a_power_loss(rec, tmp_path):
    """"controller" never cuts: a process crash (the page cache survives, -shm included)
    loses nothing; after a power loss the test shows only that the journal opens on some
    prefix of the transactions, possibly none of them (only the FULL-synced migrations)."""
    mj = rec.open("controller")
    for i in range(12):
        rec.commit(_change(i))
    assert not mj.cut_due(1e12) and len(rec.images) == 1
    rec.crash()
    db, wal, shm = rec.files()
    assert _recover(tmp_path, db, wal, shm, "controller") == rec.states[-1]
    played = _check_torn(rec, tmp_path)
    assert {want == 0 for _, want, _, _ in played} == {True, False}
