"""The ``tqtx`` command line: run deployments, inspect dumps, audit journals, demo, bench."""
from __future__ import annotations

import json
import os
import sys

import click

from . import __version__


# -h everywhere; subcommands inherit it (demo and bench pass their arguments, -h included,
# to their own argparse parsers).
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=HELP_OPTIONS)
@click.version_option(__version__, prog_name="tqtx")
def main() -> None:
    """tqtx: transactional save/restore for RL data buffers."""


def _journal_group():
    from .journal.cli import journal
    return journal


main.add_command(_journal_group())


# ---------------------------------------------------------------- processes
@main.command()
@click.option("--units", "num_units", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--port", type=int, default=0, help="Controller port (0 = any free port).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--state-dir", default=None, help="Controller state dir (journal, logs).")
@click.option("--insecure", is_flag=True, help="Allow binding a non-loopback host without keys.")
def serve(num_units, port, host, state_dir, insecure):
    """Run a whole deployment (controller + units) in the foreground."""
    import signal
    import threading

    from .deploy import LocalDeployment
    from .journal.store import default_state_dir
    env = {"TQTX_INSECURE": "1"} if insecure else {}
    stop = threading.Event()
    # handlers first: a SIGTERM right after the announcement must still stop gracefully
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    dep = LocalDeployment(num_units=num_units, state_dir=state_dir or str(default_state_dir()),
                          host=host, port=port, env=env)
    click.echo(json.dumps({"address": dep.address, "num_units": num_units,
                           "state_dir": dep.state_dir, "pids": dep.pids}))
    sys.stdout.flush()
    click.echo(f"tqtx serving at {dep.address}; attach with TQTX_ADDRESS={dep.address}",
               err=True)
    while not stop.wait(0.5):
        for name, proc in dep.procs.items():
            if proc.poll() is not None:
                click.echo(f"{name} exited with code {proc.returncode}; stopping", err=True)
                stop.set()
    dep.stop()


@main.command()
@click.option("--units", "num_units", type=click.IntRange(min=1), required=True)
@click.option("--port", type=int, default=0)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--state-dir", default=None)
@click.option("--insecure", is_flag=True)
def controller(num_units, port, host, state_dir, insecure):
    """Run only the controller (units join with `tqtx unit`)."""
    from .controller.__main__ import main as run
    from .journal.store import default_state_dir
    if insecure:
        os.environ["TQTX_INSECURE"] = "1"
    sys.exit(run(["--units", str(num_units), "--port", str(port), "--host", host,
                  "--state-dir", state_dir or str(default_state_dir())]))


@main.command()
@click.option("--controller", "controller_address", required=True, help="tcp://host:port")
@click.option("--unit-id", type=int, required=True)
@click.option("--port", type=int, default=0)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind and announce (this host's address on the controller's network).")
@click.option("--keys-dir", default=None,
              help="The deployment's key dir (a copy of <state-dir>/keys); default $TQTX_KEYS_DIR.")
@click.option("--node", default=None,
              help="Node name reported by `tqtx stats` and in errors (default: the hostname).")
@click.option("--insecure", is_flag=True)
def unit(controller_address, unit_id, port, host, keys_dir, node, insecure):
    """Run one storage unit that registers with a controller (see docs/deployment.md)."""
    from .storage.__main__ import main as run
    if insecure:
        os.environ["TQTX_INSECURE"] = "1"
    if keys_dir:
        os.environ["TQTX_KEYS_DIR"] = os.path.abspath(keys_dir)
    if node:
        os.environ["TQTX_NODE"] = node
    sys.exit(run(["--controller", controller_address, "--unit-id", str(unit_id), "--port",
                  str(port), "--host", host]))


# ---------------------------------------------------------------- access control
@main.group()
def keys():
    """CURVE keys for deployments bound to a non-loopback address (docs/security.md)."""


@keys.command("init")
@click.option("--state-dir", required=True, help="Deployment state dir; keys go to <state-dir>/keys.")
@click.option("--force", is_flag=True, help="Replace existing keys (clients must get the new ones).")
def keys_init(state_dir, force):
    """Create the server keypair and an authorized client keypair."""
    from .security import init_keys
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


# ---------------------------------------------------------------- dumps
NOT_A_DUMP_EXIT = 2  # no dump at that path at all; 1 means a dump that is damaged


def _not_a_dump(dump_dir) -> str | None:
    """Why ``dump_dir`` holds no dump at all (missing, a file, no manifest), else None."""
    from .dump.format import MANIFEST
    if not os.path.exists(dump_dir):  # a dangling symlink included
        return f"no such dump directory: {dump_dir}"
    if not os.path.isdir(dump_dir):
        return f"not a dump directory: {dump_dir} is not a directory"
    if not os.path.lexists(os.path.join(dump_dir, MANIFEST)):
        return (f"not a tqtx dump: {dump_dir} has no {MANIFEST} (not a dump, or an "
                f"unfinished one)")
    return None


def _refuse_not_a_dump(dump_dir, as_json, verify_report: bool = False) -> None:
    """Exit 2 with a one-line reason when there is no dump at ``dump_dir``.

    ``--json`` prints ``{"ok": false, "error": reason}``; for verify, also the keys of its
    report (no records, the reason as the only error)."""
    problem = _not_a_dump(dump_dir)
    if problem is None:
        return
    if as_json:
        out = {"ok": False, "error": problem}
        if verify_report:
            out.update(dump_dir=str(dump_dir), records=0, bytes=0, errors=[
                {"file": str(dump_dir), "global_index": None, "key": None, "error": problem}])
        click.echo(json.dumps(out))
    else:
        click.echo(f"error: {problem}", err=True)
    sys.exit(NOT_A_DUMP_EXIT)


def _read_dump(reader, dump_dir, as_json):
    """Run ``reader(dump_dir)``; an unreadable dump prints the error and exits 1."""
    from .errors import DumpFormatError
    try:
        return reader(dump_dir)
    except (DumpFormatError, OSError) as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "error": str(exc)}))
        else:
            click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@main.command()
