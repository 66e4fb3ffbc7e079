"""docs/architecture.md's request tables list exactly the ops the servers register."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _documented() -> dict[str, set[str]]:
    """{"controller": ops, "unit": ops}: the first column of each request table."""
    text = DOC.read_text()
    section = text[text.index("## Request types"):text.index("\n## ", text.index("## Request types") + 1)]
    controller, _, unit = section.partition("Storage unit (")
    out = {}
    for role, part in (("controller", controller), ("unit", unit)):
        ops = set()
        for line in part.splitlines():
            if line.startswith("| `"):
                first = line.split("|")[1]
                ops.update(re.findall(r"`([A-Z][A-Z_]+)`", first))
        out[role] = ops
    return out


def _registered(path: Path) -> set[str]:
    """The ops of the ``for op, fn, mutating in [...]`` tables in ``path``'s classes, plus
    every ``.add("OP", ...)`` call."""
    ops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.List):
            for elt in node.iter.elts:
                if isinstance(elt, ast.Tuple) and isinstance(elt.elts[0], ast.Constant) \
                        and isinstance(elt.elts[0].value, str):
                    ops.add(elt.elts[0].value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "add" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and node.args[0].value.isupper():
            ops.add(node.args[0].value)
    return ops


def _server_ops(package: str) -> set[str]:
    ops = set()
    for path in sorted((ROOT / "tqtx" / package).glob("*.py")):
        ops |= _registered(path)
    return ops


def test_the_request_tables_list_every_registered_op_and_no_other():
    doc = _documented()
    for role, package in (("controller", "controller"), ("unit", "storage")):
        have = _server_ops(package)
        assert have, f"no {role} ops found: the registration's shape changed"
        assert doc[role] == have, (
            f"{role}: documented but not registered {sorted(doc[role] - have)}, registered "
            f"but not documented {sorted(have - doc[role])}")
