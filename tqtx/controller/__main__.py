"""``python -m tqtx.controller``: run a controller process (used by tq.init and tqtx serve)."""
from __future__ import annotations

import argparse
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tqtx.controller")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--units", type=int, required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--parent-fd", type=int, default=-1)
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--durability", default=None,
                    help="memory, controller (default), buffer or sync (docs/reliability.md, "
                         "Durability); default $TQTX_DURABILITY")
    ap.add_argument("--flush-interval-s", type=float, default=None,
                    help="durability buffer: seconds between durable cuts (default "
                         "$TQTX_FLUSH_INTERVAL_S, else 1.0)")
    args = ap.parse_args(argv)
    from .. import durability as dur
    from ..process.servers import announce, setup_logging, stop_on_signals, watch_parent
    watch_parent(args.parent_fd)
    setup_logging(log_file=args.log_file, name="controller")
    from ..wire.security import server_curve_for, client_curve_for
    try:
        # the options win over $TQTX_DURABILITY / $TQTX_FLUSH_INTERVAL_S
        given = args.durability or os.environ.get(dur.ENV_DURABILITY) or dur.DEFAULT
        durability = dur.check(given, warn=False)
        if durability != given:  # a process's own DeprecationWarning is hidden by default
            import logging
            logging.getLogger("tqtx.controller").warning(
                "durability %r is deprecated; use %r (docs/reliability.md, Durability)",
                given, durability)
        interval = dur.check_interval(args.flush_interval_s if args.flush_interval_s
                                      is not None else os.environ.get(dur.ENV_FLUSH_INTERVAL)
                                      or dur.FLUSH_INTERVAL_S)
        from .server import Controller
        ctl = Controller(num_units=args.units, state_dir=args.state_dir, host=args.host,
                         port=args.port, curve=server_curve_for(args.host, args.state_dir),
                         client_curve=client_curve_for(args.state_dir),
                         durability=durability, flush_interval_s=interval)
    except Exception as exc:
        announce({"error": type(exc).__name__, "message": str(exc)})
        return 2
    stop_on_signals(ctl.server.stop)
    from ..metrics import maybe_start_exporter
    exporter = maybe_start_exporter(ctl.server.metrics, 0)  # only with TQTX_METRICS_PORT set
    if exporter is not None:  # (http server, thread); TOPOLOGY reports it
        host, port = exporter[0].server_address[:2]
        ctl.metrics_endpoint = f"{host}:{port}"
    announce({"ready": ctl.address, "pid": os.getpid(), "incarnation": ctl.incarnation,
              "recovered": len(ctl.recovered)})
    import gc
    # start-up objects (the journal's ORM, recovered metadata) stay out of every later
    # collection: a full one walking them all took 26 ms in a restore's publish
    gc.freeze()
    ctl.serve_forever()
    return 0


if __name__ == "__main__":
    from ..process.servers import exit_now
    from ..wire.rpc import close_context
    exit_now(main(), flush=close_context)
