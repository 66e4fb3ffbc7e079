"""Put/clear churn with concurrent reads and dumps: no caller ever sees another key's row.

The scenarios in which, without the row fence, reads returned and dumps saved rows put for
other keys (a clear frees an index, the next put of any key may be given it, and a read or
dump that looked the index up before the clear found the new key's row there): 8 writers
each putting and clearing their own key, 2 readers reading random keys, 1 dumper dumping
random keys and restoring each dump to check it. Every row encodes its key, so a foreign
row is caught by value (churn_client.py).

8 s of churn (slow tier: starting eleven client processes costs more than the run);
``TQTX_CHURN_SECONDS`` makes it longer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLIENT = str(Path(__file__).resolve().parent / "churn_client.py")
SECONDS = float(os.environ.get("TQTX_CHURN_SECONDS", "8"))
WRITERS, READERS, DUMPERS = 8, 2, 1

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("churn")]


def _run_clients(address: str, workdir: Path) -> list[dict]:
    roles = ([("writer", w) for w in range(WRITERS)] + [("reader", r) for r in range(READERS)]
             + [("dumper", d) for d in range(DUMPERS)])
    env = {**os.environ, "TQTX_LOG_LEVEL": "ERROR"}
    env.pop("TQTX_STRICT", None)
    # writers run TransferQueue's default semantics; readers and dumpers strict mode, so a
    # key cleared before a read is a KeysNotFoundError rather than a row left out
    strict = {**env, "TQTX_STRICT": "1"}
    procs = [subprocess.Popen([sys.executable, CLIENT, address, role, str(i), str(SECONDS),
                               str(workdir), str(WRITERS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env if role == "writer" else strict,
                              bufsize=0)
             for role, i in roles]
    try:
        for p in procs:
            line = p.stdout.readline().decode()
            assert line.startswith("READY"), (line, p.stderr.read()[-3000:] if p.poll() else "")
        for p in procs:  # all start together
            p.stdin.write(b"go\n")  # communicate() below closes stdin
        results = []
        for p in procs:
            out, err = (b.decode() for b in p.communicate(timeout=SECONDS + 120))
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert p.returncode == 0 and line, err[-3000:]
            results.append(json.loads(line[0][7:]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_churn_never_serves_or_dumps_another_keys_row(tq_start, tmp_path):
    cfg = tq_start(2)
    t0 = time.monotonic()
    results = _run_clients(cfg["address"], tmp_path)
    by_role: dict[str, list[dict]] = {}
    for r in results:
        by_role.setdefault(r["role"], []).append(r)
    writes = by_role["writer"]
    reads = by_role["reader"]
    dumps = by_role["dumper"]
    summary = {
        "seconds": round(time.monotonic() - t0, 1),
        "puts": sum(r["puts"] for r in writes), "clears": sum(r["clears"] for r in writes),
        "reads": sum(r["reads"] for r in reads), "rows_read": sum(r["rows"] for r in reads),
        "reads_not_found": sum(r["not_found"] for r in reads),
        "dumps_published": sum(r["published"] for r in dumps),
        "dumps_refused": sum(r["refused"] for r in dumps),
        "rows_dumped": sum(r["rows"] for r in dumps),
        "wrong_rows": sum(r["n_wrong"] for r in reads + dumps),
        "bare_keyerrors": sum(r["n_bare"] for r in reads + dumps),
        "errors": sum(r["n_errors"] for r in results),
    }
    print("churn: " + json.dumps(summary))
    problems = [x for r in results for x in r.get("wrong", []) + r.get("bare_keyerrors", [])
                + r["errors"]]
    assert summary["wrong_rows"] == 0, problems
    assert summary["bare_keyerrors"] == 0, problems
    assert summary["errors"] == 0, problems
    # the run tested something: churn happened, reads found rows, dumps held rows
    assert summary["clears"] >= WRITERS * 5, summary
    assert summary["rows_read"] >= 20, summary
    assert summary["dumps_published"] >= 1 and summary["rows_dumped"] >= 1, summary
