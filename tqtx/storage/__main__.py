"""``python -m tqtx.storage``: run one storage unit process."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    from .memory import single_arena
    single_arena()  # before the first thread (docs/performance.md, *Unit memory*)
    ap = argparse.ArgumentParser(prog="python -m tqtx.storage")
    ap.add_argument("--controller", required=True)
    ap.add_argument("--unit-id", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--state-dir", default=None, help="where the deployment's keys live (CURVE)")
    ap.add_argument("--parent-fd", type=int, default=-1)
    ap.add_argument("--log-file", default=None)
    args = ap.parse_args(argv)
    from ..process.servers import announce, setup_logging, stop_on_signals, watch_parent
    watch_parent(args.parent_fd)
    setup_logging(log_file=args.log_file, name=f"unit-{args.unit_id}")
    from ..wire.security import client_curve_for, server_curve_for
    try:
        from .logdir import row_log_options
        from .unit import StorageUnit
        unit = StorageUnit(args.unit_id, args.controller, host=args.host, port=args.port,
                           curve=server_curve_for(args.host, args.state_dir),
                           client_curve=client_curve_for(args.state_dir),
                           **row_log_options(args.unit_id, args.state_dir))
        unit.attach.register()
    except Exception as exc:
        announce({"error": type(exc).__name__, "message": str(exc)})
        return 2
    stop_on_signals(unit.server.stop)
    from ..metrics import maybe_start_exporter
    maybe_start_exporter(unit.server.metrics, 1 + args.unit_id)  # only with TQTX_METRICS_PORT
    announce({"ready": unit.address, "pid": os.getpid(), "unit_id": args.unit_id})
    import gc
    gc.freeze()  # start-up objects stay out of every later collection (and the trimmer's)
    from .memory import FEW_ROWS, start_trimmer
    # freed row memory goes back to the OS (docs/performance.md, *Unit memory*)
    unit.trimmer = start_trimmer(collect_if=lambda: len(unit.rows) <= FEW_ROWS)
    unit.attach.start_heartbeat()  # re-registers with a restarted controller (TQTX_UNIT_HEARTBEAT)
    unit.serve_forever()
    return 0


if __name__ == "__main__":
    from ..process.servers import exit_now
    from ..wire.rpc import close_context
    exit_now(main(), flush=close_context)
