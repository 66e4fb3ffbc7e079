"""verl 0.9.1's checkpoint resume on tqtx (default config): a checkpoint saved by one trainer
process (which then dies), loaded by a new one, whose re-issue of the in-flight prompts and
replay-buffer sample run on what was restored. The trainer code is verl's own
(``_add_prompts_to_generate``, ``_save_checkpoint``, ``_load_checkpoint``,
``_reissue_inflight_prompts``, ``ReplayBufferAsync.sample``); see ``trainer_proc.py``."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 and the verl-test "
                "extra (see .ci/run)", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)
PROC = Path(__file__).with_name("trainer_proc.py")


def _run(phase: str, workdir: Path, env: dict) -> None:
    res = subprocess.run([sys.executable, str(PROC), phase, str(workdir)], env=env,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, f"{phase}: {res.stderr[-4000:]}"


def test_checkpoint_in_one_process_resumes_in_another(tmp_path):
    from verl_rig import process_pythonpath
    env = {**os.environ, "PYTHONPATH": process_pythonpath(),
           "TQTX_STATE_DIR": str(tmp_path / "state"), "TQTX_LOG_LEVEL": "WARNING"}
    env.pop("TQTX_ADDRESS", None)
    _run("save", tmp_path, env)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    meta = json.loads((ckpt / "global_step_3" / "transfer_queue" / "metadata.json").read_text())
    assert meta == {"storage_saved": True, "user_metadata": {"global_steps": 3}}

    _run("resume", tmp_path, env)
    r = json.loads((tmp_path / "resumed.json").read_text())
    uids = r["uids"]  # prompts 0 and 1 finished, 2 running (one session stored), 3 pending
    # the dead trainer's deployment left no rows: the new one started empty, then loaded
    assert r["mode"] == "embedded" and r["listed_at_start"] == {}
    assert r["global_steps"] == 3 and r["restored"] == 4 and r["actor_loaded"] == ["3"]
    want = set(uids) | {f"{u}_{s}_0" for u in uids[:2] for s in range(2)} | {f"{uids[2]}_0_0"}
    assert r["keys"] == sorted(want) and len(want) == 9
    assert r["mismatched"] == []  # every key's tag and every field's value, bit for bit
    # exactly the running and pending prompts are re-issued, from their restored fields
    assert r["reissued"] == 2 and sorted(r["regenerated"][0]) == sorted(uids[2:])
    # the sample takes the 4 prompt groups: restored trajectories and regenerated ones
    sampled = r["sampled"]
    assert sorted(sampled) == sorted(f"{u}_{s}_0" for u in uids for s in range(2))
    assert all(sampled[f"{u}_{s}_0"]["global_steps"] == 3 for u in uids[:2] for s in range(2))
    assert all(sampled[f"{u}_{s}_0"]["global_steps"] == 4 for u in uids[2:] for s in range(2))
    assert sorted(r["listed_after"]) == sorted(sampled)  # the prompts' own keys were cleared
