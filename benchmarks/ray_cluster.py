"""Dump/restore on a 3-node Ray cluster vs the embedded deployment (same data, same units).

A local ``ray.cluster_utils.Cluster`` (a head and two extra nodes, all on 127.0.0.1, so
the "nodes" share this machine's CPUs, memory and disk) hosts a Ray-placed deployment
whose units are pinned round-robin over the three nodes; the embedded deployment runs the
same number of units as child processes. Both get the same realistic rollout buffer
(:func:`tqtx.demo.data.make_buffer`: jagged prompt/response ids, log-probs, rewards, text,
tags). For each: V2 save (units write, ``dump_data_by_key``), V2 save through the client
(``via="client"``), V1 save (``kv_batch_get`` + ``torch.save`` + fsync, see benchmarks/baselines.py),
then V2 and V1 restores into the cleared partition, and the shared-filesystem probe alone
(``probe``: skipped, ~0, for the embedded deployment; one round trip on Ray, included in
"save V2 units"). Medians of ``--reps`` runs, two rounds, embedded and Ray alternating.

    python benchmarks/ray_cluster.py --mb 256 --samples 4096 --units 3 --reps 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback only


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=256, help="buffer payload in MiB (256)")
    p.add_argument("--samples", type=int, default=4096, help="samples (4096)")
    p.add_argument("--units", type=int, default=3, help="storage units (3)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    p.add_argument("--dir", default=None, help="where dumps go (a temp dir is made there)")
    return p.parse_args(argv)


def _put(tq, buf, pid):
    from tqtx.demo.data import tensordict_of
    n = len(buf["keys"])
    for lo in range(0, n, 512):
        hi = min(n, lo + 512)
        tq.kv_batch_put(buf["keys"][lo:hi], pid, tensordict_of(buf, lo, hi),
                        tags=buf["tags"][lo:hi])


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


VARIANTS = ("save V1", "save V2 units", "save V2 client", "restore V1", "restore V2 units",
            "probe")


def measure(tq, buf, pid, work, reps, times: dict) -> None:
    """Append the seconds of each variant on the running deployment to ``times``; the
    first (warm-up) repetition is not recorded."""
    from baselines import v1_restore, v1_save
    keys = buf["keys"]
    _put(tq, buf, pid)
    for r in range(reps + 1):
        if r == 1:
            for k in VARIANTS:
                del times[k][-1:]  # the warm-up
        d2, dc, f1 = (os.path.join(work, f"{x}-{r}") for x in ("v2", "v2c", "v1.pt"))
        times["save V1"].append(_timed(lambda: v1_save(tq, keys, pid, f1)))
        times["save V2 units"].append(_timed(lambda: tq.dump_data_by_key(d2, keys, pid)))
        times["save V2 client"].append(_timed(
            lambda: tq.dump_data_by_key(dc, keys, pid, via="client")))
        from tqtx.placement.probe import check_units_reach  # part of "save V2 units" too
        client = tq.get_client()
        times["probe"].append(_timed(lambda: check_units_reach(client, d2, "dump")))
        tq.kv_clear(keys, pid)
        times["restore V1"].append(_timed(lambda: v1_restore(tq, pid, f1)))
        tq.kv_clear(keys, pid)
        times["restore V2 units"].append(_timed(lambda: tq.load_data_by_key(d2)))
        for path in (d2, dc):
            shutil.rmtree(path, ignore_errors=True)
        os.unlink(f1)


def main(argv=None) -> int:
    a = _args(argv)
    import ray
    from ray.cluster_utils import Cluster

    import tqtx as tq
    from tqtx.demo.data import make_buffer, payload_bytes

    work = tempfile.mkdtemp(prefix="tqtx-raybench-", dir=a.dir)
    ray_tmp = tempfile.mkdtemp(prefix="tqtx-ray-", dir="/tmp")
    # Ray's Cluster writes its "current cluster" address file under <RAY_TMPDIR>/ray (by
    # default /tmp/ray, which may not exist, or be another Ray's): keep it in ours.
    os.environ["RAY_TMPDIR"] = ray_tmp
    os.mkdir(os.path.join(ray_tmp, "ray"))
    buf = make_buffer(a.samples, int(a.mb * 2**20))
    mib = payload_bytes(buf) / 2**20
    times = {kind: {k: [] for k in VARIANTS} for kind in ("embedded", "ray")}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "include_dashboard": False, "node_ip_address": "127.0.0.1",
            "temp_dir": ray_tmp})
        for _ in range(2):
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        # ABAB: both deployments see the same machine load (other work, page cache)
        for rnd in range(2):
            for kind in ("embedded", "ray"):
                cfg = {"num_units": a.units, "state_dir": os.path.join(work, f"state-{kind}-{rnd}")}
                if kind == "ray":
                    cfg.update(placement="ray", ray_num_cpus=0.5)
                info = tq.init(cfg)
                if kind == "ray":
                    nodes = len({u["node_id"] for u in info["unit_nodes"]})
                measure(tq, buf, "bench", work, a.reps, times[kind])
                tq.close()
        results = {kind: {k: statistics.median(v) for k, v in t.items()}
                   for kind, t in times.items()}
        spread = {kind: {k: (min(v), max(v)) for k, v in t.items()} for kind, t in times.items()}
    finally:
        tq.close()
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    e, r = results["embedded"], results["ray"]
    print(f"{a.samples} samples, {mib:.0f} MiB payload, {a.units} units "
          f"(Ray: units on {nodes} nodes), median of {2 * a.reps} (2 rounds, ABAB, "
          f"after a warm-up); CPUs: {os.cpu_count()}")
    print(f"| {'variant':<18} | embedded s | Ray 3-node s | Ray / embedded | embedded min-max "
          f"| Ray min-max |")
    print(f"|{'-' * 20}|-----------:|-------------:|---------------:|-----------------:|"
          f"------------:|")
    for k in e:
        (elo, ehi), (rlo, rhi) = spread["embedded"][k], spread["ray"][k]
        ratio = f"{r[k] / e[k]:13.2f}x" if e[k] >= 1e-3 else f"{'-':>14}"
        print(f"| {k:<18} | {e[k]:10.3f} | {r[k]:12.3f} | {ratio} | "
              f"{elo:.3f}-{ehi:.3f}      | {rlo:.3f}-{rhi:.3f} |")
    for name, res in (("embedded", e), ("Ray", r)):
        print(f"{name}: save V1 / V2 units = {res['save V1'] / res['save V2 units']:.1f}x, "
              f"restore V1 / V2 units = {res['restore V1'] / res['restore V2 units']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
