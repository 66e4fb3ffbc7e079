"""The client: orchestration between the controller (metadata) and the units (payload)."""
from __future__ import annotations

import os
import threading
import time

from .. import faults, routing
from . import get_path, put_path
from ..errors import ControllerRecoveringError, PeerDiedError, PeerTimeoutError, \
    StaleRowsError, TqtxError
from ..wire import shm
from ..wire.peer import CONNECT_TIMEOUT, Peer, call_many
from ..wire.rpc import DEFAULT_TIMEOUT, new_id
from ..wire.columns import unpack_int64
from ..wire.columns import unpack_column  # noqa: F401  (re-exported)
from .get_path import Column  # noqa: F401  (re-exported)
from .lease import PutLease
from .kvmeta import KVBatchMeta  # noqa: F401  (TransferQueue's class; re-exported)


# Unit requests that may be sent again, to a unit's new address, after it died.
IDEMPOTENT_UNIT_OPS = frozenset({"GET_ROWS", "GET_INTO", "GET_STATS", "STATS", "PING"})
CONTROLLER_HINT = ("Restart the controller (or the whole deployment); a dump or restore it "
                   "was running is settled by the next access or tqtx.recover_data_load(dump_dir)")

# How long a client waits for a controller that went away to answer again (same address).
RECONNECT_TIMEOUT = float(os.environ.get("TQTX_RECONNECT_TIMEOUT", "30"))
# Only a controller found gone is waited for: one that is alive but slow (a timeout)
# is reported as before.
_CONTROLLER_LOST = (PeerDiedError,)


