"""``tqtx stats``: per-process statistics of a running deployment.

It prints what it can reach and names what it cannot: a dead unit does not cost the
controller's and the other units' statistics, a dead or silent controller is named within
the connect timeout. Anything unreachable makes the exit code 1 (no traceback).
"""
from __future__ import annotations

import json
import os
import sys

import click

EXIT_UNREACHABLE = 1


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def gather(address: str, *, curve=None, timeout: float = 30.0,
           connect_timeout: float | None = None, lost: bool = False) -> dict:
    """``{"controller", "units", "client"}`` as ``Client.stats()`` gives them; a process
    that did not answer is ``{"role", "unit_id", "address", "error"}`` and is named in
    ``"unreachable"`` (a list, present only when one is). ``lost``: also ``"lost_keys"``
    (the controller's ``LIST`` of lost keys)."""
    from ..wire.peer import CONNECT_TIMEOUT, Peer, call_many
    wait = CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
    out: dict = {"controller": None, "units": []}
    unreachable: list[str] = []
    peers = [Peer(address, "controller", timeout=timeout, curve=curve, connect_timeout=wait)]
    try:
        ctl = peers[0]
        try:
            out["controller"] = ctl.call("GET_STATS")
            units = ctl.call("TOPOLOGY")["units"]
            if lost:
                out["lost_keys"] = ctl.call("LIST", {"lost": True})
        except Exception as exc:  # noqa: BLE001 - named, never a traceback
            out["controller"] = {"role": "controller", "unit_id": None, "address": address,
                                 "error": _error(exc)}
            unreachable.append(f"controller at {address}: {_error(exc)}; its units are "
                               f"unknown")
            units = []
        calls, where = [], []
        for uid, addr in enumerate(units):
            if addr is None:
                out["units"].append({"role": "unit", "unit_id": uid, "address": None,
                                     "error": "not registered with the controller"})
                unreachable.append(f"unit {uid}: not registered with the controller")
                continue
            peer = Peer(addr, f"unit {uid}", timeout=timeout, curve=curve, connect_timeout=wait)
            peers.append(peer)
            calls.append((peer, "GET_STATS", {}))
            where.append((uid, addr, len(out["units"])))
            out["units"].append(None)
        for (uid, addr, pos), got in zip(where, call_many(calls, raise_first=False)):
            if isinstance(got, BaseException):
                got = {"role": "unit", "unit_id": uid, "address": addr, "error": _error(got)}
                unreachable.append(f"unit {uid} at {addr}: {got['error']}")
            out["units"][pos] = got
    finally:
        for p in peers:
            p.close()
    counts = {k: {"calls": 0, "rows": 0, "bytes": 0} for k in ("puts", "gets", "dumps",
                                                                 "restores")}
    out["client"] = {"role": "client", "pid": os.getpid(), "address": address, **counts}
    if unreachable:
        out["unreachable"] = unreachable
    return out


@click.command()
@click.option("--address", default=None, help="Controller address (default $TQTX_ADDRESS).")
@click.option("--keys-dir", default=None,
              help="Key dir of a CURVE deployment (default $TQTX_KEYS_DIR).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds to wait for each process's reply.")
@click.option("--lost", is_flag=True,
              help="Also name every key whose row was lost (partition, key, unit, fields).")
def stats(address, keys_dir, as_json, timeout, lost):
    """Per-process statistics: uptime, rows, bytes, open restores, requests by type.

    ``--json`` prints one object ``{"controller": {...}, "units": [...], "client": {...}}``
    (with ``--lost`` also ``"lost_keys": {partition: {key: {"unit", "fields", "tag"}}}``;
    see docs/operations.md). A process that cannot be reached is listed with its
    ``error`` and named under ``"unreachable"``; the exit code is then 1."""
    address = address or os.environ.get("TQTX_ADDRESS")
    if not address:
        raise click.UsageError("give --address or set TQTX_ADDRESS")
    from ..wire.security import attach_curve
    try:
        curve = attach_curve(address, keys_dir=keys_dir)
    except (OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    data = gather(address, curve=curve, timeout=timeout, lost=lost)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        from ..metrics import render_stats
        render_stats(data)
    for line in data.get("unreachable", []):
        click.echo(f"error: {line}", err=True)
    if data.get("unreachable"):
        sys.exit(EXIT_UNREACHABLE)
