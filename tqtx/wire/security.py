"""Access control: loopback by default; any other bind address needs CURVE keys or --insecure.

Rules
-----
* A server (controller or unit) bound to a loopback address runs without authentication
  (anyone who can run code on this machine can already read its memory).
* A server bound to any other address enables CurveZMQ server mode on its ROUTER socket
  when the deployment has keys (``tqtx keys init --state-dir D`` writes them to
  ``D/keys``, or ``$TQTX_KEYS_DIR`` points at such a directory). A ZAP handler
  (``zmq.auth.thread.ThreadAuthenticator``) accepts only the client public keys in
  ``<keys>/authorized``: a peer without an authorized key never completes the handshake,
  so it never gets a reply (its request times out).
* Without keys a non-loopback bind is refused (PermissionError) unless ``--insecure`` /
  ``TQTX_INSECURE=1`` is given, which logs a warning.
* ``TQTX_CURVE=1`` forces CURVE even on loopback (tests, or defence in depth on a shared
  machine); it then requires keys like a non-loopback bind.

Every connection made by a CURVE deployment (controller -> unit, unit -> controller,
client -> both) uses the client keypair ``<keys>/client.key_secret`` and the server's
public key ``<keys>/server.key``. All processes of one deployment share the server
keypair, so one public key identifies the deployment.

Key layout (``<state_dir>/keys``, mode 0700; secret files mode 0600)::

    server.key  server.key_secret     the deployment's keypair (public / secret)
    client.key  client.key_secret     a client keypair for tools, units and the controller
    authorized/client.key             public keys allowed to connect (add more *.key files)
"""
from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import threading

log = logging.getLogger("tqtx.wire.security")

KEYS_SUBDIR = "keys"
AUTHORIZED_SUBDIR = "authorized"

_lock = threading.Lock()
_authenticators: dict[int, object] = {}   # id(context) -> ThreadAuthenticator
_server_curve_active = False               # set when this process serves with CURVE


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_requested() -> bool:
    return os.environ.get("TQTX_INSECURE") == "1"


def curve_forced() -> bool:
    return os.environ.get("TQTX_CURVE") == "1"


def curve_required(host: str) -> bool:
    """Does a server bound to ``host`` need authentication?"""
    return curve_forced() or not is_loopback(host)


def host_of(address: str) -> str:
    """``tcp://host:port`` -> ``host`` (brackets of IPv6 literals removed)."""
    host = address.split("//", 1)[-1].rsplit(":", 1)[0]
    return host.strip("[]")


# ---------------------------------------------------------------- keys on disk
def keys_dir_for(state_dir: str | os.PathLike | None) -> str | None:
    """The key directory to use: ``$TQTX_KEYS_DIR``, else ``<state_dir>/keys`` (None if neither)."""
    env = os.environ.get("TQTX_KEYS_DIR")
    if env:
        return os.path.abspath(env)
    if state_dir:
        return os.path.join(os.path.abspath(os.fspath(state_dir)), KEYS_SUBDIR)
    return None


def _paths(keys_dir: str) -> dict:
    return {"server_public": os.path.join(keys_dir, "server.key"),
            "server_secret": os.path.join(keys_dir, "server.key_secret"),
            "client_public": os.path.join(keys_dir, "client.key"),
            "client_secret": os.path.join(keys_dir, "client.key_secret"),
            "authorized": os.path.join(keys_dir, AUTHORIZED_SUBDIR)}


def has_server_keys(keys_dir: str | None) -> bool:
    if not keys_dir:
        return False
    p = _paths(keys_dir)
    return os.path.isfile(p["server_secret"]) and os.path.isdir(p["authorized"])


def init_keys(state_dir: str | os.PathLike, *, force: bool = False) -> dict:
    """Create the deployment's server keypair and one authorized client keypair.

    Returns the paths and the server public key (Z85 text). Refuses to overwrite
    existing keys unless ``force``.
    """
    import zmq.auth

    keys_dir = os.path.join(os.path.abspath(os.fspath(state_dir)), KEYS_SUBDIR)
    p = _paths(keys_dir)
    if os.path.exists(p["server_secret"]) and not force:
        raise FileExistsError(f"{keys_dir} already holds keys (use --force to replace them)")
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    zmq.auth.create_certificates(keys_dir, "server")
    zmq.auth.create_certificates(keys_dir, "client")
    for name in ("server_secret", "client_secret"):
        os.chmod(p[name], 0o600)
    if os.path.isdir(p["authorized"]) and force:
        shutil.rmtree(p["authorized"])
    os.makedirs(p["authorized"], mode=0o700, exist_ok=True)
    shutil.copyfile(p["client_public"], os.path.join(p["authorized"], "client.key"))
    return {"keys_dir": keys_dir, **p, "server_key": server_public_key(keys_dir)}


def server_public_key(keys_dir: str) -> str:
    """The deployment's public key (Z85 text) from ``<keys_dir>/server.key``."""
    import zmq.auth
    public, _ = zmq.auth.load_certificate(_paths(keys_dir)["server_public"])
    return public.decode("ascii")


def authorize_client(keys_dir: str, public_key_file: str, name: str | None = None) -> str:
    """Copy a client's public certificate into ``<keys_dir>/authorized`` (servers reload on start)."""
    dest = os.path.join(_paths(keys_dir)["authorized"],
                        (name or os.path.basename(public_key_file)))
    if not dest.endswith(".key"):
        dest += ".key"
    shutil.copyfile(public_key_file, dest)
    return dest