@click.argument("dump_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def inspect(dump_dir, as_json):
    """Summarize a dump: partition, keys, fields, shards, sample tags (reads no payload)."""
    from .dump.format import inspect_dump
    _refuse_not_a_dump(dump_dir, as_json)
    info = _read_dump(inspect_dump, dump_dir, as_json)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table
    con = Console()
    con.print(f"[bold]dump[/bold] {info.get('dump_dir', dump_dir)}")
    for k in ("partition_id", "dump_id", "format_version", "created_at", "keys",
              "rows_with_data", "bytes"):
        if k in info:
            con.print(f"  {k}: {info[k]}")
    t = Table("field", "kind", "dtype", "shape", "jagged", title="fields")
    for name, f in (info.get("fields") or {}).items():
        t.add_row(name, str(f.get("kind")), str(f.get("dtype", "")), str(f.get("shape", "")),
                  str(f.get("jagged", "")))
    con.print(t)
    t = Table("file", "size", "records", title="shards")
    for s in info.get("shards") or []:
        t.add_row(str(s.get("file")), str(s.get("size")), str(s.get("records")))
    con.print(t)
    for item in info.get("sample_tags") or []:
        con.print(f"  tag of {item['key']!r}: {item['tag']}")


@main.command()
@click.argument("dump_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def verify(dump_dir, as_json):
    """Check every record's range and checksum; exit 1 naming the failing file/row."""
    from .dump.format import verify_dump
    _refuse_not_a_dump(dump_dir, as_json, verify_report=True)
    report = _read_dump(verify_dump, dump_dir, as_json)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        status = "OK" if report["ok"] else "CORRUPT"
        click.echo(f"{status}: {report['records']} records, {report['bytes']} bytes in {dump_dir}")
        for e in report["errors"]:
            click.echo(f"  {e.get('file')}: global index {e.get('global_index')} "
                       f"key {e.get('key')!r}: {e.get('error')}")
    sys.exit(0 if report["ok"] else 1)


# ---------------------------------------------------------------- operators
@main.command()
@click.option("--address", default=None, help="Controller address (default $TQTX_ADDRESS).")
@click.option("--keys-dir", default=None,
              help="Key dir of a CURVE deployment (default $TQTX_KEYS_DIR).")
@click.option("--json", "as_json", is_flag=True)
def stats(address, keys_dir, as_json):
    """Per-process statistics: uptime, rows, bytes, open restores, requests by type.

    ``--json`` prints one object ``{"controller": {...}, "units": [...], "client": {...}}``
    (see docs/operations.md)."""
    from .client import Client
    address = address or os.environ.get("TQTX_ADDRESS")
    if not address:
        raise click.UsageError("give --address or set TQTX_ADDRESS")
    from .security import attach_curve
    client = Client(address, timeout=30, curve=attach_curve(address, keys_dir=keys_dir))
    try:
        data = client.stats()
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    from .metrics import render_stats
    render_stats(data)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.pass_context
def demo(ctx):
    """The main job: put, dump a subset, restart on another topology, restore, verify."""
    from .demo import main as demo_main
    sys.exit(demo_main(ctx.args))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.pass_context
def bench(ctx):
    """Dump/restore benchmark against the client-side path and the disk (see docs)."""
    from .bench import main as bench_main
    sys.exit(bench_main(ctx.args))


if __name__ == "__main__":
    main()
