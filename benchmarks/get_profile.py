#!/usr/bin/env python
"""Where the time of one ``kv_batch_get`` of a rollout buffer goes.

    python benchmarks/get_profile.py [--units 4] [--mb 256] [--reps 5] [--cprofile N]

Puts the rollout buffer of ``benchmarks/get_throughput.py`` once, then times --reps gets
with timers wrapped around the client's phases (no change to the code measured):
controller LOOKUP round trip, GET_ROWS fan-out (the units' handler time from their
GET_STATS, the rest being transport + the client's decode of the reply), the client
placing rows into columns, the assembly of every field, and what is left (API checks).
Medians of --reps. ``--cprofile N`` also prints the N costliest functions of one get in
this (the client) process.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from get_throughput import MiB, payload_bytes, rollout_buffer  # noqa: E402

T = defaultdict(float)


def _timer(name, fn, key=None):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            T[key(*args, **kwargs) if key else name] += time.perf_counter() - t0
    return wrapped


def _op_seconds(ops: dict, op: str) -> float:
    """Total handler seconds of ``op`` from a GET_STATS ``ops`` map."""
    rec = ops.get(op) or {}
    return (rec.get("mean_ms") or 0.0) * rec.get("count", 0) / 1000.0


def _unit_seconds(client, op):
    stats = client.fan_out("GET_STATS", {u: {} for u in range(client.num_units)})
    return [_op_seconds(stats[u]["ops"], op) for u in sorted(stats)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cprofile", type=int, default=0)
    a = p.parse_args(argv)
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    import tqtx as tq
    from tqtx.client import client as cl, tensors
    from tqtx.wire import peer as rpc_peer

    keys, td, _rows = rollout_buffer(a.mb)
    nbytes = payload_bytes(td)
    state = tempfile.mkdtemp(prefix="getprof-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tq.init({"num_units": a.units, "state_dir": state})
    try:
        tq.kv_batch_put(keys, "prof", td)
        client = tq.get_client()
        rpc_peer.Peer.call = _timer("call", rpc_peer.Peer.call,
                                    key=lambda self, op, *a, **k: f"rpc {op}")
        rpc_peer.Peer._decode = _timer("client decode of replies", rpc_peer.Peer._decode)
        cl.Client.get_rows = _timer("Client.get_rows", cl.Client.get_rows)
        cl.Client.fan_out = _timer("fan_out", cl.Client.fan_out,
                                   key=lambda self, op, *a, **k: f"fan_out {op}")
        orig_assemble = tensors.assemble_column
        current = {}

        def assemble(values, schema):
            t0 = time.perf_counter()
            try:
                return orig_assemble(values, schema)
            finally:
                T[f"assemble {current.get('field')}"] += time.perf_counter() - t0
        tensors.assemble_column = assemble
        orig_tdfc = tensors.tensordict_from_columns

        def tdfc(columns, schemas, n, **kw):
            class Named(dict):  # names the field being assembled for the timer
                def items(self):
                    for f, v in dict.items(self):
                        current["field"] = f
                        yield f, v
            t0 = time.perf_counter()
            try:
                return orig_tdfc(Named(columns), schemas, n, **kw)
            finally:
                T["tensordict_from_columns"] += time.perf_counter() - t0
        tensors.tensordict_from_columns = tdfc
        per_rep = []
        for rep in range(a.reps + 1):
            T.clear()
            ctl0 = _op_seconds(client.controller.call("GET_STATS")["ops"], "LOOKUP")
            units0 = _unit_seconds(client, "GET_ROWS")
            T.clear()
            t0 = time.perf_counter()
            out = tq.kv_batch_get(keys, "prof")
            total = time.perf_counter() - t0
            ctl1 = _op_seconds(client.controller.call("GET_STATS")["ops"], "LOOKUP")
            units1 = _unit_seconds(client, "GET_ROWS")
            r = dict(T)
            r["total"] = total
            r["controller LOOKUP handler"] = ctl1 - ctl0
            r["unit GET_ROWS handler (slowest unit)"] = max(b - a_ for a_, b in zip(units0, units1))
            del out
            if rep:  # the first get opens connections
                per_rep.append(r)
        med = {k: statistics.median(r.get(k, 0.0) for r in per_rep) for k in per_rep[0]}
        lookup = med.get("rpc LOOKUP", 0.0)
        fan = med.get("fan_out GET_ROWS", 0.0)
        unit = med["unit GET_ROWS handler (slowest unit)"]
        dec = med.get("client decode of replies", 0.0)
        rows = med["Client.get_rows"]
        asm = med["tensordict_from_columns"]
        lines = [
            ("controller LOOKUP round trip", lookup),
            ("  of which the controller's handler", med["controller LOOKUP handler"]),
            ("GET_ROWS fan-out (wait for all units)", fan),
            ("  slowest unit's handler (lookup rows, pack or write the columns, encode)", unit),
            ("  client decode of the replies", dec),
            ("  transport and waiting (rest)", max(0.0, fan - unit - dec)),
            ("client: rows into columns (unpack_column + placement)", rows - lookup - fan),
            ("client: assembly (tensordict_from_columns)", asm),
        ] + [(f"  {k[len('assemble '):]}", v) for k, v in med.items() if k.startswith("assemble ")] + [
            ("API checks and the rest", med["total"] - rows - asm),
            ("total kv_batch_get", med["total"]),
        ]
        print(f"kv_batch_get of {len(keys)} rows, {nbytes / MiB:.0f} MiB, {a.units} units, "
              f"median of {a.reps} (after one warm-up get): {nbytes / med['total'] / 1e9:.2f} GB/s")
        print("phase | seconds | share")
        print("--- | --- | ---")
        for name, s in lines:
            print(f"{name} | {s:.4f} | {s / med['total'] * 100:.0f}%")
        if a.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            tq.kv_batch_get(keys, "prof")
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)
    finally:
        tq.close()
        import shutil
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
