"""The opt-in ``transfer_queue`` shim: ``import transfer_queue`` gives tqtx, so a framework
that imports TransferQueue by name (verl, NeMo-RL, ROLL) runs on tqtx unchanged.

``tqtx shim install [--target DIR]`` writes a ``transfer_queue`` package into DIR (default:
this interpreter's site-packages, so every process of the environment, Ray workers
included, sees it): an ``__init__.py`` whose names are tqtx's, TransferQueue's
``config.yaml`` layout (tqtx's defaults) and a marker file naming tqtx as its maker.
``tqtx shim remove`` deletes exactly those files. Both refuse while the real TransferQueue
is installed there, and importing the shim raises ImportError when TransferQueue is
installed anywhere on ``sys.path``: two packages answering to one name would make every
``import transfer_queue`` a guess.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sysconfig
from pathlib import Path

PACKAGE = "transfer_queue"
DIST = "TransferQueue"
MARKER = "TQTX_SHIM.json"
HEADER = "# transfer_queue is tqtx here: made by `tqtx shim install`"

INIT = HEADER + ''' (tqtx {version}).
# `tqtx shim remove` deletes it. See tqtx's docs/compatibility.md.
"""``import transfer_queue`` gives tqtx's names (tqtx's transfer_queue shim)."""
from tqtx.compat.shim import check_no_transferqueue as _check

_check(__file__)

import tqtx as _tqtx  # noqa: E402
from tqtx import TRANSFERQUEUE_API_VERSION, __version__  # noqa: E402,F401

__all__ = list(_tqtx.__all__)


def __getattr__(name):
    return getattr(_tqtx, name)


def __dir__():
    return sorted(set(__all__) | {{"__version__", "TRANSFERQUEUE_API_VERSION"}})
'''


class ShimError(Exception):
    """The shim cannot be installed or removed here (the message says why)."""


def default_target() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def config_source() -> Path:
    return Path(__file__).with_name("config.yaml")


def real_transferqueue(paths=None):
    """The installed TransferQueue distribution on ``paths`` (default sys.path), or None."""
    for dist in md.distributions(**({"path": [str(p) for p in paths]} if paths else {})):
        name = (dist.metadata.get("Name") or "").replace("_", "-").lower()
        if name == DIST.lower():
            return dist
    return None


def _where(dist) -> str:
    try:
        return str(dist.locate_file(""))
    except Exception:  # only for the message
        return "?"


def check_no_transferqueue(shim_file: str) -> None:
    """ImportError when the real TransferQueue is installed next to the shim at ``shim_file``."""
    dist = real_transferqueue()
    if dist is not None:
        raise ImportError(
            f"TransferQueue {dist.version} is installed in this environment ({_where(dist)}) "
            f"and so is tqtx's transfer_queue shim ({os.path.dirname(shim_file)}): "
            f"`import transfer_queue` would pick one of them by path order. Keep one: "
            f"`pip uninstall TransferQueue`, or `tqtx shim remove`")


def _ours(pkg: Path) -> dict | None:
    try:
        return json.loads((pkg / MARKER).read_text())
    except (OSError, ValueError):
        return None


def install(target: Path | None = None) -> Path:
    """Write the shim package into ``target``; returns its directory."""
    from .. import __version__
    target = Path(target) if target is not None else default_target()
    dist = real_transferqueue([target])
    if dist is not None:
        raise ShimError(f"refusing to install the transfer_queue shim: TransferQueue "
                        f"{dist.version} is installed in {target}. Uninstall it first "
                        f"(`pip uninstall TransferQueue`) to run on tqtx under its name")
    pkg = target / PACKAGE
    if pkg.exists() and _ours(pkg) is None and any(pkg.iterdir()):
        raise ShimError(f"refusing to install the transfer_queue shim: {pkg} exists and tqtx "
                        f"did not make it (no {MARKER}); it is not replaced")
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(INIT.format(version=__version__))
    (pkg / "config.yaml").write_bytes(config_source().read_bytes())
    (pkg / MARKER).write_text(json.dumps({"made_by": "tqtx shim install",
                                          "tqtx_version": __version__}) + "\n")
    return pkg


def remove(target: Path | None = None) -> list[str]:
    """Delete the shim's files from ``target`` (only those tqtx wrote); returns them."""
    target = Path(target) if target is not None else default_target()
    pkg = target / PACKAGE
    if not pkg.exists():
        return []
    if _ours(pkg) is None:
        raise ShimError(f"{pkg} was not made by `tqtx shim install` (no {MARKER}); it is left "
                        f"alone")
    gone = []
    init = pkg / "__init__.py"
    if init.exists() and init.read_text().startswith(HEADER):
        gone.append(init)
    cfg = pkg / "config.yaml"
    if cfg.exists() and cfg.read_bytes() == config_source().read_bytes():
        gone.append(cfg)
    gone.append(pkg / MARKER)
    for path in gone:
        path.unlink()
    cache = pkg / "__pycache__"
    if cache.is_dir():
        for f in cache.glob("__init__.*.pyc"):
            f.unlink()
        if not any(cache.iterdir()):
            cache.rmdir()
    if not any(pkg.iterdir()):
        pkg.rmdir()
    return [str(p) for p in gone]


def status(target: Path | None = None) -> dict:
    """What is at ``target``: the shim (``installed``), TransferQueue, or nothing."""
    target = Path(target) if target is not None else default_target()
    pkg = target / PACKAGE
    dist = real_transferqueue([target])
    ours = _ours(pkg) if pkg.exists() else None
    init = pkg / "__init__.py"
    intact = bool(ours) and init.exists() and init.read_text().startswith(HEADER)
    return {"target": str(target), "installed": intact, "marker": ours,
            "transferqueue": None if dist is None else dist.version}
