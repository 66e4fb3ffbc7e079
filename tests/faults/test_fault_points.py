"""The crash matrix and the code name the same fault points.

Every point crash_table.py names is a ``faults.hit(...)`` site in tqtx/ (a renamed or removed
site would leave a matrix case that never fires), and every site is in the matrix or in
:data:`NOT_IN_MATRIX` with the reason it is left out. Sites built from f-strings expand from
what the code registers: ``{role}.request.{op}`` / ``{role}.reply.{op}`` (tqtx/wire/rpc.py)
over the ops each server adds, ``controller.meta.{op}.<stage>`` over the ops passed to
``journal_meta``. No process is started: the source is read with :mod:`ast`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from crash_table import BACKGROUND_DUMP, DUMP, META, RESTORE, RESTORE_ABORT, ROWLOG

PKG = Path(__file__).resolve().parents[2] / "tqtx"

# which server package registers the ops of which role (the Server's name up to "-")
SERVER_PACKAGES = {"controller": "controller", "unit": "storage"}

# Points no crash-matrix case arms, each with the reason. A point here must be a real site
# and must not also be in the matrix (both are checked).
_READS = "a read: it changes nothing, so a crash or a lost reply there is a failed call"
_PUTS = ("a put, clear or checkpoint: their crash points are the controller.meta.* points of "
         "the matrix (the journal transaction decides), and tests/e2e/test_row_fence.py arms "
         "the client side")
_OPERATOR = "operator and lifecycle requests, not part of a dump, restore or metadata write"
_STREAM = "TransferQueue's streaming and consumption bookkeeping, held in memory only"
NOT_IN_MATRIX: dict[str, str] = {
    **{f"controller.{kind}.{op}": _READS for kind in ("request", "reply") for op in (
        "PING", "TOPOLOGY", "LOOKUP", "LIST", "LIST_RESTORES", "GET_RESTORE",
        "CHECKPOINT_SNAPSHOT", "CHECKPOINT_CHECK", "STATS", "GET_STATS", "KV_META", "KV_KEYS",
        "CONSUMPTION", "PRODUCTION", "PARTITIONS", "VALIDATE_DUMP_SCHEMA")},
    **{f"unit.{kind}.{op}": _READS for kind in ("request", "reply") for op in (
        "PING", "GET_ROWS", "GET_INTO", "STATS", "GET_STATS", "PROBE_PATH")},
    **{f"controller.{kind}.{op}": _PUTS for kind in ("request", "reply") for op in (
        "ALLOC", "COMMIT_PUT", "ABORT_PUT", "CLEAR", "CHECKPOINT_REPLACE")},
    **{f"unit.{kind}.{op}": _PUTS for kind in ("request", "reply") for op in (
        "PUT_ROWS", "DROP_ROWS", "SAVE_CHECKPOINT", "LOAD_CHECKPOINT", "APPLY_CHECKPOINT",
        "DROP_CHECKPOINT")},
    **{f"controller.{kind}.{op}": _OPERATOR for kind in ("request", "reply") for op in (
        "REGISTER_UNIT", "END_BUFFER", "SHUTDOWN", "DATAPLANE_OPTIONS")},
    **{f"unit.{kind}.{op}": _OPERATOR for kind in ("request", "reply") for op in ("SHUTDOWN",)},
    **{f"controller.{kind}.{op}": _STREAM for kind in ("request", "reply") for op in (
        "STREAM_META", "RESET_CONSUMPTION")},
    "unit.reply.DUMP_WAIT": "the unit replies once its shard is written: unit.dump.after_write "
                            "and unit.dump.after_fsync are the crash points of that step",
    "unit.request.DUMP_CANCEL": "cancelling a background dump: tests/e2e/test_background_dump.py",
    "unit.reply.DUMP_CANCEL": "cancelling a background dump: tests/e2e/test_background_dump.py",
    "unit.request.DROP_STAGED": "dropping an aborted restore's staged rows: the abort path's "
                                "crash points are controller.restore.after_abort_decision and "
                                "client.restore.after_abort",
    "unit.reply.DROP_STAGED": "as unit.request.DROP_STAGED",
    "unit.request.REDO_RESTORE": "roll-forward of a committed restore, reached only after a "
                                 "crash: tests/e2e/test_restore_rollforward.py arms "
                                 "unit.redo.after_read",
    "unit.reply.REDO_RESTORE": "as unit.request.REDO_RESTORE",
    "unit.redo.after_read": "as unit.request.REDO_RESTORE",
    "unit.register.after_snapshot": "a unit re-attaching to a restarted controller: "
                                    "tests/storage/test_unit_reattach.py",
    "unit.put.after_read": "a unit failing between reading a same-host put and storing "
                           "it: tests/e2e/test_same_host_put.py",
    "client.put.after_alloc": _PUTS,
    "client.put.before_commit": _PUTS + "; tests/client/test_client_reconnect.py too",
    "client.clear.before_drop": _PUTS,
    "client.get.after_lookup": "a read racing a clear: tests/e2e/test_row_fence.py",
    "client.checkpoint.after_snapshot": "a checkpoint racing a put: tests/e2e/test_row_fence.py",
    "client.dump.after_describe": "a dump racing a put: tests/e2e/test_row_fence.py",
}


def _is_faults_hit(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "hit"
            and isinstance(f.value, ast.Name) and f.value.id == "faults")


def _template(arg: ast.expr) -> str:
    """A point as a template: literal text, each f-string field as ``{}``."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    assert isinstance(arg, ast.JoinedStr), ast.dump(arg)
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values)


