#!/usr/bin/env python
"""Dump/restore benchmark: V1 (kv_batch_get + torch.save) vs tqtx dump/restore vs the disk.

Thin wrapper around :mod:`tqtx.bench` (same as ``tqtx bench``); see docs/performance.md.

    python benchmarks/dump_restore.py --dir /dev/shm/tqtx-bench --json shm.json
    python benchmarks/dump_restore.py --dir /work/bench-tmp --sizes 64,256,1024 \\
        --key-counts 1000,10000,100000 --json disk.json
"""
import sys

from tqtx.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
