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
