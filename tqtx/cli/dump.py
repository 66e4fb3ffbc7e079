"""``tqtx inspect`` and ``tqtx verify``: read a dump on disk (no deployment needed)."""
from __future__ import annotations

import json
import os
import sys

import click

NOT_A_DUMP_EXIT = 2  # no dump at that path at all; 1 means a dump that is damaged


def _not_a_dump(dump_dir) -> str | None:
    """Why ``dump_dir`` holds no dump at all (missing, a file, no manifest), else None."""
    from ..format import MANIFEST
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


def _manifest(dump_dir) -> dict | None:
    """The dump's manifest as plain JSON, or None if even that cannot be read."""
    from ..format import MANIFEST
    try:
        with open(os.path.join(dump_dir, MANIFEST)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _read_dump(reader, dump_dir, as_json, *, partial: bool = False):
    """Run ``reader(dump_dir)``; an unreadable dump prints the error and exits 1. With
    ``partial`` (inspect), what its manifest says is printed first, when it can be read."""
    from ..errors import DumpFormatError
    try:
        return reader(dump_dir)
    except (DumpFormatError, OSError) as exc:
        manifest = _manifest(dump_dir) if partial else None
        if as_json:
            out = {"ok": False, "error": str(exc)}
            if manifest is not None:
                out["manifest"] = manifest
            click.echo(json.dumps(out, default=str))
        else:
            if manifest is not None:
                click.echo(f"dump {dump_dir} (damaged; what its manifest says:)")
                for k in ("partition_id", "dump_id", "format_version", "created_at", "keys",
                          "rows_with_data", "bytes"):
                    if k in manifest:
                        click.echo(f"  {k}: {manifest[k]}")
            click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@click.command()
@click.argument("dump_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def inspect(dump_dir, as_json):
    """Summarize a dump: partition, keys, fields, shards, sample tags (reads no payload)."""
    from ..format import inspect_dump
    _refuse_not_a_dump(dump_dir, as_json)
    info = _read_dump(inspect_dump, dump_dir, as_json, partial=True)
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


@click.command()
@click.argument("dump_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def verify(dump_dir, as_json):
    """Check every record's range and checksum; exit 1 naming the failing file/row."""
    from ..format import verify_dump
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
