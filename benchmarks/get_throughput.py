#!/usr/bin/env python
"""kv_batch_get / put of a realistic rollout buffer: tqtx against TransferQueue and a copy floor.

    python benchmarks/get_throughput.py [--units 4] [--mb 256] [--reps 5] [--tiny 200]
                                        [--warmup 2]
                                        [--tq-python /work/tq-venv/bin/python | --no-tq]
                                        [--json P]

Workloads, the same bytes for every engine (generated from one seed in each process):

* ``rollout``: --mb MiB of jagged rows (about 30 rows per MiB): int64 prompt and response
  tokens, float32 log-probs (same lengths as the response), a float32 scalar reward and a
  str; ``put`` = ``kv_batch_put`` of the whole buffer into fresh keys, ``get`` =
  ``kv_batch_get`` of all of it.
* ``rows64k``: --mb MiB as 64 KiB float32 rows (dense), put and get.
* ``ckpt save`` / ``ckpt load``: ``save_checkpoint`` of the system holding the rollout
  buffer (into the same RAM file system), then ``load_checkpoint`` of it; the floor is one
  stream writing the buffer's bytes to a file there and reading them back into fresh memory.
* ``tiny put`` / ``tiny get``: median latency of --tiny ``kv_put`` calls of one small row,
  then of ``kv_batch_get`` of one of those keys.

Each engine runs in its own worker process (tqtx with this interpreter; TransferQueue
0.1.11 with ``--tq-python``, a separate venv with ``transferqueue`` and Ray, which this
script never imports itself). Workers are started once, then every repetition asks each
engine in turn (the order rotates per repetition) to run the whole sequence; the floor
(``torch.cat`` of the per-row tensors of every jagged field + a clone of the dense ones,
in one process) runs in the same rotation. Medians of --reps. Without a TransferQueue
interpreter the TQ column is absent and the table says so.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import JsonWorker, serve  # noqa: E402

MiB = 2**20
ROWS_PER_MIB = 30
DEFAULT_TQ_PYTHON = "/work/tq-venv/bin/python"
OPS = ("rollout put", "rollout get", "ckpt save", "ckpt load", "rows64k put", "rows64k get",
       "tiny put", "tiny get")
LATENCY_OPS = ("tiny put", "tiny get")


# ---------------------------------------------------------------- data (torch only)
def rollout_buffer(mb: int, seed: int = 0):
    """(keys, TensorDict, source rows) of a partial-rollout buffer of about ``mb`` MiB."""
    import torch
    from tensordict import TensorDict

    n = max(1, mb * ROWS_PER_MIB)
    g = torch.Generator().manual_seed(seed)
    per = mb * MiB / n
    mean_p, mean_r = max(per * 0.2 / 8, 2.0), max(per * 0.8 / 12, 2.0)

    def lengths(mean):
        f = torch.rand(n, generator=g) * 1.5 + 0.25
        return [max(1, int(round(mean * x))) for x in f.tolist()]

    lp, lr = lengths(mean_p), lengths(mean_r)
    rows = {
        "prompt_ids": list(torch.randint(0, 151_936, (sum(lp),), generator=g).split(lp)),
        "response_ids": list(torch.randint(0, 151_936, (sum(lr),), generator=g).split(lr)),
        "log_probs": list((-torch.rand(sum(lr), generator=g) * 8.0).split(lr)),
    }
    nt = torch.nested.nested_tensor
    td = TensorDict({**{f: nt(v, layout=torch.jagged) for f, v in rows.items()},
                     "reward": torch.randn(n, generator=g),
                     "text": [f"sample {i}: réponse « {lr[i]} » tokens ✓" for i in range(n)]},
                    batch_size=[n])
    return [f"traj-{i:06d}" for i in range(n)], td, rows


def dense_rows(mb: int, row_bytes: int = 64 * 1024):
    import torch
    from tensordict import TensorDict
    n = mb * MiB // row_bytes
    x = torch.rand(n, row_bytes // 4, generator=torch.Generator().manual_seed(1))
    return [f"r{i}" for i in range(n)], TensorDict({"x": x}, batch_size=[n]), x


def payload_bytes(td) -> int:
    total = 0
    for f in td.keys():
        v = td.get(f)
        if hasattr(v, "is_nested") and v.is_nested:
            total += v.values().numel() * v.values().element_size()
        elif hasattr(v, "element_size"):
            total += v.numel() * v.element_size()
        else:
            total += sum(len(s.encode()) for s in v.tolist())
    return total


def _same_jagged(got, rows) -> bool:
    import torch
    got = got.values() if got.is_nested else got
    return torch.equal(got.reshape(-1), torch.cat([r.reshape(-1) for r in rows]))


# ---------------------------------------------------------------- worker
class Engine:
    """The KV functions of one engine (``tqtx`` or TransferQueue's ``transfer_queue``)."""

    def __init__(self, name: str, units: int):
        self.name = name
        self.tmp = tempfile.mkdtemp(prefix=f"getbench-{name}-",
                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        if name == "tqtx":
            import tqtx as tq
            tq.init({"num_units": units, "state_dir": self.tmp})
        else:
            import ray
            from omegaconf import OmegaConf
            # a private local Ray (never another user's cluster); actors need a CPU each
            ray.init(address="local", num_cpus=units + 4, include_dashboard=False,
                     log_to_driver=False, _temp_dir=os.path.join(self.tmp, "ray"))
            import transfer_queue as tq
            tq.init(OmegaConf.create(
                {"backend": {"SimpleStorage": {"num_data_storage_units": units}}}))
        self.tq = tq

    def close(self):
        try:
            self.tq.close()
        finally:
            if self.name != "tqtx":
                import ray
                ray.shutdown()
            shutil.rmtree(self.tmp, ignore_errors=True)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def run_rep(eng: Engine | None, data: dict, tiny: int, check: bool) -> dict:
    """One repetition of every op; ``eng`` None runs the in-process copy floor."""
    import torch
    out = {}
    keys, td, rows = data["rollout"]
    dkeys, dtd, x = data["rows64k"]
    if eng is None:
        t0 = time.perf_counter()
        cols = [torch.cat(r) for r in rows.values()]
        reward, text = td["reward"].clone(), list(td.get("text").tolist())
        out["rollout get"] = out["rollout put"] = time.perf_counter() - t0
        out["ckpt save"], out["ckpt load"] = _floor_file(cols + [reward])
        del cols, reward, text
        t0 = time.perf_counter()
        y = x.clone()
        out["rows64k get"] = out["rows64k put"] = time.perf_counter() - t0
        del y
        return out
    tq = eng.tq
    for name, (k, batch) in (("rollout", (keys, td)), ("rows64k", (dkeys, dtd))):
        pid = f"bench-{name}"
        out[f"{name} put"], _ = _timed(tq.kv_batch_put, k, pid, batch)
        out[f"{name} get"], got = _timed(tq.kv_batch_get, k, pid)
        if check:
            if name == "rollout":
                ok = all(_same_jagged(got[f], r) for f, r in rows.items())
                ok = ok and torch.equal(got["reward"].reshape(-1), td["reward"])
                ok = ok and list(got["text"].tolist() if hasattr(got["text"], "tolist")
                                 else got["text"]) == list(td.get("text").tolist())
            else:
                g = got["x"]
                ok = _same_jagged(g, [x]) if g.is_nested else torch.equal(g, x)
            if not ok:
                raise AssertionError(f"{eng.name}: kv_batch_get({name}) returned other values")
        del got
        if name == "rollout":
            ckpt = os.path.join(eng.tmp, "ckpt")
            out["ckpt save"], _ = _timed(tq.save_checkpoint, ckpt)
            out["ckpt load"], _ = _timed(tq.load_checkpoint, ckpt)
            shutil.rmtree(ckpt, ignore_errors=True)
        tq.kv_clear(k, pid)
    row = {"obs": torch.rand(16), "reward": torch.tensor(1.0)}
    lat, glat = [], []
    for i in range(tiny + 10):
        t0 = time.perf_counter()
        tq.kv_put(f"tiny{i}", "bench-tiny", row)
        if i >= 10:
            lat.append(time.perf_counter() - t0)
    for i in range(tiny + 10):
        t0 = time.perf_counter()
        tq.kv_batch_get([f"tiny{i}"], "bench-tiny")
        if i >= 10:
            glat.append(time.perf_counter() - t0)
    tq.kv_clear([f"tiny{i}" for i in range(tiny + 10)], "bench-tiny")
    out["tiny put"] = statistics.median(lat)
    out["tiny get"] = statistics.median(glat)
    return out


def _floor_file(tensors) -> tuple[float, float]:
    """One stream writing the tensors' bytes to a file on the RAM file system and reading
    them back into fresh memory: the floor of a checkpoint's save and load."""
    import torch
    where = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(where, "floor")
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        total = 0
        try:
            for t in tensors:
                view = memoryview(t.contiguous().view(torch.uint8).numpy())
                total += view.nbytes
                while view.nbytes:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        buf = torch.empty(total, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buf.numpy()))
        load = time.perf_counter() - t0
        del buf
        return save, load
    finally:
        shutil.rmtree(where, ignore_errors=True)


def worker(args) -> int:
    """Serve ``rep`` commands (JSON lines on stdin); answer on the --result-fd pipe."""
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    res = os.fdopen(args.result_fd, "w", buffering=1)
    data = {"rollout": rollout_buffer(args.mb), "rows64k": dense_rows(args.mb)}
    eng = None if args.worker == "floor" else Engine(args.worker, args.units)
    where = None if eng is None else getattr(eng.tq, "__file__", None)
    res.write(json.dumps({"ready": True, "bytes": payload_bytes(data["rollout"][1]),
                          "rows": len(data["rollout"][0]), "module": where}) + "\n")
    try:
        serve(res, lambda cmd: run_rep(eng, data, args.tiny, cmd.get("check", False)))
    finally:
        if eng is not None:
            eng.close()
    return 0


# ---------------------------------------------------------------- parent
def tq_missing(python: str) -> str | None:
    """Why ``python`` cannot run the TransferQueue worker, or None if it can."""
    if os.path.exists(python) and subprocess.run(
            [python, "-c", "import transfer_queue, ray"], capture_output=True).returncode == 0:
        return None
    return (f"TransferQueue column absent: {python} cannot import transfer_queue and ray "
            f"(install transferqueue==0.1.11 in a separate venv, pass --tq-python)")


def _start_worker(kind: str, python: str, a, pythonpath: str | None = None) -> JsonWorker:
    """The worker of one engine under ``python``, its ready line read into ``.info``."""
    env = {**os.environ, "TQTX_LOG_LEVEL": "WARNING", "RAY_AUTH_MODE": "disabled",
           "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    if pythonpath:  # its units inherit it, so they run the same tree
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(pythonpath),
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    w = JsonWorker(
        kind, [python, os.path.abspath(__file__), "--worker", "tqtx" if kind == "base" else kind,
               "--units", str(a.units), "--mb", str(a.mb), "--tiny", str(a.tiny)],
        a.log, env=env,
        cwd=pythonpath or None)  # `python -m tqtx.storage` puts the cwd first on sys.path
    w.info = w.read()
    return w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny", type=int, default=200)
    p.add_argument("--warmup", type=int, default=2,
                   help="repetitions run first and not counted (default 2)")
    p.add_argument("--tq-python", default=os.environ.get("TQ_PYTHON", DEFAULT_TQ_PYTHON),
                   help="interpreter of a venv with transferqueue==0.1.11 (and Ray)")
    p.add_argument("--no-tq", action="store_true", help="leave the TransferQueue column out")
    p.add_argument("--baseline", metavar="DIR",
                   help="also run the tqtx package found in DIR (e.g. an older tree: "
                        "`git archive REV tqtx | tar -x -C DIR`) as column 'base'")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "get_throughput.log"),
                   help="the workers' stderr (default: %(default)s)")
    p.add_argument("--worker", choices=("tqtx", "tq", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    tq_note = "TransferQueue column left out (--no-tq)" if a.no_tq else tq_missing(a.tq_python)
    kinds = ["tqtx", "floor"] + ([] if tq_note else ["tq"]) + (["base"] if a.baseline else [])
    workers = {}
    try:
        for k in kinds:
            workers[k] = _start_worker(k, a.tq_python if k == "tq" else sys.executable, a,
                                       pythonpath=a.baseline if k == "base" else None)
        info = workers["tqtx"].info
        if "base" in workers:
            print(f"tqtx: {info['module']}; base: {workers['base'].info['module']}")
        print(f"rollout buffer: {info['rows']} rows, {info['bytes'] / MiB:.0f} MiB payload; "
              f"rows64k: {a.mb * MiB // 65536} x 64 KiB; {a.units} units; {a.reps} reps",
              flush=True)
        times = {k: {op: [] for op in OPS} for k in kinds}
        for rep in range(a.warmup):   # not counted: the first repetitions are the slowest
            for k in kinds:
                workers[k].call("rep", check=rep == 0)
        for rep in range(a.reps):
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
            for k in order:
                for op, s in workers[k].call("rep", check=rep == 0 and not a.warmup).items():
                    times[k][op].append(s)
            print(f"rep {rep + 1}/{a.reps}: " + ", ".join(
                f"{k} get {times[k]['rollout get'][-1]:.3f}s" for k in kinds), flush=True)
    finally:
        for w in workers.values():
            w.stop()
    med = {k: {op: statistics.median(v) for op, v in ops.items() if v}
           for k, ops in times.items()}
    _print_table(med, kinds, {"rollout": info["bytes"], "rows64k": a.mb * MiB}, tq_note)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"units": a.units, "mb": a.mb, "reps": a.reps, "info": info,
                       "median_s": med, "all_s": times, "tq_note": tq_note}, f, indent=2)
    return 0


