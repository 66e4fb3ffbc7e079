"""The crash matrix's client-side cases run their operation in a child process (a fault
point there may SIGKILL it). A fresh interpreter spends seconds importing torch and tqtx;
this module keeps one process that has imported them and forks a child per case, as a
trainer's forked workers would be.

    rc, stderr = run_client(args, env, timeout)

``run_client`` starts the forking process on first use (one per test process, stopped at
exit); each request is a JSON line on its stdin, each answer one on its stdout. The child
arms the case's ``TQTX_FAULTS`` (``tqtx.faults.configure``), runs :func:`client_op` and
exits 0; an exception exits 1 with its traceback on the child's stderr; a ``kill`` fault
ends it by SIGKILL, reported as return code -9 (as :mod:`subprocess` reports it).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time

_forker: subprocess.Popen | None = None


def client_op(argv: list[str]) -> None:
    """The operation of a client-side case, attached to the deployment in ``$TQ_ADDR``."""
    import tqtx as tq
    tq.init({"timeout": float(os.environ["TQ_T"])}, address=os.environ["TQ_ADDR"])
    try:
        if argv[0] == "dump":
            tq.dump_data_by_key(argv[1], argv[2].split(","), "p")
        elif argv[0] == "dump-bg":
            tq.dump_data_by_key(argv[1], argv[2].split(","), "p", block=False).result(60)
        else:
            tq.load_data_by_key(argv[1])
    finally:
        tq.close()  # as a process ending normally would, at exit


def run_client(args: list[str], env: dict, timeout: float = 120.0) -> tuple[int, str]:
    """Run :func:`client_op` on ``args`` in a forked child with ``env`` added to its
    environment; its return code and stderr. A child still running after ``timeout`` is
    killed (return code -9)."""
    global _forker
    if _forker is None or _forker.poll() is not None:
        _forker = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        atexit.register(_forker.kill)
    with tempfile.NamedTemporaryFile("r", suffix=".stderr") as err:
        _forker.stdin.write(json.dumps({"args": args, "env": env, "stderr": err.name,
                                        "timeout": timeout}).encode() + b"\n")
        _forker.stdin.flush()
        # the forker answers within its own timeout; this bound only covers its own death
        ready, _, _ = select.select([_forker.stdout], [], [], timeout + 30)
        line = _forker.stdout.readline() if ready else b""
        if not line:
            _forker.kill()
            raise RuntimeError(f"the forking process gave no answer for {args}")
        return json.loads(line)["rc"], err.read()


def _serve() -> None:
    import tensordict  # noqa: F401 - imported once, before any fork
    import torch  # noqa: F401
    import tqtx.api  # noqa: F401
    from tqtx import faults
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC)
                os.dup2(fd, 2)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                os.environ.update(req["env"])
                faults.configure(req["env"].get("TQTX_FAULTS", ""))
                client_op(req["args"])
                code = 0
            except BaseException:  # noqa: BLE001 - reported as the child's exit code
                import traceback
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + req["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        sys.stdout.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