def _trees():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _hit_templates() -> dict[str, list[str]]:
    """template -> where (file:line) of every ``faults.hit`` call in tqtx/."""
    out: dict[str, list[str]] = {}
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _is_faults_hit(node):
                where = f"{path.relative_to(PKG.parent)}:{node.lineno}"
                out.setdefault(_template(node.args[0]), []).append(where)
    return out


def _registered_ops(package: str) -> set[str]:
    """The ops a server adds in a loop ``for op, fn, mutating in [("OP", ...), ...]:
    s.add(op, fn, mutating=mutating)``, or directly ``server.add("OP", fn)``."""
    ops: set[str] = set()
    for path in sorted((PKG / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.For) and isinstance(node.iter, ast.List):
                adds = [n for n in ast.walk(node) if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Attribute) and n.func.attr == "add"
                        and any(k.arg == "mutating" for k in n.keywords)]
                if adds:
                    for elt in node.iter.elts:
                        assert isinstance(elt, ast.Tuple), ast.dump(elt)
                        ops.add(elt.elts[0].value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "add" and node.args
                  and isinstance(node.args[0], ast.Constant)
                  and any(k.arg == "mutating" for k in node.keywords)):
                ops.add(node.args[0].value)
    return ops


def _journal_meta_ops() -> set[str]:
    """The ``op`` of every ``journal_meta("op", change)`` call."""
    ops = set()
    for _, tree in _trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "journal_meta"):
                assert isinstance(node.args[0], ast.Constant), ast.dump(node)
                ops.add(node.args[0].value)
    return ops


def _expand(template: str) -> set[str]:
    """Every point name a site template can produce."""
    if "{}" not in template:
        return {template}
    if template in ("{}.request.{}", "{}.reply.{}"):
        kind = template.split(".")[1]
        return {f"{role}.{kind}.{op}" for role, package in SERVER_PACKAGES.items()
                for op in _registered_ops(package)}
    if template.startswith("controller.meta.{}."):
        stage = template.rsplit(".", 1)[1]
        return {f"controller.meta.{op}.{stage}" for op in _journal_meta_ops()}
    raise AssertionError(f"fault point template {template!r}: teach test_fault_points.py how "
                         f"it expands")


@pytest.fixture(scope="module")
def sites() -> set[str]:
    out: set[str] = set()
    for template in _hit_templates():
        out |= _expand(template)
    return out


MATRIX = {*DUMP, *BACKGROUND_DUMP, *RESTORE, *RESTORE_ABORT, *META, *ROWLOG}


def test_the_scan_finds_the_sites_it_expands():
    assert {"controller", "unit"} <= {t.split(".")[0] for t in _hit_templates()}
    assert {"BEGIN_RESTORE", "FINISH_RESTORE", "DESCRIBE_ROWS_BY_KEY"} <= _registered_ops(
        "controller")
    assert {"LOAD_ROWS", "APPLY_STAGED", "DUMP_ROWS"} <= _registered_ops("storage")
    assert {"commit_put", "clear", "checkpoint_replace", "unit_lost",
            "end_buffer"} <= _journal_meta_ops()


def test_every_matrix_point_is_a_fault_site(sites):
    assert sorted(MATRIX - sites) == [], "matrix points no faults.hit site names"


def test_every_fault_site_is_in_the_matrix_or_excluded(sites):
    assert sorted(sites - MATRIX - set(NOT_IN_MATRIX)) == [], \
        "faults.hit sites neither in crash_table.py nor in NOT_IN_MATRIX"


def test_exclusions_are_real_sites_outside_the_matrix(sites):
    assert sorted(set(NOT_IN_MATRIX) - sites) == [], "excluded points that are no site"
    assert sorted(set(NOT_IN_MATRIX) & MATRIX) == [], "points both in the matrix and excluded"


def test_every_matrix_case_expects_an_outcome_for_each_action():
    for table in (DUMP, BACKGROUND_DUMP, RESTORE, RESTORE_ABORT, META):
        for point, expected in table.items():
            assert expected and all(isinstance(v, str) and v for v in expected.values()), point
            assert set(expected) <= {"kill", "raise", "drop-reply", "delay:0.5"}, point
            # drop-reply only where a server replies
            if "drop-reply" in expected:
                assert ".request." in point or ".reply." in point, point
