"""``tqtx shim ...``: make ``import transfer_queue`` resolve to tqtx (opt-in)."""
from __future__ import annotations

import json

import click


@click.group()
def shim() -> None:
    """Install or remove the transfer_queue shim (`import transfer_queue` gives tqtx).

    For frameworks that import TransferQueue by name (verl, NeMo-RL, ROLL): no change in
    their code. Refused while the real TransferQueue is installed (docs/compatibility.md)."""


_TARGET = click.option("--target", type=click.Path(file_okay=False), default=None,
                       help="Directory to write into (default: this interpreter's "
                            "site-packages).")


@shim.command()
@_TARGET
def install(target) -> None:
    """Write the transfer_queue package (an alias of tqtx) into the target."""
    from ..compat.shim import ShimError, install as do_install
    try:
        pkg = do_install(target)
    except ShimError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"installed {pkg}: `import transfer_queue` gives tqtx")


@shim.command()
@_TARGET
def remove(target) -> None:
    """Delete the shim's files (only those tqtx wrote)."""
    from ..compat.shim import ShimError, remove as do_remove
    try:
        gone = do_remove(target)
    except ShimError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"removed {len(gone)} file(s)" if gone else "no shim here")


@shim.command()
@_TARGET
@click.option("--json", "as_json", is_flag=True)
def status(target, as_json) -> None:
    """Whether the shim, or TransferQueue itself, is installed in the target."""
    from ..compat.shim import status as get_status
    info = get_status(target)
    if as_json:
        click.echo(json.dumps(info))
        return
    what = "installed" if info["installed"] else "not installed"
    click.echo(f"transfer_queue shim {what} in {info['target']}")
    if info["transferqueue"]:
        click.echo(f"TransferQueue {info['transferqueue']} is installed there")
