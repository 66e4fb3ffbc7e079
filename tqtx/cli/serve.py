"""``tqtx serve``, ``tqtx controller``, ``tqtx unit``: run the server processes."""
from __future__ import annotations

import json
import os
import sys

import click


_DURABILITY_HELP = ("memory, controller (default), buffer or sync (docs/reliability.md, "
                    "Durability); default $TQTX_DURABILITY.")
_INTERVAL_HELP = ("Durability buffer: seconds between durable cuts; default "
                  "$TQTX_FLUSH_INTERVAL_S, else 1.0.")


def _durability_env(durability, flush_interval_s, unit_data_dir) -> dict:
    """The TQTX_* variables the options give (checked: a bad value is a usage error)."""
    from .. import durability as dur
    env = {}
    try:
        if durability is not None:
            try:
                env[dur.ENV_DURABILITY] = dur.check(durability, warn=False)
            except ValueError:
                raise ValueError(f"--durability {durability!r}: expected one of "
                                 f"{', '.join(dur.DURABILITY)}") from None
            if env[dur.ENV_DURABILITY] != durability:
                click.echo(f"warning: --durability {durability!r} is deprecated; use "
                           f"{env[dur.ENV_DURABILITY]!r}", err=True)
        if flush_interval_s is not None:
            env[dur.ENV_FLUSH_INTERVAL] = repr(dur.check_interval(flush_interval_s))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if unit_data_dir is not None:
        env[dur.ENV_UNIT_DATA_DIR] = unit_data_dir
    return env


_durability_opt = click.option("--durability", default=None, help=_DURABILITY_HELP)
_interval_opt = click.option("--flush-interval-s", type=float, default=None, help=_INTERVAL_HELP)


@click.command()
@click.option("--units", "num_units", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--port", type=int, default=0, help="Controller port (0 = any free port).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--state-dir", default=None, help="Controller state dir (journal, logs).")
@click.option("--insecure", is_flag=True, help="Allow binding a non-loopback host without keys.")
@_durability_opt
@_interval_opt
@click.option("--unit-data-dir", default=None,
              help="Where units keep their row logs (unit-<k>/ under it); relative to the "
                   "state dir; default $TQTX_UNIT_DATA_DIR, else <state-dir>/units.")
def serve(num_units, port, host, state_dir, insecure, durability, flush_interval_s,
          unit_data_dir):
    """Run a whole deployment (controller + units) in the foreground."""
    import signal
    import threading

    from ..deploy.local import LocalDeployment
    from ..layout.paths import default_state_dir
    env = {"TQTX_INSECURE": "1"} if insecure else {}
    env.update(_durability_env(durability, flush_interval_s, unit_data_dir))
    stop = threading.Event()
    # handlers first: a SIGTERM right after the announcement must still stop gracefully
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    dep = LocalDeployment(num_units=num_units, state_dir=state_dir or str(default_state_dir()),
                          host=host, port=port, env=env)
    click.echo(json.dumps({"address": dep.address, "num_units": num_units,
                           "state_dir": dep.state_dir, "pids": dep.pids,
                           **dep.durability.record(dep.state_dir)}))
    sys.stdout.flush()
    click.echo(f"tqtx serving at {dep.address}; attach with TQTX_ADDRESS={dep.address}",
               err=True)
    while not stop.wait(0.5):
        for name, proc in dep.procs.items():
            if proc.poll() is not None:
                click.echo(f"{name} exited with code {proc.returncode}; stopping", err=True)
                stop.set()
    dep.stop()


@click.command()
@click.option("--units", "num_units", type=click.IntRange(min=1), required=True)
@click.option("--port", type=int, default=0)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--state-dir", default=None)
@click.option("--insecure", is_flag=True)
@_durability_opt
@_interval_opt
def controller(num_units, port, host, state_dir, insecure, durability, flush_interval_s):
    """Run only the controller (units join with `tqtx unit`)."""
    from ..controller.__main__ import main as run
    from ..layout.paths import default_state_dir
    from ..process.servers import controller_args
    if insecure:
        os.environ["TQTX_INSECURE"] = "1"
    os.environ.update(_durability_env(durability, flush_interval_s, None))
    sys.exit(run(controller_args(num_units=num_units, state_dir=state_dir
                                 or str(default_state_dir()), host=host, port=port)))


@click.command()
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
@_durability_opt
@_interval_opt
@click.option("--data-dir", default=None,
              help="The base of this unit's row log directory (unit-<k>/ under it); default "
                   "$TQTX_UNIT_DATA_DIR. Give the controller's setting (--durability).")
def unit(controller_address, unit_id, port, host, keys_dir, node, insecure, durability,
         flush_interval_s, data_dir):
    """Run one storage unit that registers with a controller (see docs/deployment.md)."""
    from ..process.servers import unit_args
    from ..storage.__main__ import main as run
    if insecure:
        os.environ["TQTX_INSECURE"] = "1"
    os.environ.update(_durability_env(durability, flush_interval_s,
                                      os.path.abspath(os.path.expanduser(data_dir))
                                      if data_dir else None))
    if keys_dir:
        os.environ["TQTX_KEYS_DIR"] = os.path.abspath(keys_dir)
    if node:
        os.environ["TQTX_NODE"] = node
    sys.exit(run(unit_args(controller=controller_address, unit_id=unit_id, host=host,
                           port=port)))