def _print_table(med, kinds, sizes, tq_note):
    others = [(k, label) for k, label in (("tq", "TQ"), ("base", "base")) if k in kinds]
    head = ["op", "tqtx s", "GB/s", "Gbit/s", "x floor"]
    for _, label in others:
        head += [f"{label} s", f"tqtx speed / {label}"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for op in OPS:
        t = med["tqtx"][op]
        if op in LATENCY_OPS:
            row = [op, f"{t * 1e3:.3f} ms", "", "", ""]
        else:
            nbytes = sizes["rollout" if op.startswith("ckpt") else op.split()[0]]
            row = [op, f"{t:.3f}", f"{nbytes / t / 1e9:.2f}", f"{nbytes * 8 / t / 1e9:.1f}",
                   f"{t / med['floor'][op]:.2f}"]
        for k, _ in others:
            q = med[k].get(op)
            if q is None:
                row += ["", ""]
                continue
            row += [f"{q * 1e3:.3f} ms" if op in LATENCY_OPS else f"{q:.3f}", f"{q / t:.2f}x"]
        print(" | ".join(row))
    print(f"floor: rollout {med['floor']['rollout get']:.3f}s (torch.cat of each jagged field "
          f"+ reward clone + text list), rows64k {med['floor']['rows64k get']:.3f}s (clone), "
          f"checkpoint {med['floor']['ckpt save']:.3f}s / {med['floor']['ckpt load']:.3f}s "
          f"(one stream writing / reading the rollout's bytes)")
    if tq_note:
        print(tq_note)


if __name__ == "__main__":
    sys.exit(main())
