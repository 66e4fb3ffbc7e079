"""One worker process of the history workload: random ops on a small shared key space.

Each op is logged to the worker's JSONL file twice: ``invoke`` (``time.monotonic()``, i.e.
CLOCK_MONOTONIC, which all processes of the host share) right before the call, and
``complete`` right after it returns or raises, with the outcome: ``ok``, ``fail`` (a definite
refusal that changed nothing) or ``info`` (indeterminate). An invoke without a complete line is
indeterminate too. A bare ``KeyError`` reaching the caller is flagged (``bare``).
"""
from __future__ import annotations

import json
import os
import random
import time

from captures import (ABSENT, LOST, KeySpace, checkpoint_capture, dump_capture, load_capture,
                      pad_of, row_value, save_capture, tag_value, value_id)

LISTED, UNLISTED = "<listed>", "<unlisted>"   # lin_search's presence reads
WEIGHTS = {"put": 30, "get": 28, "clear": 10, "list": 10, "dump": 8, "load": 6,
           "ckpt_save": 3, "ckpt_load": 2}
READS = ("get", "list", "dump", "ckpt_save")
UNBLOCK_AFTER = 5.0


def is_bare_keyerror(exc: BaseException) -> bool:
    """A KeyError that is none of tqtx's named errors (or a unit's "holds no row")."""
    return type(exc) is KeyError or (isinstance(exc, KeyError) and (
        "holds no row at global index" in str(exc) or "has no field" in str(exc)))


def classify(kind: str, exc: BaseException) -> str:
    """``fail`` for a definite refusal with no effect, else ``info`` (indeterminate)."""
    import tqtx as tq
    if is_bare_keyerror(exc):
        return "info"
    if isinstance(exc, tq.RestorePendingError):
        # A load's own restore may be left unresolved (unit_running, lost_reply): only the
        # refusal to begin one ("a second load ... refused") is known to have done nothing.
        return "fail" if kind != "load" or str(exc).startswith("a second load") else "info"
    if isinstance(exc, (tq.PeerDiedError, tq.PeerTimeoutError)):
        return "info"
    if isinstance(exc, tq.RowsLostError):
        return "fail" if kind in READS else "info"
    if isinstance(exc, (ValueError, TypeError, tq.PartitionNotFoundError,
                        tq.CheckpointBusyError)):
        return "fail"
    return "info"