class _ControllerPeer(Peer):
    """The controller connection: a reply carrying a new topology incarnation makes the
    client refresh its unit addresses before it talks to any unit."""

    def __init__(self, client: "Client", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._client = client

    def call(self, op, body=None, **kwargs):
        try:
            result = super().call(op, body, **kwargs)
        except ControllerRecoveringError:
            # A restarted controller holds new rows back until its units re-registered; the
            # request did nothing, so it is sent again (a new ID) once they have.
            self._client.await_controller(f"waiting to send {op}")
            kwargs.pop("rid", None)
            result = super().call(op, body, **kwargs)
        if op != "TOPOLOGY" and isinstance(result, dict) and "topology" in result:
            self._client.follow_topology(result["topology"])
        return result


class Client:
    """Talks to one deployment. Thread-safe: every thread gets its own sockets.

    Unit addresses follow the controller's topology incarnation: a new one seen in a
    reply (or a unit found dead) refreshes them, and every thread's unit connections
    are replaced (``unit_generation``).

    A controller that goes away (killed, restarted on the same address) is waited for up
    to ``reconnect_timeout`` seconds (``$TQTX_RECONNECT_TIMEOUT``, 30): read-only and
    idempotent requests are then sent once more, a put is finished by request ID or
    redone once from ALLOC (see :meth:`put_columns`).
    """

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT, deployment=None,
                 curve=None, wait_ready: float = 60.0, reconnect_timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self.reconnect_timeout = (RECONNECT_TIMEOUT if reconnect_timeout is None
                                  else float(reconnect_timeout))
        self.deployment = deployment
        self.curve = curve
        self._local = threading.local()
        self._all_peers: list[Peer] = []
        self._peers_lock = threading.Lock()
        self._topology_lock = threading.Lock()
        self._inbox: shm.GetInbox | None = None
        self._closed = False  # close() was called: no thread waits for the controller on
        self.lease = PutLease()  # indexes for small puts of new keys (client/lease.py)
        self._inbox_tried = False
        self.into_off: str | None = None  # why same-host gets do not copy into this process
        self.into_checked = False  # whether into_usable() looked at the platform yet
        self.unsettled_results: list = []  # buffers of failed GET_INTOs and same-host puts
        self.put_from_off: str | None = None  # why same-host puts send frames (put_from)
        self.put_from_checked = False
        self.put_from_refused: dict[int, str] = {}  # units that could not read this process
        self.unit_generation = 0  # bumped when unit addresses change
        # client-side totals: calls, rows and bytes per kind (see client_stats)
        self.counters = {k: {"calls": 0, "rows": 0, "bytes": 0}
                         for k in ("puts", "gets", "dumps", "restores")}
        self._counters_lock = threading.Lock()
        from ..metrics import ENABLED as counting
        self._counting = counting  # TQTX_METRICS=0 turns these off too
        deadline = time.monotonic() + wait_ready
        while True:
            topo = self.controller.call("TOPOLOGY", timeout=min(timeout, wait_ready))
            if topo["ready"]:
                break
            if time.monotonic() > deadline:
                raise TqtxError(f"deployment at {address}: only "
                                f"{sum(1 for u in topo['units'] if u)} of {topo['num_units']} "
                                f"units registered within {wait_ready:.0f}s")
            time.sleep(0.05)
        self.topology = topo
        self.num_units = topo["num_units"]
        self.unit_addresses = topo["units"]
        self.topology_incarnation = topo.get("topology")

    # ---------------------------------------------------------------- peers
    def _liveness(self, name):
        return self.deployment.liveness(name) if self.deployment is not None else None

    def _new_peer(self, address, name) -> Peer:
        if name == "controller":  # no connect timeout: a client may attach before it listens
            p = _ControllerPeer(self, address, name, timeout=self.timeout,
                                liveness=self._liveness(name), curve=self.curve,
                                hint=CONTROLLER_HINT)
        else:
            label = getattr(self.deployment, "peer_name", None)  # e.g. "unit 1 (node ...)"
            p = Peer(address, label(name) if label else name, timeout=self.timeout,
                     liveness=self._liveness(name),
                     curve=self.curve, connect_timeout=CONNECT_TIMEOUT)
        with self._peers_lock:
            self._all_peers.append(p)
        return p

    @property
    def controller(self) -> Peer:
        p = getattr(self._local, "controller", None)
        if p is None:
            p = self._local.controller = self._new_peer(self.address, "controller")
        return p

    def unit(self, uid: int) -> Peer:
        local = self._local
        units = getattr(local, "units", None)
        if units is None or getattr(local, "generation", None) != self.unit_generation:
            for old in (units or {}).values():
                old.close()  # addresses changed since this thread connected
            local.generation = self.unit_generation
            units = local.units = {}
        p = units.get(uid)
        if p is None:
            p = units[uid] = self._new_peer(self.unit_addresses[uid], f"unit {uid}")
        return p

    def refresh_topology(self) -> None:
        """Ask the controller for the unit addresses; connections to moved units are
        replaced in every thread."""
        self._adopt_topology(self.controller.call("TOPOLOGY"))

    def _adopt_topology(self, topo: dict) -> None:
        with self._topology_lock:
            units = topo["units"]
            if not topo.get("ready"):
                # A restarted controller before every unit re-registered: keep the known
                # addresses of the others, and look again at the next new incarnation.
                units = [new or old for new, old in zip(units, self.unit_addresses)]
            if units != self.unit_addresses:
                self.unit_addresses = units
                self.unit_generation += 1
            if topo.get("ready"):
                self.topology_incarnation = topo.get("topology")
                self.topology = topo

    @property
    def controller_incarnation(self) -> int | None:
        """The incarnation of the controller this client last followed (high 32 bits of
        the topology incarnation)."""
        topo = self.topology_incarnation
        return None if topo is None else topo >> 32

    def await_controller(self, what: str, *, outcome: str = "") -> dict:
        """Wait for the controller after a call to it found it gone (its connection
        closed, its process exited): reset this thread's connection and ask TOPOLOGY until it answers
        with every unit registered, at most ``reconnect_timeout`` seconds; then follow its
        topology and return it. Otherwise raise PeerDiedError naming the address, the
        bound, ``what`` was being done and ``outcome`` (what that means for the call)."""
        ctl = self.controller
        ctl.reset()
        bound = self.reconnect_timeout
        deadline = time.monotonic() + bound
        why = "it did not answer"
        tail = f"; {outcome}" if outcome else ""
        final = getattr(self.deployment, "creator_gone", None)  # tqtx.deploy.owner: nothing restarts it
        while True:
            if final is not None and final():
                raise PeerDiedError(f"the controller at {self.address} is gone for good "
                                    f"({final()}) while {what}{tail}")
            if self._closed:  # another thread closed this client (the job is ending)
                raise PeerDiedError(f"the controller at {self.address} went away and this "
                                    f"client was closed while {what}{tail}")
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                topo = ctl.call("TOPOLOGY", timeout=max(0.1, min(left, 2.0)))
            except (PeerDiedError, PeerTimeoutError) as exc:  # the peer reset itself
                why = str(exc)
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                continue
            except Exception:
                if self._closed:  # close() closed the socket under the call: said above
                    continue
                raise
            if topo.get("ready"):
                self._adopt_topology(topo)
                return topo
            why = (f"it answers, but only {sum(1 for u in topo['units'] if u)} of "
                   f"{topo['num_units']} units re-registered")
            time.sleep(0.05)
        raise PeerDiedError(f"the controller at {self.address} did not come back within "
                            f"{bound:g}s ({why}) while {what}{tail}")

    def call_controller(self, op: str, body: dict | None = None, *, what: str,
                        outcome: str = "nothing was changed"):
        """Send a read-only or idempotent controller request; if the controller went away,
        wait for it (:meth:`await_controller`) and send it once more, with the same request
        ID (a controller that recorded the first copy answers with its outcome)."""
        rid = new_id()
        try:
            return self.controller.call(op, body, rid=rid)
        except _CONTROLLER_LOST:
            self.await_controller(what, outcome=outcome)
        return self.controller.call(op, body, rid=rid)

    def controller_watch(self, what: str):
        """A ``call_many`` watch for a wait on units that only the controller can conclude:
        raises PeerDiedError once this thread's controller connection closed (its process
        exited or restarted) or its process exited; the message ends with ``what``."""
        ctl = self.controller

        def watch() -> None:
            why = ctl.gone()
            if why:
                ctl.reset()
                raise PeerDiedError(f"the controller at {self.address} is gone ({why}) "
                                    f"while {what}")
        return watch

    def follow_topology(self, incarnation) -> None:
        """Refresh the unit addresses if ``incarnation`` (from a controller reply) is new."""
        if incarnation is not None and incarnation != self.topology_incarnation:
            self.refresh_topology()

    def received_from_units(self) -> dict:
        """Frames and bytes received from units so far (headers counted separately)."""
        peers = [p for p in self._all_peers if p.name.startswith("unit")]
        return {"payload_frames": sum(p.frames_received for p in peers),
                "payload_bytes": sum(p.bytes_received for p in peers),
                "header_bytes": sum(p.header_bytes_received for p in peers)}

    def close(self) -> None:
        self._closed = True
        with self._peers_lock:
            for p in self._all_peers:
                p.close()
            self._all_peers.clear()
            inbox, self._inbox = self._inbox, None
        self._local = threading.local()
        if inbox is not None:
            inbox.close()

    # ---------------------------------------------------------------- routing
    def owner(self, index: int) -> int:
        """Routing: a pure function of the global index and the ordered unit list."""
        return routing.owner(index, self.num_units)

    def fan_out(self, op: str, per_unit: dict[int, dict], timeout: float | None = None, *,
                after_send=None) -> dict:
        """One request per unit, all at once; waits for every unit, then raises the first error.

        A unit that is dead or silent makes the client re-read the topology; an idempotent
        request is sent once more to a unit that re-registered at a new address.
        ``after_send``: the caller's work while the units work (see :func:`call_many`).
        """
        uids = sorted(per_unit)
        results = call_many([(self.unit(u), op, per_unit[u]) for u in uids], timeout=timeout,
                            raise_first=False, after_send=after_send)
        lost = [i for i, r in enumerate(results)
                if isinstance(r, (PeerDiedError, PeerTimeoutError))]
        if lost:
            before = list(self.unit_addresses)
            try:
                self.refresh_topology()
            except TqtxError:
                pass  # the controller is unreachable too: report the unit's error
            moved = [i for i in lost if self.unit_addresses[uids[i]] != before[uids[i]]]
            if moved and op in IDEMPOTENT_UNIT_OPS:
                again = call_many([(self.unit(uids[i]), op, per_unit[uids[i]]) for i in moved],
                                  timeout=timeout, raise_first=False)
                for i, r in zip(moved, again):
                    results[i] = r
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # A stale row is raised only when no unit failed otherwise: the caller then
            # knows every unit has answered (and retries the request).
            raise next((e for e in errors if not isinstance(e, StaleRowsError)), errors[0])
        return dict(zip(uids, results))

    # ---------------------------------------------------------------- kv
    def drop_rows(self, rows) -> None:
        """DROP_ROWS of ``(index, generation)`` pairs on their units."""
        rows = list(rows)
        per_unit = {u: {"indexes": [rows[p][0] for p in pos], "gens": [rows[p][1] for p in pos]}
                    for u, pos in routing.by_owner([i for i, _ in rows], self.num_units).items()}
        if per_unit:
            self.fan_out("DROP_ROWS", per_unit)

    # ---------------------------------------------------------------- the row paths
    def put_columns(self, keys: list[str], pid: str, columns: dict[str, list],
                    schemas: dict[str, dict], tags: list | None, *, with_tags: bool = False):
        """Store rows for ``keys``; returns the common fields, with ``with_tags`` also the
        keys' tags as stored now: ``(fields, tags)`` (:func:`tqtx.client.put_path.put_columns`)."""
        return put_path.put_columns(self, keys, pid, columns, schemas, tags,
                                    with_tags=with_tags)

    def get_rows(self, keys: list[str], pid: str, select_fields=None, *, lenient=False,
                 direct=False, alloc=None):
        """(keys found, columns, schemas) in request order (:func:`tqtx.client.get_path.get_rows`)."""
        return get_path.get_rows(self, keys, pid, select_fields, lenient=lenient,
                                 direct=direct, alloc=alloc)

    reply_files = staticmethod(get_path.reply_files)

    def get_columns(self, keys: list[str], pid: str, select_fields=None):
        """Fetch rows in request order: returns (columns, schemas)."""
        _, columns, schemas = self.get_rows(keys, pid, select_fields)
        return columns, schemas

    def reply_inbox(self) -> "shm.GetInbox | None":
        """This client's same-host probe directory (made on first use), or None if there
        is no RAM file system to make it in (``TQTX_SHM_DIR``)."""
        with self._peers_lock:
            if self._inbox is not None and self._inbox.pid != os.getpid():
                self._inbox_tried = False  # a forked child makes an inbox of its own
            if not self._inbox_tried:
                self._inbox_tried = True
                root = shm.default_root()
                try:
                    self._inbox = shm.GetInbox(root) if root else None
                except OSError:
                    self._inbox = None
            return self._inbox

    def list_keys(self, pid=None, *, decode: bool = False) -> dict:
        """``{partition: {key: tag}}``, each key's tag its own dict; with ``decode``, as
        :func:`tqtx.client.tags.decode_tag` gives it (tensors decoded; nested values
        copied), else as received (nested values of equal tags may be shared). Asked
        columnar: each distinct tag travels and is examined once (a controller that does
        not know the flag answers with the plain mapping)."""
        from .tags import decode_tag
        from .tensors import decode_object
        res = self.call_controller("LIST", {"partition_id": pid, "columnar": True},
                                   what="listing keys")
        if res.get("columnar") is not True:
            return {part: {k: decode_tag(t) for k, t in keys.items()}
                    for part, keys in res.items()} if decode else res
        out = {}
        for part, cols in res["partitions"].items():
            tags = cols["tags"]
            copy = [decode_object if decode and decode_tag(t) is not t else dict for t in tags]
            out[part] = dict(zip(cols["keys"], [copy[i](tags[i])
                                                for i in unpack_int64(cols["tag_of"])]))
        return out

    def clear(self, keys: list[str], pid: str) -> int:
        self.lease.forget(pid, keys)  # a put of them again creates them: the lease fits
        res = self.call_controller(
            "CLEAR", {"partition_id": pid, "keys": keys},
            what=f"clearing {len(keys)} key(s) of partition {pid!r}",
            outcome="the keys may or may not be cleared: kv_clear them again (it is idempotent)")
        freed = res["freed"]
        faults.hit("client.clear.before_drop")
        self.drop_rows(zip(freed, res["gens"]))
        return len(freed)

    def count(self, kind: str, rows: int = 0, nbytes: int = 0) -> None:
        """Add one call of ``kind`` (puts, gets, dumps, restores) to the client totals."""
        if not self._counting:
            return
        with self._counters_lock:
            c = self.counters[kind]
            c["calls"] += 1
            c["rows"] += rows
            c["bytes"] += nbytes

    def client_stats(self) -> dict:
        """This client's totals: ``{kind: {calls, rows, bytes}}`` plus pid and address."""
        import os
        with self._counters_lock:
            counts = {k: dict(v) for k, v in self.counters.items()}
        return {"role": "client", "pid": os.getpid(), "address": self.address, **counts}

    def stats(self) -> dict:
        """GET_STATS of the controller and every unit, plus this client's totals."""
        out = {"controller": self.call_controller("GET_STATS", what="reading its stats")}
        replies = self.fan_out("GET_STATS", {u: {} for u in range(self.num_units)})
        out["units"] = [replies[u] for u in range(self.num_units)]
        out["client"] = self.client_stats()
        return out
