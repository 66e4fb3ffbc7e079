"""The ``tqtx`` command line: run deployments, inspect dumps, audit journals, demo, bench.

One module per command group: :mod:`.serve` (serve, controller, unit), :mod:`.keys`,
:mod:`.dump` (inspect, verify), :mod:`.journal`, :mod:`.stats`, :mod:`.shim`,
:mod:`.demo_bench`.
"""
from __future__ import annotations

import click

from .. import __version__
from .demo_bench import bench, demo
from .dump import inspect, verify
from .journal import journal
from .keys import keys
from .serve import controller, serve, unit
from .shim import shim
from .stats import stats

# -h everywhere; subcommands inherit it (demo and bench pass their arguments, -h included,
# to their own argparse parsers).
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=HELP_OPTIONS)
@click.version_option(__version__, prog_name="tqtx")
def main() -> None:
    """tqtx: transactional save/restore for RL data buffers."""


for _command in (journal, serve, controller, unit, keys, inspect, verify, stats, shim, demo,
                 bench):
    main.add_command(_command)