class Worker:
    def __init__(self, proc: int, cfg: dict):
        self.proc = proc
        self.cfg = cfg
        self.space = KeySpace(cfg["partitions"], cfg["keys_per_partition"])
        self.rng = random.Random(f"{cfg['seed']}-{proc}")
        self.seq = 0
        self.dumps_dir = os.path.join(cfg["dir"], "dumps")
        self.ckpts_dir = os.path.join(cfg["dir"], "ckpts")
        self.blocked: dict[str, float] = {}  # restore ID -> when it first blocked an op
        self.log = open(os.path.join(cfg["dir"], "logs", f"w{proc}.jsonl"), "a", buffering=1)
        weights = cfg.get("weights") or WEIGHTS
        self.kinds, self.weights = list(weights), list(weights.values())

    # ---------------------------------------------------------------- logging
    def _line(self, **rec) -> None:
        self.log.write(json.dumps(rec) + "\n")

    def run_op(self, kind: str, call, values=None, tags=None) -> str:
        """Log, call ``call()`` (returns the (values, tags) it observed, or None), log the
        outcome; returns it."""
        n = self.seq
        self._line(e="invoke", n=n, kind=kind, t=time.monotonic(),
                   values=_pairs(values or {}), tags=_pairs(tags or {}))
        rec = {"e": "complete", "n": n}
        try:
            got = call()
            rec.update(t=time.monotonic(), outcome="ok")
        except Exception as exc:  # noqa: BLE001 - every failure is classified and logged
            rec.update(t=time.monotonic(), outcome=classify(kind, exc),
                       error=f"{type(exc).__name__}: {exc}"[:400], bare=is_bare_keyerror(exc))
            got = self.observed_in_error(kind, exc)
            self.unblock(exc)
        if got is not None:
            rec.update(values=_pairs(got[0]), tags=_pairs(got[1]))
        self._line(**rec)
        return rec["outcome"]

    def unblock(self, exc: BaseException) -> None:
        """With ``unblock`` (runs with kills): a restore left unresolved by a killed unit
        blocks its partition; once the same restore has blocked this worker for
        ``UNBLOCK_AFTER`` seconds, settle it with recover_data_load (logged, not an op: its
        effect is the indeterminate load's)."""
        import tqtx as tq
        if not self.cfg.get("unblock") or not isinstance(exc, tq.RestorePendingError) \
                or not exc.dump_dir or not exc.restore_id:
            return
        first = self.blocked.setdefault(exc.restore_id, time.monotonic())
        if time.monotonic() - first < UNBLOCK_AFTER:
            return
        self.blocked.pop(exc.restore_id, None)
        t = time.monotonic()
        try:
            result = repr(tq.recover_data_load(exc.dump_dir))
        except Exception as err:  # noqa: BLE001 - logged; a later op tries again
            result = f"{type(err).__name__}: {err}"[:300]
        self._line(e="maintenance", what="recover_data_load", dump_dir=exc.dump_dir,
                   t=t, t_end=time.monotonic(), result=result)

    def observed_in_error(self, kind: str, exc: BaseException):
        """What a failed get still tells: KeysNotFoundError names the absent keys (the
        others were listed), RowsLostError the lost ones."""
        import tqtx as tq
        if kind != "get" or not isinstance(exc, (tq.KeysNotFoundError, tq.RowsLostError)):
            return None
        pid, keys = self._get_args
        named = set(exc.keys)
        seen = ABSENT if isinstance(exc, tq.KeysNotFoundError) else LOST
        return {(pid, k): (seen if k in named else LISTED) for k in keys}, {}

    # ---------------------------------------------------------------- ops
    def step(self) -> None:
        self.seq += 1
        kind = self.rng.choices(self.kinds, self.weights)[0]
        getattr(self, "op_" + kind)()

    def _keys(self, lo: int, hi: int) -> tuple[str, list[str]]:
        pid = self.rng.choice(self.space.partitions)
        keys = [k for _, k in self.space.of(pid)]
        return pid, self.rng.sample(keys, self.rng.randint(lo, hi))

    def op_put(self) -> None:
        import torch
        import tqtx as tq
        from tensordict import TensorDict
        pid, keys = self._keys(1, 3)
        codes = [self.space.code[(pid, k)] for k in keys]
        vids = [value_id(self.space, c, self.proc, self.seq) for c in codes]
        written = {(pid, k): v for k, v in zip(keys, vids)}
        tags = [{"vid": v} for v in vids]
        ids = [[c, self.proc, self.seq] for c in codes]
        pads = [pad_of(c, self.proc, self.seq) for c in codes]
        if len(keys) == 1 and self.rng.random() < 0.5:
            def call():
                tq.kv_put(keys[0], pid, {"ids": torch.tensor(ids[0]),
                                         "pad": torch.tensor(pads[0])}, tag=tags[0])
        else:
            td = TensorDict({"ids": torch.tensor(ids), "pad": torch.nested.nested_tensor(
                [torch.tensor(p) for p in pads], layout=torch.jagged)}, batch_size=[len(keys)])

            def call():
                tq.kv_batch_put(keys, pid, td, tags=tags)
        self.run_op("put", call, written, written)

    def op_get(self) -> None:
        import tqtx as tq
        pid, keys = self._keys(1, 4)
        self._get_args = (pid, keys)

        def call():
            td = tq.kv_batch_get(keys, pid)
            if set(td.keys()) != {"ids", "pad"}:
                return {(pid, k): f"<fields {sorted(td.keys())}>" for k in keys}, {}
            ids, pad = _rows(td["ids"]), _rows(td["pad"])
            return {(pid, k): row_value(self.space, i, p)
                    for k, i, p in zip(keys, ids, pad)}, {}
        self.run_op("get", call)

    def op_clear(self) -> None:
        import tqtx as tq
        pid, keys = self._keys(1, 3)
        gone = {(pid, k): ABSENT for k in keys}
        self.run_op("clear", lambda: tq.kv_clear(keys, pid), gone, gone)

    def op_list(self) -> None:
        import tqtx as tq
        pid = self.rng.choice(self.space.partitions + [None])

        def call():
            listed = tq.kv_list(pid) if pid is not None else tq.kv_list()
            values, tags = {}, {}
            for p in ([pid] if pid is not None else self.space.partitions):
                there = listed.get(p, {})
                for _, k in self.space.of(p):
                    values[(p, k)] = LISTED if k in there else UNLISTED
                    # A key left out is absent or lost; a lost key keeps its tag (a
                    # checkpoint saves it), so only a listed key's tag is observed.
                    if k in there:
                        tags[(p, k)] = tag_value(there[k])
            return values, tags
        self.run_op("list", call)

    def op_dump(self) -> None:
        import tqtx as tq
        pid, keys = self._keys(1, 4)
        path = os.path.join(self.dumps_dir, f"w{self.proc}-{self.seq}")

        def call():
            tq.dump_data_by_key(path, keys, pid)
        if self.run_op("dump", call) == "ok":
            self._publish_capture(dump_capture, path)

    def op_ckpt_save(self) -> None:
        import tqtx as tq
        path = os.path.join(self.ckpts_dir, f"w{self.proc}-{self.seq}")

        def call():
            tq.save_checkpoint(path)
        if self.run_op("ckpt_save", call) == "ok":
            self._publish_capture(checkpoint_capture, path)

    def _publish_capture(self, read, path: str) -> None:
        """What a dump or checkpoint that succeeded captured (read from its files by
        ``read``): the op's observation (a ``capture`` line), offered to loaders of every
        process. A capture that cannot be read is logged (``capture_error``)."""
        try:
            cap = read(self.space, path)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self._line(e="capture_error", n=self.seq, error=f"{type(exc).__name__}: {exc}"[:400])
            return
        self._line(e="capture", n=self.seq, values=_pairs(cap["values"]),
                   tags=_pairs(cap["tags"]))
        save_capture(path + ".capture.json", path, cap)

    def _pick_capture(self, directory: str):
        names = sorted(n for n in os.listdir(directory) if n.endswith(".capture.json"))
        if not names:
            return None
        return load_capture(os.path.join(directory, self.rng.choice(names)))

    def op_load(self) -> None:
        import tqtx as tq
        picked = self._pick_capture(self.dumps_dir)
        if picked is None:
            return self.op_dump()
        path, cap = picked

        def call():
            tq.load_data_by_key(path)
        self.run_op("load", call, cap["values"], cap["tags"])

    def op_ckpt_load(self) -> None:
        import tqtx as tq
        picked = self._pick_capture(self.ckpts_dir)
        if picked is None:
            return self.op_ckpt_save()
        path, cap = picked

        def call():
            tq.load_checkpoint(path)
        self.run_op("ckpt_load", call, cap["values"], cap["tags"])


