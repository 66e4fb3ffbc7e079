"""One client process of the churn scenarios (test_churn.py): a writer, a reader or a dumper.

Every key ``k<w>`` belongs to writer ``w``, which puts it and clears it in a loop, so each
clear frees an index that the next put of any key may be given. A row's payload names its
key in every element (``w * 2**32 + seq``), so a row of another key is recognised by value
alone, whatever path it came through.

    python churn_client.py ADDRESS ROLE ID SECONDS WORKDIR WRITERS

prints ``READY`` once attached, then one ``RESULT {json}`` line.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx.errors import KeysNotFoundError, PartitionNotFoundError

PID = "churn"
WIDTH = 64  # int64 elements a row: 512 bytes of payload


def payload(w: int, seq: int) -> torch.Tensor:
    return torch.full((1, WIDTH), w * 2**32 + seq, dtype=torch.int64)


def owner_of(row: torch.Tensor) -> int | None:
    """The writer whose key this row was put for, or None for a row no put wrote."""
    first = int(row.reshape(-1)[0])
    if not torch.all(row == first):
        return None
    return first // 2**32


def is_bare_keyerror(exc: BaseException) -> bool:
    return type(exc) is KeyError


def writer(w: int, end: float) -> dict:
    key, seq, puts, clears, errors = f"k{w}", 0, 0, 0, []
    while time.monotonic() < end:
        seq += 1
        try:
            tq.kv_batch_put([key], PID, TensorDict({"x": payload(w, seq)}, batch_size=[1]),
                            tags=[{"w": w, "seq": seq}])
            puts += 1
            tq.kv_clear([key], PID)
            clears += 1
        except Exception as exc:  # counted and reported; the test asserts there are none
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"puts": puts, "clears": clears, "errors": errors[:10], "n_errors": len(errors)}


def reader(r: int, end: float, writers: int) -> dict:
    """Strict-mode multi-key reads: every row returned must be its key's."""
    rng = random.Random(r)
    reads = rows = not_found = 0
    wrong, bare, errors = [], [], []
    while time.monotonic() < end:
        keys = [f"k{w}" for w in rng.sample(range(writers), rng.randint(1, 2))]
        try:
            got = tq.kv_batch_get(keys, PID)
        except (KeysNotFoundError, PartitionNotFoundError):
            not_found += 1
            continue
        except Exception as exc:
            (bare if is_bare_keyerror(exc) else errors).append(f"{type(exc).__name__}: {exc}")
            continue
        reads += 1
        x = got["x"]
        for i, key in enumerate(keys):
            rows += 1
            if owner_of(x[i]) != int(key[1:]):
                wrong.append(f"{key} returned a row of writer {owner_of(x[i])}")
    return {"reads": reads, "rows": rows, "not_found": not_found, "wrong": wrong[:10],
            "n_wrong": len(wrong), "bare_keyerrors": bare[:10], "n_bare": len(bare),
            "errors": errors[:10], "n_errors": len(errors)}


def dumper(d: int, end: float, writers: int, workdir: str) -> dict:
    """Dumps of random keys under churn; each published dump is restored into a partition of
    its own and every restored row checked against its key."""
    rng = random.Random(1000 + d)
    published = dumped_rows = refused = n = 0
    wrong, bare, errors = [], [], []
    while time.monotonic() < end:
        n += 1
        keys = [f"k{w}" for w in rng.sample(range(writers), rng.randint(1, 2))]
        target = os.path.join(workdir, f"dump-{d}-{n}")
        try:
            tq.dump_data_by_key(target, keys, PID)
        except (KeysNotFoundError, PartitionNotFoundError):
            refused += 1  # cleared before the dump began (every key: the partition is gone)
            continue
        except Exception as exc:
            (bare if is_bare_keyerror(exc) else errors).append(f"dump: {type(exc).__name__}: {exc}")
            continue
        published += 1
        try:
            index = tq.read_row_index(target)
            rpid = f"check-{d}-{n}"
            tq.load_data_by_key(target, partition_id=rpid)
            dkeys = list(index["rows"])
            x = tq.kv_batch_get(dkeys, rpid)["x"]
            for i, key in enumerate(dkeys):
                dumped_rows += 1
                if owner_of(x[i]) != int(key[1:]):
                    wrong.append(f"{target}: {key} holds a row of writer {owner_of(x[i])}")
            tq.kv_clear(dkeys, rpid)
        except Exception as exc:
            (bare if is_bare_keyerror(exc) else errors).append(f"check: {type(exc).__name__}: {exc}")
    return {"dumps": n, "published": published, "refused": refused, "rows": dumped_rows,
            "wrong": wrong[:10], "n_wrong": len(wrong), "bare_keyerrors": bare[:10],
            "n_bare": len(bare), "errors": errors[:10], "n_errors": len(errors)}


def main() -> None:
    address, role, ident, seconds, workdir, writers = sys.argv[1:7]
    ident, seconds, writers = int(ident), float(seconds), int(writers)
    tq.init(address=address)  # readers and dumpers run strict ($TQTX_STRICT, set by the test)
    print("READY", flush=True)
    sys.stdin.readline()  # every client starts together
    end = time.monotonic() + seconds
    if role == "writer":
        out = writer(ident, end)
    elif role == "reader":
        out = reader(ident, end, writers)
    else:
        out = dumper(ident, end, writers, workdir)
    print("RESULT " + json.dumps({"role": role, "id": ident, **out}), flush=True)
    tq.close()


if __name__ == "__main__":
    main()