# ---------------------------------------------------------------- server side
def _authenticator(context, authorized_dir: str):
    """One ThreadAuthenticator (ZAP handler) per context, accepting ``authorized_dir``'s keys."""
    from zmq.auth.thread import ThreadAuthenticator

    with _lock:
        auth = _authenticators.get(id(context))
        if auth is None:
            auth = ThreadAuthenticator(context, log=logging.getLogger("tqtx.zap"))
            auth.start()
            _authenticators[id(context)] = auth
        auth.configure_curve(domain="*", location=authorized_dir)
        return auth


def server_curve_for(host: str, state_dir: str | None):
    """Socket configurator for a server bound to ``host`` (None when no CURVE is used)."""
    global _server_curve_active
    if not curve_required(host):
        return None
    keys_dir = keys_dir_for(state_dir)
    if has_server_keys(keys_dir):
        import zmq.auth

        p = _paths(keys_dir)
        public, secret = zmq.auth.load_certificate(p["server_secret"])
        if not secret:
            raise PermissionError(f"{p['server_secret']} holds no secret key")
        authorized = p["authorized"]
        if not any(n.endswith(".key") for n in os.listdir(authorized)):
            log.warning("%s lists no authorized client key: every client will be refused",
                        authorized)

        def configure(socket):
            _authenticator(socket.context, authorized)
            socket.curve_secretkey = secret
            socket.curve_publickey = public
            socket.curve_server = True

        _server_curve_active = True
        log.info("binding %s with CURVE authentication (keys in %s)", host, keys_dir)
        return configure
    if insecure_requested():
        log.warning("binding %s WITHOUT authentication (--insecure): anyone who can reach this "
                    "address can read and change the data", host)
        return None
    where = f" in {keys_dir}" if keys_dir else ""
    raise PermissionError(
        f"refusing to bind {host} without authentication: no CURVE keys{where}. Create them "
        f"with `tqtx keys init --state-dir <state_dir>` (or set TQTX_KEYS_DIR), bind "
        f"127.0.0.1, or pass --insecure (TQTX_INSECURE=1) to accept the risk")


# ---------------------------------------------------------------- client side
def _client_configurator(server_key: bytes, public: bytes, secret: bytes):
    def configure(socket):
        socket.curve_serverkey = server_key
        socket.curve_publickey = public
        socket.curve_secretkey = secret
    return configure


def client_curve_for(state_dir: str | None = None, *, host: str | None = None,
                     server_key: str | bytes | None = None, keys_dir: str | None = None,
                     client_key_file: str | None = None, force: bool = False):
    """Socket configurator for connections from this process (None without CURVE).

    CURVE is used when a ``server_key`` is given explicitly (or ``$TQTX_SERVER_KEY``), or
    when keys exist and the peer needs it: ``host`` is not loopback, ``TQTX_CURVE=1``, or
    (no ``host`` given) this process itself serves with CURVE. The client keypair comes from
    ``client_key_file``, ``$TQTX_CLIENT_KEY``, ``<keys>/client.key_secret``, or else a fresh
    ephemeral one (refused unless the servers authorize it).
    """
    import zmq
    import zmq.auth

    server_key = server_key or os.environ.get("TQTX_SERVER_KEY") or None
    keys_dir = os.path.abspath(keys_dir) if keys_dir else keys_dir_for(state_dir)
    p = _paths(keys_dir) if keys_dir else None
    if server_key is None:
        if p is None or not os.path.isfile(p["server_public"]):
            return None
        if force:
            wanted = True
        elif host is not None:
            wanted = curve_required(host)
        else:
            wanted = _server_curve_active or curve_forced()
        if not wanted:
            return None
        server_key = server_public_key(keys_dir)
    if isinstance(server_key, str):
        server_key = server_key.encode("ascii")
    if len(server_key) != 40:
        raise ValueError("server_key must be the 40-character Z85 public key of the deployment "
                         "(the first key in <state_dir>/keys/server.key)")
    client_key_file = client_key_file or os.environ.get("TQTX_CLIENT_KEY")
    if not client_key_file and p is not None and os.path.isfile(p["client_secret"]):
        client_key_file = p["client_secret"]
    if client_key_file:
        public, secret = zmq.auth.load_certificate(client_key_file)
        if not secret:
            raise ValueError(f"{client_key_file} holds no secret key")
    else:
        public, secret = zmq.curve_keypair()
        log.warning("no client keypair found: using an ephemeral one (servers will refuse it "
                    "unless its public key is authorized)")
    return _client_configurator(server_key, public, secret)


def attach_curve(address: str, *, state_dir: str | None = None, server_key=None,
                 keys_dir: str | None = None, client_key_file: str | None = None,
                 insecure: bool = False):
    """Client configurator for attaching to ``address`` (None: plain connection).

    Attaching to a non-loopback address without keys is refused unless ``insecure`` or
    ``TQTX_INSECURE=1`` (then a warning is logged): the data would travel unauthenticated
    and in clear text.
    """
    host = host_of(address)
    curve = client_curve_for(state_dir, host=host, server_key=server_key, keys_dir=keys_dir,
                             client_key_file=client_key_file)
    if curve is None and curve_required(host):
        if insecure or insecure_requested():
            log.warning("attaching to %s WITHOUT authentication (--insecure)", address)
            return None
        raise PermissionError(
            f"refusing to attach to {address} without authentication: give the deployment's "
            f"public key (config 'server_key' / $TQTX_SERVER_KEY, with a client keypair in "
            f"'keys_dir' / $TQTX_KEYS_DIR) or its state_dir holding keys/, or pass insecure "
            f"(TQTX_INSECURE=1) to accept the risk")
    return curve