def _pairs(per_key: dict) -> list:
    return [[p, k, v] for (p, k), v in per_key.items()]


def _rows(col) -> list[list[int]]:
    return [t.tolist() for t in (col.unbind() if col.is_nested else col.unbind(0))]


# ---------------------------------------------------------------- processes
def worker_main(proc: int, cfg: dict, end: float) -> None:
    """One forked worker: attach by address, run ops until ``end`` (monotonic), detach."""
    import torch
    torch.set_num_threads(1)
    import tqtx as tq
    if proc % 2:  # half the clients have the units read every put out of their memory
        from tqtx.client import put_from
        put_from.MIN_BYTES = 0
    try:
        # strict: a get of a missing key raises KeysNotFoundError naming it, so every value
        # read is attributed to its key (TransferQueue's default leaves missing keys out of
        # the result; the fence under both is the same get_rows path)
        _attach(tq, cfg)
        worker = Worker(proc, cfg)
        stop_file = cfg.get("stop_file")
        while time.monotonic() < end and not (stop_file and os.path.exists(stop_file)):
            worker.step()
        tq.close()
    except BaseException as exc:
        with open(os.path.join(cfg["dir"], "logs", f"w{proc}.fatal"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise


def _attach(tq, cfg: dict, within: float = 60.0) -> None:
    """Attach by address; a nemesis that kills the job may have the controller down right
    now, so a dead or silent controller is asked again (as a trainer's retry would) until
    it is back, for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            tq.init(address=cfg["address"], config={"timeout": cfg["timeout"], "strict": True})
            return
        except (tq.PeerDiedError, tq.PeerTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main(cfg_path: str) -> int:
    """The workers' parent: imports torch and tqtx once, then forks the workers (it has no
    threads of its own yet), waits for them (bounded) and exits with the number that failed."""
    import multiprocessing
    import tensordict  # noqa: F401 - imported once, before the fork
    import torch  # noqa: F401
    import tqtx.api  # noqa: F401
    with open(cfg_path) as f:
        cfg = json.load(f)
    ctx = multiprocessing.get_context("fork")
    end = time.monotonic() + cfg["seconds"]
    procs = [ctx.Process(target=worker_main, args=(i, cfg, end)) for i in range(cfg["workers"])]
    for p in procs:
        p.start()
    failed = 0
    for p in procs:
        p.join(max(1.0, end + cfg["grace"] - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(10)
        failed += p.exitcode != 0
    return failed


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1]))
