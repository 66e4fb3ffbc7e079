"""Command-line usability (issue 12, item 7): ``-h`` everywhere, ``journal show`` readable at
80 columns and in a pipe, ``verify`` / ``inspect`` say plainly when there is no dump."""
from __future__ import annotations

import json
import re
import uuid

import click
import pytest
from click.testing import CliRunner

from tqtx.cli import main
from tqtx.cli.dump import NOT_A_DUMP_EXIT
from tqtx import format as F
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.dump import DumpJournal
from tqtx.schema import infer_schema


@pytest.fixture
def runner():
    return CliRunner()


# --------------------------------------------------------------------------- -h / --help
def _command_paths(cmd: click.Command, path=()):
    yield path
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from _command_paths(sub, (*path, name))


PATHS = list(_command_paths(main))


def test_command_tree_is_walked():
    names = {" ".join(p) for p in PATHS}
    assert {"", "journal", "journal show", "keys init", "verify", "demo", "bench"} <= names


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "tqtx")
def test_every_command_answers_help(runner, path, flag):
    res = runner.invoke(main, [*path, flag], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "usage:" in res.output.lower(), res.output


# --------------------------------------------------------------------------- journal show
@pytest.fixture
def journal_state(tmp_path):
    """A controller journal with long real-looking IDs, a long dump path, a failed unit."""
    state = tmp_path / "state"
    dump = tmp_path / "checkpoints" / "experiment-with-a-long-name" / "step_000100"
    ids = {"ok": uuid.uuid4().hex, "bad": uuid.uuid4().hex, "dump": uuid.uuid4().hex}
    with ControllerJournal(state) as j:
        inc = j.start_incarnation(pid=4242, host="node1", address="tcp://127.0.0.1:5555",
                                  version="0.1.0")
        j.begin_restore(restore_id=ids["ok"], partition_id="train", dump_dir=str(dump),
                        dump_id=ids["dump"], incarnation_id=inc, units=[0, 1], keys=4, rows=8,
                        bytes=64)
        for u in (0, 1):
            j.claim_unit(ids["ok"], u)
            j.stage_unit(ids["ok"], u, rows=4, bytes=32)
        j.decide_commit(ids["ok"])
        for u in (0, 1):
            j.apply_unit(ids["ok"], u)
        j.finish_restore(ids["ok"], "committed")
        j.begin_restore(restore_id=ids["bad"], partition_id="validation", dump_dir=str(dump),
                        dump_id=ids["dump"], incarnation_id=inc, units=[0], keys=1, rows=1,
                        bytes=8)
        j.claim_unit(ids["bad"], 0)
        j.record_dump(dump_id=ids["dump"], dump_dir=str(dump), partition_id="train", keys=4,
                      rows_with_data=8, bytes=64, shards=2, incarnation_id=inc)
    with DumpJournal(dump) as dj:
        dj.begin_publication(attempt_id="a1b2c3d4e5f6", kind="dump", dump_id=ids["dump"],
                             staging_dir=str(dump) + ".tmp-a1b2c3d4e5f6")
        dj.set_phase("a1b2c3d4e5f6", "written")
    return state, dump, ids


def test_journal_show_is_readable_at_80_columns_in_a_pipe(runner, journal_state):
    state, dump, ids = journal_state
    res = runner.invoke(main, ["journal", "show", "--state-dir", str(state)],
                        env={"COLUMNS": "80"}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.output
    assert not re.search(r"[\u2500-\u257f]", out), "table borders in a pipe:\n" + out
    lines = out.splitlines()
    for title in ("restores (2)", "dumps (1)", "publications (1)", "incarnations (1)",
                  "recovery events (0)"):
        assert title in lines
    fields = {}
    for line in lines:
        m = re.fullmatch(r"  (\w+): *(.*)", line)
        if m:
            fields.setdefault(m.group(1), []).append(m.group(2))
        elif line.strip():  # anything else is a heading
            assert line.startswith(("controller journal ", *"rdpib")), line
        if len(line) > 80:  # only a long unbreakable value (a path) may pass 80 columns
            assert " " not in (m.group(2) if m else line.split(" ", 2)[-1]), line
    # every column header, with whole values: IDs and paths are never cut
    assert fields["restore_id"] == [ids["bad"], ids["ok"]]
    assert fields["dump_id"] == [ids["dump"], ids["dump"]]
    assert fields["attempt_id"] == ["a1b2c3d4e5f6"]
    assert fields["dump_dir"].count(str(dump)) == 4
    assert fields["partition_id"] == ["validation", "train", "train"]
    assert fields["state"] == ["active", "committed"]
    assert fields["units"] == ["0:claimed", "0:applied 1:applied"]
    assert fields["phase"] == ["written"]
    assert fields["address"] == ["tcp://127.0.0.1:5555"]
    for col in ("reason", "keys", "rows", "bytes", "created_at", "finished_at", "shards",
                "rows_with_data", "incarnation_id", "kind", "error", "updated_at", "id",
                "started_at", "ended_at", "pid", "host", "version"):
        assert col in fields, col
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", fields["created_at"][0])


def test_journal_show_layouts_and_json_unchanged(runner, journal_state):
    state, _dump, ids = journal_state
    wide = runner.invoke(main, ["journal", "show", "--state-dir", str(state), "--layout",
                                "table"], env={"COLUMNS": "400"}, catch_exceptions=False)
    assert wide.exit_code == 0 and ids["ok"] in wide.output and "┃" in wide.output
    records = runner.invoke(main, ["journal", "show", "--state-dir", str(state), "--layout",
                                   "records"], catch_exceptions=False)
    assert records.exit_code == 0 and f"  restore_id:   {ids['ok']}" in records.output
    as_json = runner.invoke(main, ["journal", "show", "--state-dir", str(state), "--json"],
                            env={"COLUMNS": "80"}, catch_exceptions=False)
    out = json.loads(as_json.output)
    assert [r["restore_id"] for r in out["restores"]] == [ids["bad"], ids["ok"]]


# --------------------------------------------------------------------------- verify / inspect
def _build_dump(d):
    d.mkdir(parents=True)
    (d / F.SHARDS_DIR).mkdir()
    w = F.ShardWriter(d / F.shard_file_name(0))
    w.write_rows([(0, {"x": b"abc"}, 1, "p", "k0")])
    entries = w.close()
    idx = F.write_shard_index(d, 0, entries)
    ri = F.write_row_index(d, partition_id="p", dump_id="d1",
                           field_schema={"x": infer_schema([b"abc"])},
                           rows=[["k0", 0, ["x"], None, 1]])
    F.write_manifest(d, dump_id="d1", partition_id="p", keys=1, rows_with_data=1,
                     bytes=w.bytes_written, row_index=ri,
                     shards=[{"unit": 0, "file": F.shard_file_name(0), "size": w.bytes_written,
                              "records": 1, "index": idx}],
                     writer="units", tqtx_version="0.1.0")
    return d


def _not_dumps(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "with-files").mkdir()
    (tmp_path / "with-files" / "model.pt").write_bytes(b"weights")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    return {"missing": (tmp_path / "nope", "no such dump directory: "),
            "broken-link": (tmp_path / "link", "no such dump directory: "),
            "file": (tmp_path / "a-file", "not a dump directory: "),
            "dir-with-files": (tmp_path / "with-files", "not a tqtx dump: "),
            "empty-dir": (tmp_path / "empty", "not a tqtx dump: ")}


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_no_dump_at_path_is_said_plainly(runner, tmp_path, command):
    for what, (path, said) in _not_dumps(tmp_path).items():
        res = runner.invoke(main, [command, str(path)], catch_exceptions=False)
        assert res.exit_code == NOT_A_DUMP_EXIT, (what, res.output)
        assert f"error: {said}{path}" in res.output, (what, res.output)
        assert "CORRUPT" not in res.output and "records" not in res.output, res.output
        res = runner.invoke(main, [command, "--json", str(path)], catch_exceptions=False)
        assert res.exit_code == NOT_A_DUMP_EXIT, (what, res.output)
        out = json.loads(res.output)
        assert out["ok"] is False and out["error"].startswith(said + str(path)), out
        if command == "verify":  # the verify report's keys are still there
            assert (out["records"], out["bytes"], out["dump_dir"]) == (0, 0, str(path))
            assert [e["error"] for e in out["errors"]] == [out["error"]]
    assert (tmp_path / "with-files" / "model.pt").read_bytes() == b"weights"


def test_verify_and_inspect_still_work_on_a_dump(runner, tmp_path):
    d = _build_dump(tmp_path / "d")
    res = runner.invoke(main, ["verify", str(d)], catch_exceptions=False)
    assert res.exit_code == 0 and res.output.startswith("OK: 1 records"), res.output
    res = runner.invoke(main, ["inspect", "--json", str(d)], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.output)["keys"] == 1
    (d / F.shard_file_name(0)).write_bytes(b"garbage!" * 4)  # damaged: exit 1, not 2
    res = runner.invoke(main, ["verify", str(d)], catch_exceptions=False)
    assert res.exit_code == 1 and "CORRUPT" in res.output
