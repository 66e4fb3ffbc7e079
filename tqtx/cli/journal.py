"""``tqtx journal ...``: inspect, recover, migrate and check the tqtx journals.

Each command targets either a controller journal (``--state-dir D``, default
:func:`~tqtx.layout.paths.default_state_dir`) or, given a positional ``DUMP_DIR``, the dump
journal ``<DUMP_DIR>.journal.sqlite``.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import sys
from pathlib import Path

import click
from filelock import FileLock, Timeout
from sqlalchemy.exc import DatabaseError

from ..journal.meta import buffer_summary
from ..errors import TqtxError
from ..journal.migrate import CONTROLLER, DUMP, check_file, migrate
from ..journal.controller import ControllerJournal
from ..journal.dump import DumpJournal
from ..layout.paths import (JOURNAL_SUFFIX, controller_journal_path, controller_lock_path,
                            controller_running, default_state_dir, dump_journal_path,
                            relocated_path, siblings_writable)
from ..states import DUMP_RESTORE_FINAL

RESTORE_KEYS = ("restore_id", "partition_id", "dump_dir", "state", "outcome", "reason", "keys",
                "rows", "bytes", "created_at", "finished_at")
PUBLICATION_KEYS = ("dump_dir", "attempt_id", "kind", "dump_id", "phase", "error", "created_at",
                    "updated_at")
_NO_WRAP = {"restore_id", "attempt_id", "dump_id", "state", "phase", "id"}


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("tqtx")
    except Exception:  # not installed as a distribution
        return "unknown"


def _target(dump_dir: str | None, state_dir: str | None) -> tuple[str, Path, Path]:
    """(kind, target dir, journal path) for the command's arguments.

    With DUMP_DIR, ``--state-dir`` (default: the default state dir) is where the journal of
    a dump on read-only storage is kept (see :func:`tqtx.layout.paths.records_location`): used when
    the dump's directory is read-only, or when there is no journal beside the dump.
    """
    if dump_dir:
        d = Path(os.path.abspath(dump_dir))
        path = dump_journal_path(d)
        moved = relocated_path(state_dir or default_state_dir(), d, JOURNAL_SUFFIX)
        if moved.exists() and (not path.exists() or not siblings_writable(d)):
            path = moved
        return DUMP, d, path
    sd = Path(os.path.abspath(state_dir if state_dir else default_state_dir()))
    return CONTROLLER, sd, controller_journal_path(sd)


def _require(path: Path) -> None:
    if not path.exists():
        click.echo(f"error: no journal at {path}", err=True)
        sys.exit(1)


def _ro_publications(dump_dir: str, limit: int | None, unreadable: list) -> list[dict]:
    """Publications of a dump journal, read-only (never creates or migrates it). A dump
    without a journal has none; one that cannot be read is added to ``unreadable``."""
    path = dump_journal_path(dump_dir)
    if not path.exists():
        return []
    try:
        rows = DumpJournal.read_publications(path, int(limit) if limit else None)
    except sqlite3.Error as exc:
        unreadable.append({"journal": str(path), "error": f"{type(exc).__name__}: {exc}"})
        return []
    return [dict({k: r.get(k) for k in PUBLICATION_KEYS}, dump_dir=str(dump_dir)) for r in rows]


def controller_status(state_dir: Path, incarnations: list[dict]) -> dict:
    """Whether a controller runs on ``state_dir`` (it holds ``controller.lock`` for its whole
    life) and the newest incarnation the journal records: ``{"running": True | False |
    None (cannot tell), "incarnation", "pid", "host", "address", "ended_at"}``."""
    newest = incarnations[0] if incarnations else {}
    out = {k: newest.get(k) for k in ("pid", "host", "address", "ended_at")}
    out["incarnation"] = newest.get("id")
    out["running"] = controller_running(state_dir)
    return out


DEPLOYMENT_KEYS = ("durability", "flush_interval_s", "unit_data_dir", "num_units", "address",
                   "owner_pid", "hostname", "created")


def deployment_record(state_dir: Path) -> dict | None:
    """What the state dir's owner record (``deployment.json``) says its deployment runs or
    ran with, or None without one. The creator removes it at a clean close, so a record
    whose controller no longer runs is that of a deployment that did not close cleanly."""
    from ..deploy.owner import read_record
    rec = read_record(str(state_dir))
    if rec is None:
        return None
    return {k: rec.get(k) for k in DEPLOYMENT_KEYS}


def _reader(cls, target: Path, path: Path | None):
    """The journal opened for reading (:meth:`~tqtx.journal.base._Journal.for_reading`)."""
    return cls.for_reading(target, **({"path": path} if cls is DumpJournal else {}))


def journal_report(kind: str, target: Path, *, restore_id: str | None = None,
                   state: str | None = None, limit: int | None = None,
                   path: Path | None = None) -> dict:
    """The ``journal show --json`` object for an existing journal (a dump journal at
    ``path`` if given, e.g. one kept in a state dir for a read-only dump)."""
    if kind == CONTROLLER:
        with _reader(ControllerJournal, target, path) as j:
            restores = j.list_restores(state=state, restore_id=restore_id, limit=limit)
            dumps = j.list_dumps(limit)
            report = {
                "journal": str(j.path), "kind": CONTROLLER,
                "restores": [dict({k: r[k] for k in RESTORE_KEYS}, units=r["units"])
                             for r in restores],
                "publications": [],
                "incarnations": j.list_incarnations(limit),
                "dumps": dumps,
                "recovery_events": j.list_recovery_events(limit),
                "buffer": buffer_summary(j.engine),
            }
            dirs = dict.fromkeys([d["dump_dir"] for d in dumps] + [r["dump_dir"] for r in restores])
        unreadable: list[dict] = []
        for d in dirs:
            report["publications"].extend(_ro_publications(d, limit, unreadable))
        report["controller"] = controller_status(target, report["incarnations"][:1])
        deployment = deployment_record(target)
        if deployment is not None:
            report["deployment"] = deployment
        if unreadable:
            report["unreadable"] = unreadable
        return report
    with _reader(DumpJournal, target, path) as j:
        restores = []
        for r in j.list_restores(state=state, restore_id=restore_id, limit=limit):
            final = r["state"] in DUMP_RESTORE_FINAL
            restores.append({
                "restore_id": r["restore_id"], "partition_id": r["partition_id"],
                "dump_dir": str(target), "state": r["state"],
                "outcome": r["state"] if final else None, "reason": None, "keys": None,
                "rows": None, "bytes": None, "created_at": r["created_at"],
                "finished_at": r["updated_at"] if final else None, "units": [],
                })
        pubs = [dict({k: p.get(k) for k in PUBLICATION_KEYS}, dump_dir=str(target))
                for p in j.publications(limit)]
        return {"journal": str(j.path), "kind": DUMP, "restores": restores,
                "publications": pubs, "recovery_events": []}


def _cell(col: str, v) -> str:
    if v is None:
        return ""
    if col.endswith("_at") or col == "at":
        return str(v)[:19].replace("T", " ")  # seconds are enough here; --json has it all
    return str(v)


def _sections(report: dict) -> list[tuple[str, list[dict], list[str]]]:
    """``(title, rows, columns)`` of every list ``journal show`` prints."""
    restores = []
    for r in report["restores"]:
        units = " ".join(f"{u['unit_id']}:{u['state']}"
                         + (f"({u['error']})" if u.get("error") else "") for u in r["units"])
        restores.append(dict(r, units=units))
    out = [("restores", restores, ["restore_id", "partition_id", "dump_dir", "state", "reason",
                                   "keys", "rows", "bytes", "units", "created_at",
                                   "finished_at"])]
    if report["kind"] == CONTROLLER:
        out.append(("dumps", report["dumps"], ["dump_id", "dump_dir", "partition_id", "keys",
                                               "rows_with_data", "bytes", "shards",
                                               "incarnation_id", "created_at"]))
    out.append(("publications", report["publications"], ["dump_dir", "attempt_id", "kind",
                                                         "dump_id", "phase", "error",
                                                         "updated_at"]))
    if report["kind"] == CONTROLLER:
        out.append(("incarnations", report["incarnations"], ["id", "started_at", "ended_at",
                                                             "pid", "host", "address",
                                                             "version"]))
        out.append(("recovery events", report["recovery_events"], ["id", "incarnation_id", "at",
                                                                   "kind", "target", "action",
                                                                   "detail"]))
        out.append(("buffer (journaled metadata)", report.get("buffer") or [],
                    ["partition_id", "keys", "lost_rows"]))
    return out


def _echo_records(title: str, rows: list[dict], cols: list[str]) -> None:
    """One block of ``column: value`` lines per row: readable at any width and in a pipe
    (values are never wrapped, so IDs and paths stay whole for grep and copy)."""
    click.echo(f"\n{title} ({len(rows)})")
    pad = max(map(len, cols)) + 1
    for i, r in enumerate(rows):
        if i:
            click.echo("")
        for c in cols:
            click.echo(f"  {c + ':':<{pad}} {_cell(c, r.get(c))}".rstrip())


def print_report(report: dict, layout: str = "auto") -> None:
    """Print a :func:`journal_report` for people.

    ``layout``: ``"table"`` (rich tables), ``"records"`` (one block per row) or ``"auto"``:
    a table where it fits the terminal without squeezing, records when stdout is not a
    terminal (a pipe or a file) or the table is wider than the terminal.
    """
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    tty = sys.stdout.isatty()
    console = Console()
    click.echo(f"{report['kind']} journal {report['journal']}")
    for title, rows, cols in _sections(report):
        t = Table(title=f"{title} ({len(rows)})", title_justify="left")
        for c in cols:
            t.add_column(c, overflow="fold", no_wrap=c in _NO_WRAP)
        for r in rows:
            t.add_row(*(_cell(c, r.get(c)) for c in cols))
        natural = Measurement.get(console, console.options.update_width(1 << 16), t).maximum
        if layout == "table" or (layout == "auto" and tty and natural <= console.width):
            console.print(t)
        else:
            _echo_records(title, rows, cols)


_dump_arg = click.argument("dump_dir", required=False, type=click.Path())
_state_opt = click.option("--state-dir", type=click.Path(),
                          help="Controller state dir (default: $TQTX_STATE_DIR, else "
                               "$XDG_STATE_HOME/tqtx/default or ~/.local/state/tqtx/default).")
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


@click.group("journal", context_settings={"help_option_names": ["-h", "--help"]})
def journal() -> None:
    """Inspect, recover, migrate and check tqtx journals."""


@journal.command("show")
@_dump_arg
@_state_opt
@_json_opt
@click.option("--restore", "restore_id", help="Only this restore.")
@click.option("--state", help="Only restores in this state.")
@click.option("--limit", type=click.IntRange(min=1), help="At most N rows per list.")
@click.option("--layout", type=click.Choice(["auto", "table", "records"]), default="auto",
              show_default=True,
              help="Tables, or one 'column: value' block per row; auto uses tables only on "
                   "a terminal wide enough for them.")
def show(dump_dir, state_dir, as_json, restore_id, state, limit, layout) -> None:
    """Show a controller journal (or the journal of DUMP_DIR)."""
    kind, target, path = _target(dump_dir, state_dir)
    _require(path)
    try:
        report = journal_report(kind, target, restore_id=restore_id, state=state, limit=limit,
                                path=path)
    except (TqtxError, OSError, sqlite3.Error, DatabaseError) as exc:
        error = f"cannot read the {kind} journal {path}: {exc}"
        if as_json:
            click.echo(json.dumps({"journal": str(path), "kind": kind, "error": error}))
        else:
            click.echo(f"error: {error}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report, layout)
        _echo_controller(report.get("controller"))
        _echo_deployment(report.get("deployment"), report.get("controller"))
    for bad in report.get("unreadable", []):
        click.echo(f"error: cannot read the dump journal {bad['journal']}: {bad['error']}",
                   err=True)
    if report.get("unreadable"):
        sys.exit(1)


def _echo_controller(status: dict | None) -> None:
    """The ``running controller`` block of ``journal show`` (one ``field: value`` a line)."""
    if not status or status.get("incarnation") is None:
        return
    running = {True: "yes", False: "no", None: "cannot tell (read-only state dir)"}
    click.echo("\nrunning controller")
    click.echo(f"  running:     {running[status['running']]}")
    click.echo(f"  incarnation: {status['incarnation']} (pid {status.get('pid')} on "
               f"{status.get('host')} at {status.get('address')})")
    if status["running"] is False and not status.get("ended_at"):
        click.echo("  note:        did not end cleanly; the next controller replays the journal")


def _echo_deployment(rec: dict | None, status: dict | None) -> None:
    """The ``deployment`` block of ``journal show``: the setting from ``deployment.json``."""
    if rec is None:
        return
    running = (status or {}).get("running")
    click.echo("\ndeployment (deployment.json)")
    click.echo(f"  durability:     {rec.get('durability') or 'not recorded'}"
               + (f" (flush every {rec['flush_interval_s']:g} s)"
                  if rec.get("durability") == "buffer" and rec.get("flush_interval_s") else ""))
    if rec.get("unit_data_dir"):
        click.echo(f"  unit data dir:  {rec['unit_data_dir']}")
    click.echo(f"  created by:     pid {rec.get('owner_pid')} on {rec.get('hostname')} "
               f"({rec.get('num_units')} units at {rec.get('address')})")
    if running is False:
        click.echo("  note:           its creator did not close it (a clean close removes "
                   "this record)")


def _echo_actions(actions: list[dict], as_json: bool, extra: dict) -> None:
    if as_json:
        click.echo(json.dumps(dict(extra, actions=actions), indent=2))
        return
    if not actions:
        click.echo("nothing to recover")
    for a in actions:
        click.echo(f"{a['kind']} {a['target']}: {a['action']} -- {a['detail']}")


@journal.command("recover")
@_dump_arg
@_state_opt
@_json_opt
def recover(dump_dir, state_dir, as_json) -> None:
    """Run crash recovery by hand (the controller does this at startup)."""
    from ..controller.startup import recover_controller_journal
    from ..journal.publish import dump_lock, recover_publications

    kind, target, path = _target(dump_dir, state_dir)
    if kind == DUMP:
        if siblings_writable(target):
            with dump_lock(target):
                actions = recover_publications(target)
        else:
            actions = []  # read-only storage: nothing was published there, nothing to settle
        _echo_actions(actions, as_json, {"journal": str(path), "kind": kind})
        return
    _require(path)
    lock = FileLock(os.fspath(controller_lock_path(target)), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        click.echo(f"error: a live controller holds {controller_lock_path(target)}; "
                   f"it recovers its journal itself", err=True)
        sys.exit(1)
    try:
        with ControllerJournal(target) as j:
            inc = j.start_incarnation(pid=os.getpid(), host=socket.gethostname(),
                                      address="cli", version=_version())
            try:
                actions = recover_controller_journal(j, incarnation_id=inc, keep_committing=True)
            finally:
                j.end_incarnation(inc)
    finally:
        lock.release()
    _echo_actions(actions, as_json, {"journal": str(path), "kind": kind, "incarnation_id": inc})


@journal.command("migrate")
@_dump_arg
@_state_opt
def migrate_cmd(dump_dir, state_dir) -> None:
    """Upgrade an existing journal to the newest schema."""
    kind, _target_dir, path = _target(dump_dir, state_dir)
    _require(path)
    before, after = migrate(path, kind)
    if before == after:
        click.echo(f"{path}: already at {after}")
    else:
        click.echo(f"{path}: {before or 'empty'} -> {after}")


def check_journal(path: Path, kind: str) -> dict:
    """Integrity, foreign-key and revision checks on a journal file (read-only)."""
    checks = check_file(path, kind)
    problems = checks.pop("problems")
    return {"journal": str(path), "kind": kind, **checks, "ok": not problems,
            "problems": problems}


@journal.command("check")
@_dump_arg
@_state_opt
@_json_opt
def check(dump_dir, state_dir, as_json) -> None:
    """Check integrity, foreign keys and schema revision; exit 1 on problems."""
    kind, _target_dir, path = _target(dump_dir, state_dir)
    _require(path)
    result = check_journal(path, kind)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"{path} ({kind}): revision {result['revision']} (head {result['head']})")
        for p in result["problems"]:
            click.echo(f"problem: {p}")
        click.echo("ok" if result["ok"] else "FAILED")
    if not result["ok"]:
        sys.exit(1)
