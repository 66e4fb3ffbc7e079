"""Job processes for e2e tests: trainer and worker processes that obey commands.

A :class:`JobProcess` is a real process (forked from a forkserver that imported torch and
tqtx once). It sends ``{"ready": pid}``, then answers each command
(``{"op": ..., "args": {...}}``) with ``{"ok": True, "result": ...}`` or
``{"ok": False, "error": type, "message": ...}``. A test drives several of them as a
trainer drives its workers: a command is the per-step go signal, its reply the barrier.
"""
from __future__ import annotations

import contextlib
import os
import random
import socket
import time
STATUSES = ("pending", "running", "finished")


# ---------------------------------------------------------------- test data
def sample(worker: int, step: int, i: int) -> tuple[str, list[int], dict]:
    """Key, int64 prompt tokens (length 1..9, varies by row) and tag of one rollout sample."""
    n = 1 + (worker * 5 + step * 3 + i * 7) % 9
    base = worker * 100_000 + step * 1000 + i * 10
    tag = {"status": STATUSES[(worker + step + i) % 3], "step": step, "worker": worker}
    return f"w{worker}-s{step}-{i}", [base + j for j in range(n)], tag


def step_samples(worker: int, step: int, n: int = 6) -> list[tuple[str, list[int], dict]]:
    return [sample(worker, step, i) for i in range(n)]


# ---------------------------------------------------------------- child side
def _jagged(rows: list[list[int]]):
    import torch
    return torch.nested.nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows],
                                      layout=torch.jagged)


def _rows(td, field):
    col = td.get(field)
    return [t.tolist() for t in (col.unbind() if col.is_nested else col.unbind(0))]


def _put_step(worker, step, pid, n=6, finish_previous=True):
    """Put this worker's batch of ``step``; mark its earlier running samples finished."""
    import tqtx as tq
    from tensordict import TensorDict
    rows = step_samples(worker, step, n)
    keys = [k for k, _, _ in rows]
    td = TensorDict({"prompt": _jagged([t for _, t, _ in rows])}, batch_size=[len(rows)])
    tq.kv_batch_put(keys, pid, fields=td, tags=[tag for _, _, tag in rows])
    finished = []
    if finish_previous and step > 1:
        for key, _, tag in step_samples(worker, step - 1, n):
            if tag["status"] == "running":
                finished.append(key)
        if finished:
            mine = tq.kv_list(pid)[pid]
            tq.kv_batch_put(finished, pid, fields=None,
                            tags=[{**mine[k], "status": "finished"} for k in finished])
    return {"keys": keys, "finished": finished}


def _get(keys, pid, field="prompt"):
    import tqtx as tq
    return _rows(tq.kv_batch_get(keys, pid, select_fields=[field]), field)


def _regenerate(worker, pid, n=6):
    """Generate again the re-issued (field-less, status pending) samples of this worker."""
    import tqtx as tq
    tags = tq.kv_list(pid).get(pid, {})
    todo = sorted(k for k, t in tags.items() if t.get("reissued") and t.get("worker") == worker)
    if not todo:
        return []
    tokens = {k: t for s in range(1, 10) for k, t, _ in step_samples(worker, s, n)}
    td = {"prompt": _jagged([tokens[k] for k in todo])}
    from tensordict import TensorDict
    tq.kv_batch_put(todo, pid, fields=TensorDict(td, batch_size=[len(todo)]),
                    tags=[{**tags[k], "status": "finished"} for k in todo])
    return todo


def _reissue(pid):
    """verl's resume: kv_list -> pending/running keys -> kv_batch_get -> kv_clear ->
    tags-only kv_batch_put; returns {key: prompt tokens read before the clear}."""
    import tqtx as tq
    tags = tq.kv_list(pid).get(pid, {})
    keys = sorted(k for k, t in tags.items() if t.get("status") in ("pending", "running"))
    if not keys:
        return {}
    prompts = _get(keys, pid)
    tq.kv_clear(keys, pid)
    tq.kv_batch_put(keys, pid, tags=[{**tags[k], "status": "pending", "reissued": True}
                                     for k in keys])
    return dict(zip(keys, prompts))


def _ops():
    import tqtx as tq

    def put(key, pid, value):
        import torch
        tq.kv_put(key, pid, {"v": torch.tensor(value, dtype=torch.int64)},
                  tag={"by": os.getpid()})

    def save_checkpoint(path, step):
        tq.save_checkpoint(path, metadata={"global_steps": step})

    return {
        "init": lambda config=None: tq.init(config),
        "put": put,
        "get_values": lambda keys, pid: _get(keys, pid, "v"),
        "put_step": _put_step,
        "get": _get,
        "list": lambda pid: tq.kv_list(pid).get(pid, {}),
        "reissue": _reissue,
        "regenerate": _regenerate,
        "save_checkpoint": save_checkpoint,
        "load_checkpoint": lambda path: (tq.load_checkpoint(path), None)[1],
        "dump": lambda path, keys, pid: (tq.dump_data_by_key(path, keys, pid), None)[1],
        "load_dump": lambda path, pid: (tq.load_data_by_key(path, partition_id=pid), None)[1],
        "close": lambda: (tq.close(), None)[1],
    }


def job_env(env: dict | None = None) -> dict:
    """The ``TQTX_*`` environment of a job process: this process's current one (as a
    subprocess would inherit it) with ``env`` applied (None removes a variable). The
    forkserver's own environment is the one it started with, so it is replaced, and
    TQTX_ADDRESS is always dropped (init() never attaches outside the test)."""
    out = {k: v for k, v in os.environ.items() if k.startswith("TQTX_") and k != "TQTX_ADDRESS"}
    out.update(env or {})
    return {k: v for k, v in out.items() if v is not None}


