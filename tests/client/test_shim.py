"""The opt-in transfer_queue shim: ``import transfer_queue`` gives tqtx, without a change in
the importing code; refused loudly while the real TransferQueue is installed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tqtx.compat import shim
from tqtx.cli import main

TQ_DIST_INFO = "transferqueue-0.1.11.dist-info"


def _python(target: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def _fake_transferqueue(target: Path) -> None:
    """A TransferQueue 0.1.11 distribution record where ``target`` is searched."""
    info = target / TQ_DIST_INFO
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: TransferQueue\nVersion: 0.1.11\n")


def test_import_transfer_queue_is_tqtx(tmp_path):
    res = CliRunner().invoke(main, ["shim", "install", "--target", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = _python(tmp_path, (
        "import json, tqtx, transfer_queue as tq\n"
        "from transfer_queue import BatchMeta, KVBatchMeta\n"
        "from importlib import resources\n"
        "cfg = resources.files('transfer_queue') / 'config.yaml'\n"
        "print(json.dumps({'same': tq.init is tqtx.init and BatchMeta is tqtx.BatchMeta\n"
        "                  and KVBatchMeta is tqtx.KVBatchMeta, 'version': tq.__version__,\n"
        "                  'api': tq.TRANSFERQUEUE_API_VERSION,\n"
        "                  'config': cfg.read_text() == (resources.files('tqtx.compat') / "
        "'config.yaml').read_text(), 'all': 'kv_batch_put' in dir(tq)}))\n"
        "try:\n"
        "    import transfer_queue.storage.simple_storage\n"
        "except ImportError as e:\n"
        "    print('no internals:', type(e).__name__)\n"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[0]) == {"same": True, "version": shim_version(), "api": "0.1.11",
                                    "config": True, "all": True}
    assert lines[1] == "no internals: ModuleNotFoundError"  # TransferQueue's own modules
    assert shim.status(tmp_path)["installed"]


def shim_version() -> str:
    import tqtx
    return tqtx.__version__


def test_refused_where_transferqueue_is_installed(tmp_path):
    _fake_transferqueue(tmp_path)
    res = CliRunner().invoke(main, ["shim", "install", "--target", str(tmp_path)])
    assert res.exit_code != 0
    assert "TransferQueue 0.1.11 is installed in" in res.output
    assert not (tmp_path / "transfer_queue").exists()


def test_import_refused_when_transferqueue_is_also_installed(tmp_path):
    shim.install(tmp_path / "shim")
    _fake_transferqueue(tmp_path / "elsewhere")
    env_path = os.pathsep.join([str(tmp_path / "shim"), str(tmp_path / "elsewhere")])
    out = subprocess.run([sys.executable, "-c", "import transfer_queue"],
                         env={**os.environ, "PYTHONPATH": env_path}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError: TransferQueue 0.1.11 is installed in this environment" in out.stderr
    assert "tqtx shim remove" in out.stderr


def test_never_replaces_or_removes_what_it_did_not_make(tmp_path):
    theirs = tmp_path / "transfer_queue"
    theirs.mkdir()
    (theirs / "__init__.py").write_text("# someone else's\n")
    with pytest.raises(shim.ShimError, match="did not make it"):
        shim.install(tmp_path)
    with pytest.raises(shim.ShimError, match="not made by"):
        shim.remove(tmp_path)
    assert (theirs / "__init__.py").read_text() == "# someone else's\n"
    shutil.rmtree(theirs)
    pkg = shim.install(tmp_path)
    (pkg / "mine.txt").write_text("a file the user put there")  # stays
    removed = shim.remove(tmp_path)
    assert sorted(Path(p).name for p in removed) == ["TQTX_SHIM.json", "__init__.py",
                                                     "config.yaml"]
    assert sorted(os.listdir(pkg)) == ["mine.txt"]
    (pkg / "mine.txt").unlink()
    shim.install(tmp_path)
    assert shim.remove(tmp_path) and not pkg.exists()
    assert CliRunner().invoke(main, ["shim", "remove", "--target", str(tmp_path)]).output \
        .strip() == "no shim here"


def test_status_names_what_is_there(tmp_path):
    res = CliRunner().invoke(main, ["shim", "status", "--json", "--target", str(tmp_path)])
    assert json.loads(res.output) == {"target": str(tmp_path), "installed": False,
                                      "marker": None, "transferqueue": None}
    shim.install(tmp_path)
    _fake_transferqueue(tmp_path)
    info = shim.status(tmp_path)
    assert info["installed"] and info["transferqueue"] == "0.1.11"
