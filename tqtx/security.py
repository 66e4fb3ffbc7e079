"""Access control: loopback by default; any other bind address needs CURVE keys or --insecure."""
from __future__ import annotations

import ipaddress
import logging
import os

log = logging.getLogger("tqtx.security")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_curve_for(host: str, state_dir: str | None):
    """Socket configurator for a server bound to ``host`` (None on loopback)."""
    if is_loopback(host):
        return None
    if os.environ.get("TQTX_INSECURE") == "1":
        log.warning("binding %s WITHOUT authentication (--insecure): anyone who can reach this "
                    "address can read and change the data", host)
        return None
    raise PermissionError(
        f"refusing to bind {host} without authentication: CURVE keys are not supported by this "
        f"build yet; bind 127.0.0.1 or pass --insecure (TQTX_INSECURE=1) to accept the risk")


def client_curve_for(state_dir: str | None):
    """Socket configurator for connections from this process (None without CURVE)."""
    return None
