"""Group commit of the metadata journal (durability sync, tqtx.controller.group_commit): a
request that journaled a change is answered only after a durable cut covers it, and the
requests read in one turn of the loop share that cut."""
from __future__ import annotations

import threading
import time

import pytest

from tqtx.controller.group_commit import GroupCommit
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.meta import MetaChange, MetaJournal
from tqtx.wire.peer import Peer
from tqtx.wire.rpc import Server


def test_requests_of_one_turn_share_one_cut_and_are_answered_after_it(tmp_path):
    with ControllerJournal(tmp_path / "state") as cj:
        mj = MetaJournal(cj.engine, "sync", 1.0)
        assert mj.group_commits and not mj.cuts_wanted
        server = Server("controller")
        group = GroupCommit(server, mj)
        seen = []  # per request: the cuts made when its handler ran

        def write(body, req):
            mj.write(MetaChange(rows=[("p", f"k{body['i']}", body["i"], frozenset({"x"}), {},
                                       None, (1 << 40) + body["i"])]))
            seen.append(mj.cuts)
            return {"i": body["i"]}

        server.add("W", group.wrap(write), mutating=True)
        server.add("R", lambda body, req: {"cuts": mj.cuts}, mutating=True)  # writes nothing
        peers = [Peer(server.address, f"client {i}", timeout=10) for i in range(5)]
        try:
            pending = [p.start("W", {"i": i}) for i, p in enumerate(peers)]
            time.sleep(0.3)  # all five wait in the server's queue: one turn reads them
            loop = threading.Thread(target=server.serve_forever, args=(20,), daemon=True)
            loop.start()
            assert [p.wait(10) for p in pending] == [{"i": i} for i in range(5)]
            assert seen == [0] * 5 and mj.cuts == 1   # answered after the one shared cut
            assert not mj.dirty
            assert peers[0].call("R", {}) == {"cuts": 1}  # nothing to make durable: no cut
            assert mj.cuts == 1

            def failing_cut():
                raise OSError(28, "No space left on device")
            mj.cut = failing_cut  # the reply waits for the cut, so it carries its error
            with pytest.raises(OSError, match="No space left"):
                peers[1].call("W", {"i": 7})
        finally:
            server.stop()
            for p in peers:
                p.close()
            loop.join(10)
            mj.close()


def test_a_read_in_the_turn_of_a_write_is_answered_after_the_cut(tmp_path):
    """A read handled after a commit of its turn may have seen that commit: its reply waits
    for the cut too, so no key it was shown can vanish in a power loss (nor a cleared one
    come back). In a turn with nothing to make durable a read is answered at once."""
    from tqtx.wire.codec import decode
    with ControllerJournal(tmp_path / "state") as cj:
        mj = MetaJournal(cj.engine, "sync", 1.0)
        server = Server("controller")
        group = GroupCommit(server, mj)
        keys: set = set()
        order = []  # the loop's cuts and replies, in the order it made them

        def write(body, req):
            mj.write(MetaChange(rows=[("p", body["k"], 0, frozenset({"x"}), {}, None, 1)]))
            keys.add(body["k"])
            return {"wrote": body["k"]}

        def read(body, req):
            return {"seen": body["k"] in keys}

        cut, send = mj.cut, server._send

        def noted_cut():
            order.append("cut")
            return cut()

        def noted_send(ident, frames):
            order.append(sorted(decode(frames)["result"]))
            send(ident, frames)
        mj.cut, server._send = noted_cut, noted_send
        server.add("W", group.wrap(write), mutating=True)
        server.add("R", group.wrap(read), mutating=False)
        writer, reader = Peer(server.address, "writer", timeout=10), Peer(server.address,
                                                                            "reader", timeout=10)
        try:
            wrote = writer.start("W", {"k": "a"})
            time.sleep(0.2)  # the write first in the socket's queue
            seen = reader.start("R", {"k": "a"})
            time.sleep(0.3)  # both wait there: one turn reads them
            loop = threading.Thread(target=server.serve_forever, args=(20,), daemon=True)
            loop.start()
            assert wrote.wait(10) == {"wrote": "a"} and seen.wait(10) == {"seen": True}
            assert order == ["cut", ["wrote"], ["seen"]]
            order.clear()
            assert reader.call("R", {"k": "a"}) == {"seen": True}
            assert order == [["seen"]]  # nothing undurable: no cut, no wait
        finally:
            server.stop()
            writer.close()
            reader.close()
            loop.join(10)
            mj.close()


def test_a_sync_controller_holds_every_reply_of_a_turn_with_undurable_changes(tmp_path):
    """The controller wraps its reads in the group commit too: a LIST answered in a turn
    whose journal holds a change not yet durable is deferred to the turn's cut; in a clean
    turn it is answered at once."""
    import queue

    from tqtx.testing import InProcessDeployment
    from tqtx.wire.rpc import Deferred

    with InProcessDeployment(1, tmp_path / "state", durability="sync") as dep:
        ctl = dep.controller
        got: queue.Queue = queue.Queue()

        def on_loop():  # the journal's connection is the loop thread's
            try:
                ctl.server.current_ident = b"nobody"
                req = {"op": "LIST", "rid": "", "body": {}}
                lst = ctl.server.handlers["LIST"][0]
                clean = lst({}, req)
                ctl.kv.journal_meta("commit_put", MetaChange(markers={"probe": "1"}))
                got.put((type(clean), type(lst({}, req)), ctl.metajournal.dirty))
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                got.put(exc)
        ctl.server.call_soon(on_loop)
        assert got.get(timeout=10) == (dict, Deferred, True)
        assert dep.client.controller.call("LIST", {}) is not None  # the loop goes on
        assert not ctl.metajournal.dirty
