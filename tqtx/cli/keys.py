"""``tqtx keys ...``: CURVE keys for deployments on a network (docs/security.md)."""
from __future__ import annotations

import json

import click


@click.group()
def keys():
    """CURVE keys for deployments bound to a non-loopback address (docs/security.md)."""


@keys.command("init")
@click.option("--state-dir", required=True, help="Deployment state dir; keys go to <state-dir>/keys.")
@click.option("--force", is_flag=True, help="Replace existing keys (clients must get the new ones).")
def keys_init(state_dir, force):
    """Create the server keypair and an authorized client keypair."""
    from ..wire.security import init_keys
    try:
        info = init_keys(state_dir, force=force)
    except FileExistsError as exc:
        raise click.ClickException(str(exc))
    click.echo(json.dumps({"keys_dir": info["keys_dir"], "server_key": info["server_key"],
                           "client_secret": info["client_secret"],
                           "authorized": info["authorized"]}, indent=2))
    import shlex
    click.echo(f"clients attach with TQTX_SERVER_KEY={shlex.quote(info['server_key'])} and "
               f"TQTX_CLIENT_KEY={info['client_secret']} (or TQTX_KEYS_DIR={info['keys_dir']})",
               err=True)
