#!/usr/bin/env python
"""Where a tiny op's time goes: the CPU each process spends per ``kv_put`` / ``kv_batch_get``
of one small row, against a bare pyzmq round trip in the same run.

    python benchmarks/tiny_cpu.py [--ops 3000] [--reps 3] [--durability controller]
                                  [--json P]

One client (this process), a deployment of one unit. Per op, for each process (its
threads summed, from ``/proc/<pid>/task/*/stat``): CPU time, and the client's main thread
apart from its ZeroMQ I/O threads; minor page faults per op (a heap that gives memory
back and faults it in again shows here); wall time. The floor: the same counters for a
bare pyzmq DEALER -> ROUTER echo of a 200-byte message between two processes, the
least a request costs on this machine before any tqtx code runs (a tiny op is two).
Medians of --reps repetitions of --ops ops each.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import warnings

TICK = os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process ``pid``."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            raw = open(f"/proc/{pid}/task/{tid}/stat").read()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        name = raw.split("(", 1)[1].rsplit(")", 1)[0]
        f = raw.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / TICK
    return out


def _faults(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


def _counters(pids: dict) -> dict:
    return {k: (_threads(p), _faults(p)) for k, p in pids.items()}


def _per_op(before: dict, after: dict, n: int) -> dict:
    out = {}
    for k in before:
        (t0, f0), (t1, f1) = before[k], after[k]
        out[f"{k} cpu us"] = (sum(t1.values()) - sum(t0.values())) / n * 1e6
        out[f"{k} faults"] = (f1 - f0) / n
        if k == "client":
            main = [name for name in t1 if not name.startswith("ZMQ")]
            out["client main us"] = sum(t1[m] - t0.get(m, 0.0) for m in main) / n * 1e6
    return out


def _echo(address: str) -> None:
    import zmq
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        msg = sock.recv_multipart(copy=False)
        sock.send_multipart(msg, copy=False)


def zmq_floor(ops: int) -> dict:
    """Per round trip of a bare pyzmq echo: wall time and each side's CPU."""
    import zmq
    ctx = mp.get_context("spawn")
    address = "tcp://127.0.0.1:%d" % _free_port()  # tqtx's transport
    server = ctx.Process(target=_echo, args=(address,), daemon=True)
    server.start()
    try:
        sock = zmq.Context().socket(zmq.DEALER)
        sock.connect(address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        msg = b"x" * 200
        for _ in range(200):  # connected and warm
            sock.send(msg)
            poller.poll(10_000)
            sock.recv()
        pids = {"client": os.getpid(), "server": server.pid}
        before, t0 = _counters(pids), time.perf_counter()
        for _ in range(ops):
            sock.send(msg, copy=False)
            poller.poll(10_000)
            sock.recv(copy=False)
        wall = (time.perf_counter() - t0) / ops * 1e6
        out = _per_op(before, _counters(pids), ops)
        sock.close(linger=0)
    finally:
        server.terminate()
        server.join(10)
    return {"wall us": wall, **out}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_ops(ops: int, reps: int, durability: str) -> dict:
    import torch

    import tqtx as tq
    from tqtx.cli.stats import gather
    results: dict = {"put": [], "get": []}
    with tempfile.TemporaryDirectory(prefix="tqtx-tinycpu-") as state:
        tq.init({"num_units": 1, "state_dir": state, "durability": durability})
        try:
            stats = gather(tq.get_client().address)
            pids = {"client": os.getpid(), "controller": stats["controller"]["pid"],
                    "unit": stats["units"][0]["pid"]}
            row = {"obs": torch.rand(16), "reward": torch.tensor(1.0)}
            for i in range(200):  # warm: lease, connections, caches
                tq.kv_put(f"warm{i}", "tiny", row)
                tq.kv_batch_get([f"warm{i}"], "tiny")
            for rep in range(reps):
                keys = [f"r{rep}-{i}" for i in range(ops)]
                for op in ("put", "get"):
                    before, t0 = _counters(pids), time.perf_counter()
                    for k in keys:
                        if op == "put":
                            tq.kv_put(k, "tiny", row)
                        else:
                            tq.kv_batch_get([k], "tiny")
                    wall = (time.perf_counter() - t0) / ops * 1e6
                    results[op].append({"wall us": wall,
                                        **_per_op(before, _counters(pids), ops)})
                tq.kv_clear(keys, "tiny")
        finally:
            tq.close()
    return {op: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for op, runs in results.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--durability", default="controller")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    warnings.filterwarnings("ignore")
    floors = [zmq_floor(a.ops) for _ in range(a.reps)]
    floor = {k: statistics.median(f[k] for f in floors) for k in floors[0]}
    ops = tiny_ops(a.ops, a.reps, a.durability)
    cols = ("wall us", "client cpu us", "client main us", "controller cpu us", "unit cpu us",
            "server cpu us", "client faults", "controller faults", "unit faults",
            "server faults")
    print(f"per op, median of {a.reps} x {a.ops}; durability {a.durability}; CPU includes "
          f"each process's ZeroMQ I/O threads")
    print("what | " + " | ".join(c for c in cols))
    print("--- | " + " | ".join("---" for _ in cols))
    for name, row in (("pyzmq round trip", floor), ("tiny put", ops["put"]),
                      ("tiny get", ops["get"])):
        print(name + " | " + " | ".join(
            "" if c not in row else (f"{row[c]:.2f}" if "faults" in c else f"{row[c]:.0f}")
            for c in cols))
    for op in ("put", "get"):
        row = ops[op]
        total = row["client cpu us"] + row["controller cpu us"] + row["unit cpu us"]
        print(f"tiny {op}: CPU of all three {total:.0f} us per op = "
              f"{total / (floor['client cpu us'] + floor['server cpu us']):.1f} bare round "
              f"trips' CPU; wall {row['wall us'] / floor['wall us']:.1f} round trips")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"floor": floor, **ops, "ops": a.ops, "reps": a.reps,
                       "durability": a.durability}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
