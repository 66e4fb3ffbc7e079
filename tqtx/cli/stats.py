"""``tqtx stats``: per-process statistics of a running deployment."""
from __future__ import annotations

import json
import os

import click


@click.command()
@click.option("--address", default=None, help="Controller address (default $TQTX_ADDRESS).")
@click.option("--keys-dir", default=None,
              help="Key dir of a CURVE deployment (default $TQTX_KEYS_DIR).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--lost", is_flag=True,
              help="Also name every key whose row was lost (partition, key, unit, fields).")
def stats(address, keys_dir, as_json, lost):
    """Per-process statistics: uptime, rows, bytes, open restores, requests by type.

    ``--json`` prints one object ``{"controller": {...}, "units": [...], "client": {...}}``
    (with ``--lost`` also ``"lost_keys": {partition: {key: {"unit", "fields", "tag"}}}``;
    see docs/operations.md)."""
    from ..client import Client
    address = address or os.environ.get("TQTX_ADDRESS")
    if not address:
        raise click.UsageError("give --address or set TQTX_ADDRESS")
    from ..security import attach_curve
    client = Client(address, timeout=30, curve=attach_curve(address, keys_dir=keys_dir))
    try:
        data = client.stats()
        if lost:
            data["lost_keys"] = client.call_controller("LIST", {"lost": True},
                                                       what="listing lost keys")
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    from ..metrics import render_stats
    render_stats(data)
