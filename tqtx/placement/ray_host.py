"""The Ray actor that owns one server process (a controller or a storage unit) on its node.

The actor is only a handle for Ray's scheduler and lifetime: the server itself is the
ordinary ``python -m tqtx.controller`` / ``python -m tqtx.storage`` process (torch-free,
Ray-free), started by the actor with the read end of a pipe whose write end only the
actor holds. When the actor's worker process ends for any reason (``ray.kill``, its
owner -- the creating driver -- exiting or being killed, its node leaving the cluster),
the pipe closes and the server exits (:func:`tqtx.process.servers.watch_parent`), exactly like the
children of the embedded deployment.

The controller's actor is also the deployment's discovery record: a named actor in the
``tqtx`` namespace whose :meth:`ServerHost.get_record` gives any process of the Ray job
the addresses and keys it needs to attach.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from ..durability import ENV_UNIT_DATA_DIR


class ServerHost:
    """One server process owned by this actor (wrap with ``ray.remote`` to use)."""

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None
        self._parent_w: int | None = None
        self.keys_dir: str | None = None
        self.record: dict | None = None

    def where(self) -> dict:
        """This actor's node: ``{"node_id", "ip", "hostname", "pid"}`` (answers once scheduled)."""
        import socket

        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
                "pid": os.getpid()}

    def start(self, args: list[str], env: dict, key_files: dict | None, log_file: str | None,
              timeout: float) -> dict:
        """Start the server: ``{host}`` in ``args`` becomes this node's IP. Returns its
        announcement (``ready`` address or ``error``) plus ``pid`` and the node."""
        from ..deploy.local import _read_announcement
        from ..errors import TqtxError

        where = self.where()
        env = {**os.environ, **env, "TQTX_NODE": where["node_id"]}
        data_dir = env.get(ENV_UNIT_DATA_DIR)
        if data_dir:  # "~": this node's home directory
            env[ENV_UNIT_DATA_DIR] = os.path.abspath(os.path.expanduser(data_dir))
        if key_files:
            self.keys_dir = write_key_files(key_files)
            env["TQTX_KEYS_DIR"] = self.keys_dir
        if log_file is None:  # a node other than the controller's: a node-local log dir
            log_dir = os.path.join(tempfile.gettempdir(), f"tqtx-logs-{os.getuid()}")
            log_file = os.path.join(log_dir, f"{self.name.replace(' ', '-')}-{os.getpid()}.log")
        args = [a.replace("{host}", where["ip"]) for a in args]
        read_fd, self._parent_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, *args, "--log-file", log_file, "--parent-fd", str(read_fd)],
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, pass_fds=(read_fd,))
        finally:
            os.close(read_fd)
        pid = self.proc.pid  # stop() below forgets the process
        try:
            msg = _read_announcement(self.proc, f"{self.name} on node {where['node_id'][:8]}",
                                     timeout)
        except TqtxError as exc:
            self.stop(graceful=False)
            msg = {"error": "TqtxError", "message": str(exc)}
        finally:
            # A server reads its keys while starting: none stay on the node, even if this
            # actor is later killed without stop()
            self._remove_keys()
        return {**msg, "pid": pid, "log_file": log_file, **{
            k: v for k, v in where.items() if k != "pid"}}

    def poll(self):
        """The server's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL); returns its exit code."""
        from ..process.servers import stop_child

        proc, self.proc = self.proc, None
        rc = None if proc is None else stop_child(proc, graceful=graceful, timeout=timeout)
        if self._parent_w is not None:
            os.close(self._parent_w)
            self._parent_w = None
        self._remove_keys()
        return rc

    def _remove_keys(self) -> None:
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
            self.keys_dir = None

    # ---------------------------------------------------------------- discovery
    def set_record(self, record: dict | None) -> None:
        self.record = record

    def get_record(self) -> dict | None:
        return self.record


def read_key_files(keys_dir: str) -> dict:
    """A ``tqtx keys init`` key dir as ``{relative path: text}`` (to recreate it elsewhere)."""
    out = {}
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret"):
        with open(os.path.join(keys_dir, name)) as f:
            out[name] = f.read()
    authorized = os.path.join(keys_dir, "authorized")
    for name in sorted(os.listdir(authorized)):
        if name.endswith(".key"):
            with open(os.path.join(authorized, name)) as f:
                out[f"authorized/{name}"] = f.read()
    return out


def write_key_files(files: dict) -> str:
    """Recreate a key dir from :func:`read_key_files` in a fresh private temp dir."""
    keys_dir = tempfile.mkdtemp(prefix="tqtx-keys-")  # mode 0700
    os.makedirs(os.path.join(keys_dir, "authorized"), mode=0o700)
    for rel, text in files.items():
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"key file name {rel!r} is not a plain relative name")
        path = os.path.join(keys_dir, rel)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return keys_dir
