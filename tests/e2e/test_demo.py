"""End to end: ``tqtx demo`` (fill, mark finished, dump, restart on 2 units, restore, verify)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)



def _run(args, cwd, timeout=240):
    env = dict(os.environ, TQTX_LOG_LEVEL="WARNING", COLUMNS="200", NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "tqtx", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_small(tmp_path):
    out = _run(["demo", "--samples", "200", "--mb", "4"], tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "VERIFICATION PASSED" in out.stdout, text
    assert "finished samples not restored: 80" in out.stdout, text
    assert "restored 120 of 200" in out.stdout, text
    assert "restores=1 {'committed': 1}" in out.stdout, text
    for row in ("put (4 units)", "save (dump_data_by_key", "restore (load_data_by_key, 2 units)"):
        assert row in out.stdout, text
    # the temp dir (dump, journals, state dirs) was cleaned up: nothing left in cwd
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_demo_keep_then_verify(tmp_path):
    dump = tmp_path / "kept-dump"
    out = _run(["demo", "--samples", "200", "--mb", "4", "--units-before", "3",
                "--units-after", "1", "--keep", str(dump)], tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "VERIFICATION PASSED" in out.stdout, text
    assert f"tqtx inspect {dump}" in out.stdout, text
    assert dump.is_dir()
    ver = _run(["verify", str(dump)], tmp_path)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert ver.stdout.startswith("OK: 120 records"), ver.stdout
    ins = _run(["inspect", "--json", str(dump)], tmp_path)
    assert ins.returncode == 0, ins.stdout + ins.stderr
    assert '"keys": 120' in ins.stdout


def test_demo_bad_args():
    out = subprocess.run([sys.executable, "-m", "tqtx", "demo", "--samples", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--samples" in out.stderr
