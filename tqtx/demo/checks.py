"""The demo's verification: every restored value against the reference, and the journals."""
from __future__ import annotations

import json
import subprocess
import sys

from .data import FIELDS


def _rows(value, n: int) -> list:
    """A field of a fetched TensorDict as a list of per-row values."""
    import torch
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return list(value.unbind())
        return list(value.unbind(0)) if value.dim() > 0 else [value]
    if hasattr(value, "tolist"):
        out = value.tolist()
    else:
        out = list(value)
    if len(out) != n:
        raise AssertionError(f"expected {n} rows, got {len(out)}")
    return out


def verify(buf: dict, keep: list[int], got, listed: dict, finished: list[int],
           problems: list[str], limit: int = 20) -> int:
    """Compare every restored value, dtype, shape and tag; returns the number of checks."""
    import torch

    def bad(msg):
        if len(problems) < limit:
            problems.append(msg)
        elif len(problems) == limit:
            problems.append("... (more problems omitted)")

    checks = 0
    n = len(keep)
    if list(got.batch_size) != [n]:
        bad(f"batch size {list(got.batch_size)} != [{n}]")
        return checks
    missing = [f for f in FIELDS if f not in got.keys()]
    if missing:
        bad(f"fields missing after restore: {missing}")
    extra = [f for f in got.keys() if f not in FIELDS]
    if extra:
        bad(f"unexpected fields after restore: {extra}")
    for f in FIELDS:
        if f in missing:
            continue
        rows = _rows(got.get(f), n)
        for j, i in enumerate(keep):
            key = buf["keys"][i]
            if f == "text":
                if rows[j] != buf["text"][i]:
                    bad(f"{key}.text: {rows[j]!r} != {buf['text'][i]!r}")
                checks += 1
                continue
            ref = buf[f][i] if f != "reward" else buf["reward"][i]
            v = rows[j]
            if not isinstance(v, torch.Tensor):
                bad(f"{key}.{f}: got {type(v).__name__}, expected a tensor")
            elif v.dtype != ref.dtype:
                bad(f"{key}.{f}: dtype {v.dtype} != {ref.dtype}")
            elif tuple(v.shape) != tuple(ref.shape):
                bad(f"{key}.{f}: shape {tuple(v.shape)} != {tuple(ref.shape)}")
            elif not torch.equal(v, ref):
                bad(f"{key}.{f}: values differ")
            checks += 1
    for i in keep:
        key = buf["keys"][i]
        if key not in listed:
            bad(f"{key}: not listed after restore")
        elif listed[key] != buf["tags"][i]:
            bad(f"{key}: tag {listed[key]!r} != {buf['tags'][i]!r}")
        checks += 1
    leaked = [buf["keys"][i] for i in finished if buf["keys"][i] in listed]
    if leaked:
        bad(f"{len(leaked)} finished samples were restored, e.g. {leaked[:3]}")
    checks += len(finished)
    if len(listed) != n:
        bad(f"partition holds {len(listed)} keys after restore, expected {n}")
    checks += 1
    return checks


def verify_global(buf, keep, finished, listed, problems) -> int:
    """Whole-partition checks: no finished sample restored, nothing extra."""
    checks = 0
    leaked = [buf["keys"][i] for i in finished if buf["keys"][i] in listed]
    if leaked:
        problems.append(f"{len(leaked)} finished samples were restored, e.g. {leaked[:3]}")
    checks += len(finished)
    expected = {buf["keys"][i] for i in keep}
    extra = set(listed) - expected
    if extra:
        problems.append(f"{len(extra)} unexpected keys after restore, e.g. {sorted(extra)[:3]}")
    missing = expected - set(listed)
    if missing:
        problems.append(f"{len(missing)} keys missing after restore, e.g. {sorted(missing)[:3]}")
    return checks + 1


def read_journals(state_before: str, state_after: str, dump_dir: str) -> dict:
    """The records the run left: restores of the restoring controller, dumps of the dumping
    one, the dump journal's publications and reads, and ``tqtx journal show --json`` of the
    restoring controller (None when that command fails: it is informational only)."""
    from tqtx.journal.controller import ControllerJournal
    from tqtx.journal.dump import DumpJournal

    with ControllerJournal(state_after, migrate=False) as cj:
        restores = cj.list_restores()
    with ControllerJournal(state_before, migrate=False) as cj:
        dumps = cj.list_dumps()
    with DumpJournal(dump_dir, migrate=False) as dj:
        pubs = dj.publications()
        dreads = dj.list_restores()
    jshow = None
    try:
        out = subprocess.run([sys.executable, "-m", "tqtx", "journal", "show", "--state-dir",
                              state_after, "--json"], capture_output=True, text=True,
                             timeout=60)
        if out.returncode == 0:
            jshow = json.loads(out.stdout)
    except Exception:  # informational only
        jshow = None
    return {"restores": restores, "dumps": dumps, "publications": pubs, "reads": dreads,
            "journal_show": jshow}
