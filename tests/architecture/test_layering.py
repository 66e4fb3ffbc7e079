"""The layering rules of docs/architecture.md, read from the imports (ast) of every module
under tqtx/: the servers never import the user-facing layer, journal/ and format/ import
nothing above them, no server reaches torch, and no module is over 550 lines."""
from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tqtx"
MAX_LINES = 550

# What a server (controller, storage unit) must never import: the user-facing layer (the
# API, its low-level client, the client package with its put/get paths and fence), the client
# side of dump/restore/checkpoint (tqtx.dump), the tools, and the package face.
USER_FACING = ("tqtx.api", "tqtx.compat", "tqtx.arguments", "tqtx.client", "tqtx.dump",
               "tqtx.cli", "tqtx.demo")
FACE = "tqtx"
SERVERS = ("tqtx.controller", "tqtx.storage")
# Packages below everything else: they import nothing from tqtx but their own modules.
BOTTOM_PACKAGES = ("tqtx.layout", "tqtx.process")
# What journal/ and format/ may import from tqtx, besides their own package.
LOW_LEVEL = ("tqtx.errors", "tqtx.layout", "tqtx.states", "tqtx.schema",
             "tqtx.durability", "tqtx.wire", "tqtx.faults")
LEAF_PACKAGES = ("tqtx.journal", "tqtx.format")
TORCH_FREE = ("tqtx.controller", "tqtx.storage", "tqtx.journal", "tqtx.format", "tqtx.wire")
TORCH = ("torch", "tensordict")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@lru_cache(maxsize=None)
def imports(module: str) -> tuple[tuple[str, int], ...]:
    """``(imported module, line)`` for every import statement in ``module``, also those inside
    functions. ``from P import x`` counts as importing ``P.x`` when that is a module of tqtx,
    else as importing ``P`` itself (so ``from tqtx import init`` is an import of the face)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    # A module-level __getattr__ (PEP 562, e.g. the package face's lazy API) imports only
    # when its attribute is used; that use is an import of this module, checked where it is.
    lazy = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
            for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in MODULES else source, node.lineno))
    return tuple(dict.fromkeys(found))


def _in_tqtx(name: str) -> bool:
    return name == FACE or name.startswith(FACE + ".")


def reachable(module: str) -> dict[str, list[str]]:
    """Every module ``module`` may import, directly or through tqtx modules, each with one
    chain of imports that leads to it (a module imports its packages' ``__init__`` too)."""
    chains = {module: [module]}
    todo = [module]
    while todo:
        m = todo.pop()
        targets = [name for name, _ in imports(m)]
        parts = m.split(".")
        targets += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent __init__s
        for name in targets:
            if name in chains:
                continue
            chains[name] = chains[m] + [name]
            if name in MODULES:
                todo.append(name)
    return chains


def _violations(packages, allowed) -> list[str]:
    out = []
    for module in MODULES:
        if not _within(module, packages):
            continue
        for name, line in imports(module):
            if not allowed(module, name):
                out.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}")
    return out


def test_every_module_is_seen():
    assert "tqtx.controller.server" in MODULES and "tqtx.format" in MODULES
    assert imports("tqtx.storage.unit"), "no imports found: the parser is broken"


def test_servers_never_import_the_user_facing_layer():
    def allowed(module, name):
        return not (name == FACE or _within(name, USER_FACING))
    assert _violations(SERVERS, allowed) == []


def test_journal_and_format_import_nothing_above_them():
    def allowed(module, name):
        if not _in_tqtx(name):
            return True  # standard library or third party
        own = next(p for p in LEAF_PACKAGES if _within(module, (p,)))
        return _within(name, (own,) + LOW_LEVEL)
    assert _violations(LEAF_PACKAGES, allowed) == []


def test_layout_and_process_import_nothing_of_tqtx():
    def allowed(module, name):
        own = next(p for p in BOTTOM_PACKAGES if _within(module, (p,)))
        return not _in_tqtx(name) or _within(name, (own,))
    assert _violations(BOTTOM_PACKAGES, allowed) == []


def test_every_package_ships():
    """A package missing from pyproject.toml's list works in this checkout and is absent
    from an installed wheel."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert found - listed == set()


@pytest.mark.parametrize("module", [m for m in MODULES if _within(m, TORCH_FREE)])
def test_servers_never_reach_torch(module):
    bad = {name: chain for name, chain in reachable(module).items() if _within(name, TORCH)}
    assert not bad, " ; ".join(" -> ".join(chain) for chain in bad.values())


def test_server_processes_start_without_torch():
    code = ("import sys, tqtx.controller.__main__, tqtx.storage.__main__; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensordict')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_ships_in_the_wheel():
    """Each folder of tqtx/ with an __init__.py is listed in pyproject.toml's packages (an
    editable install finds it anyway; a wheel, as Ray workers install it, would not)."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found - listed == set()
