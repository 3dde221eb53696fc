"""ZeroMQ sockets of the control plane, made one way: size limits, no lingering, closed by default.

With CurveZMQ configured, the context side's ROUTER is a CURVE server that accepts only clients whose public
keys are in `curve_authorized_keys_dir` (ZAP: zap.py; refusals are logged, rate-limited, and counted), and
every frame is encrypted. Key files are ZeroMQ certificate files (`kvbridge keys DIR` or
`zmq.auth.create_certificates`).

Without keys the ROUTER binds loopback only: `make_router` refuses any other bind_host with a ConfigError
unless the config says `insecure: true`, which is logged as a WARNING when the socket binds.
"""

from __future__ import annotations

import logging
import threading

import zmq

from ..netaddr import is_loopback
from .config import ConfigError, TransceiverConfig
from .messages import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

_auth_lock = threading.Lock()
_authenticators: dict[int, object] = {}  # id(zmq context) -> its ZapGuard


def _load_keys(path: str | None, what: str, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not path:
        raise ConfigError(f"CurveZMQ needs transceiver.{what}")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CurveZMQ key file {path} ({what}): {e}") from None
    if secret and not sec:
        raise ConfigError(f"{path} ({what}) holds no secret key")
    return public, sec


def curve_enabled(cfg: TransceiverConfig) -> bool:
    return bool(cfg.curve_secret_key_file)


def _base(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)  # oversized frames drop the connection
    sock.setsockopt(zmq.RCVHWM, 100000)
    sock.setsockopt(zmq.SNDHWM, 100000)
    return sock


def check_bind(cfg: TransceiverConfig) -> None:
    """Closed by default: without CurveZMQ keys, only loopback, unless `insecure: true` says otherwise."""
    if curve_enabled(cfg) or is_loopback(cfg.bind_host):
        return
    if not cfg.insecure:
        raise ConfigError(f"transceiver.bind_host {cfg.bind_host!r} is not a loopback address and no CurveZMQ keys "
                          f"are configured: anyone who can reach it would get this rank's NIXL metadata and pool "
                          f"addresses. Configure transceiver.curve_secret_key_file and curve_authorized_keys_dir "
                          f"(`kvbridge keys`), or set transceiver.insecure: true on a network you trust")
    log.warning("transceiver.insecure: true: the control plane listens on %s without authentication; any peer "
                "that reaches it can read this rank's KV pool", cfg.bind_host)


def make_router(zctx: zmq.Context, cfg: TransceiverConfig) -> tuple[zmq.Socket, str]:
    """The context rank's ROUTER, bound; returns (socket, endpoint peers should connect to)."""
    check_bind(cfg)
    sock = _base(zctx.socket(zmq.ROUTER))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping silently
    if curve_enabled(cfg):
        _start_authenticator(zctx, cfg)
        public, secret = _load_keys(cfg.curve_secret_key_file, "curve_secret_key_file", True)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    if cfg.port:
        sock.bind(f"tcp://{cfg.bind_host}:{cfg.port}")
        port = cfg.port
    else:
        port = sock.bind_to_random_port(f"tcp://{cfg.bind_host}", min_port=20000, max_port=60000, max_tries=200)
    return sock, f"tcp://{cfg.host}:{port}"


def make_dealer(zctx: zmq.Context, cfg: TransceiverConfig, endpoint: str, identity: bytes) -> zmq.Socket:
    """A generation rank's DEALER to one context rank."""
    sock = _base(zctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.IDENTITY, identity)
    if curve_enabled(cfg):
        public, secret = _load_keys(cfg.curve_secret_key_file, "curve_secret_key_file", True)
        server_public, _ = _load_keys(cfg.curve_server_public_key_file, "curve_server_public_key_file", False)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public
    sock.connect(endpoint)
    return sock


def _start_authenticator(zctx: zmq.Context, cfg: TransceiverConfig) -> None:
    from .zap import ZapGuard, load_authorized

    if not cfg.curve_authorized_keys_dir:
        raise ConfigError("CurveZMQ on the context side needs transceiver.curve_authorized_keys_dir "
                          "(a folder of the public key files of generation ranks allowed to connect)")
    with _auth_lock:
        if id(zctx) in _authenticators:
            return
        keys = load_authorized(cfg.curve_authorized_keys_dir)
        _authenticators[id(zctx)] = ZapGuard(zctx, keys, f"control plane on {cfg.bind_host}")


def stop_authenticator(zctx: zmq.Context) -> None:
    with _auth_lock:
        auth = _authenticators.pop(id(zctx), None)
    if auth is not None:
        auth.close()