def _apply_env(env: dict) -> None:
    for k in [k for k in os.environ if k.startswith("TQTX_") and k not in env]:
        del os.environ[k]
    os.environ.update(env)


def serve_commands(conn, env: dict) -> None:
    """The body of a :class:`JobProcess`: apply ``env``, then answer commands on ``conn``."""
    _apply_env(env)
    ops = _ops()
    conn.send({"ready": os.getpid()})
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd["op"] == "exit":
            # what an interpreter exit does (multiprocessing children skip atexit hooks)
            import atexit
            atexit._run_exitfuncs()
            return
        try:
            reply = {"ok": True, "result": ops[cmd["op"]](**cmd.get("args", {}))}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        conn.send(reply)


# ---------------------------------------------------------------- many processes at once
def race_member(i: int, n: int, config, env: dict, sync: dict, results) -> None:
    """One of ``n`` processes calling ``tq.init(config)`` when ``sync["go"]`` is set.

    ``env`` (from :func:`job_env`) replaces the forkserver's ``TQTX_*`` environment.

    Puts key ``k<i>``, waits until all have put (``sync["put"]``, a Barrier), reads all
    keys and reports ``("read", i, pid, cfg, values, error)`` on ``results``. An attached
    process then exits when the file ``sync["exit"]`` exists; the creator waits for the
    file ``sync["close"]``, reads again (``"reread"``) and closes (``"closed"``). (Files,
    not Events: the test kills one process while the others wait.) Run under the
    forkserver context of :func:`job_context`, so 8 of them cost one torch import.
    """
    import torch
    import tqtx as tq
    _apply_env(env)
    cfg = None
    try:
        sync["go"].wait(60)
        cfg = tq.init(config)
        tq.kv_put(f"k{i}", "race", {"v": torch.tensor([i, i * i, 7])}, tag={"by": i})
        sync["put"].wait(60)
        keys = [f"k{j}" for j in range(n)]
        results.put(("read", i, os.getpid(), cfg, _rows(tq.kv_batch_get(keys, "race"), "v"),
                     None))
        if cfg["mode"] != "embedded":
            _wait_file(sync["exit"])
            return
        _wait_file(sync["close"])
        results.put(("reread", i, os.getpid(), cfg,
                     _rows(tq.kv_batch_get(keys, "race"), "v"), None))
        tq.close()
        results.put(("closed", i, os.getpid(), cfg, None, None))
    except Exception as exc:  # reported, so the test shows the cause
        results.put(("error", i, os.getpid(), cfg, None, f"{type(exc).__name__}: {exc}"))


def _wait_file(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


# ---------------------------------------------------------------- parent side
_CTX = None


def job_context():
    """A forkserver multiprocessing context whose server imported torch and tqtx once, so
    each job process (a real process) starts in milliseconds."""
    global _CTX
    if _CTX is None:
        import multiprocessing
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "tensordict", "tqtx.api", "tqtx.client.tensors",
                                     "tq_procs"])
    return _CTX


class JobProcess:
    """One job process (trainer or worker) running :func:`serve_commands`.

    ``env`` entries are set in the process (None removes a variable).
    """

    def __init__(self, env: dict | None = None):
        ctx = job_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_commands,
                                args=(child, job_env(env)))
        self.proc.start()
        child.close()
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 90.0) -> None:
        msg = self._recv(timeout)
        assert msg.get("ready") == self.pid, msg

    def send(self, op: str, **args) -> None:
        self.conn.send({"op": op, "args": args})

    def reply(self, timeout: float = 90.0):
        msg = self._recv(timeout)
        if not msg.get("ok"):
            raise AssertionError(f"process {self.pid}: {msg.get('error')}: {msg.get('message')}")
        return msg["result"]

    def call(self, op: str, timeout: float = 90.0, **args):
        self.send(op, **args)
        return self.reply(timeout)

    def call_error(self, op: str, timeout: float = 90.0, **args) -> dict:
        """Run a command expected to fail; returns {"error", "message"}."""
        self.send(op, **args)
        msg = self._recv(timeout)
        assert not msg.get("ok"), f"{op} succeeded: {msg}"
        return msg

    def _recv(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise AssertionError(f"process {self.pid} did not answer within {timeout}s")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise AssertionError(f"process {self.pid} exited (code {self.proc.exitcode})") from None

    def exit(self, timeout: float = 30.0):
        """Ask the process to leave its loop and exit normally (atexit hooks run)."""
        if self.proc.is_alive():
            try:
                self.send("exit")
            except OSError:
                pass
        self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind), and reap."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def cleanup(self) -> None:
        self.kill()
        self.conn.close()


@contextlib.contextmanager
def job_processes():
    """``start(n, env=None)`` starts ``n`` ready job processes; all are killed on exit."""
    started: list[JobProcess] = []

    def start(n: int, env: dict | None = None) -> list[JobProcess]:
        new = [JobProcess(env) for _ in range(n)]
        started.extend(new)
        for p in new:
            p.wait_ready()
        return new

    try:
        yield start
    finally:
        for p in started:
            p.cleanup()


def alive(pid: int) -> bool:
    """True while ``pid`` is a running (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if alive(p)]
        if left:
            time.sleep(0.05)
    return left


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (a bind to port 0, an outgoing
    connection's local port)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1, below the kernel's
    ephemeral range: the deployment's own sockets (and every outgoing connection) take
    ephemeral ports, and one of them could take a port of the run before the process it
    is meant for binds it."""
    top = _ephemeral_low() - n
    for _ in range(50):
        base = random.randrange(10000, top)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")
