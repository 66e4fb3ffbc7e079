"""``tqtx demo`` and ``tqtx bench``: commands that pass their arguments to their own parsers."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

NO_BENCHMARKS_EXIT = 2


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout this package runs from (it is not installed)."""
    import tqtx
    return Path(tqtx.__file__).resolve().parents[1] / "benchmarks"


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.pass_context
def demo(ctx):
    """The main job: put, dump a subset, restart on another topology, restore, verify."""
    from ..demo import main as demo_main
    sys.exit(demo_main(ctx.args))


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.pass_context
def bench(ctx):
    """Dump/restore benchmark against the client-side path and the disk (see docs).

    Runs ``benchmarks/dump_restore.py`` of the source checkout (an editable install)."""
    script = benchmarks_dir() / "dump_restore.py"
    if not script.is_file():
        click.echo(f"error: tqtx bench needs a source checkout of tqtx (an editable install, "
                   f"pip install -e .): {script} is not there", err=True)
        sys.exit(NO_BENCHMARKS_EXIT)
    spec = importlib.util.spec_from_file_location("dump_restore", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.exit(module.main(ctx.args))
