"""CurveZMQ on the KV-event sockets (the PUB and the replay ROUTER), when the control plane runs CurveZMQ.

The worker is the CURVE server, with the key pair its transceiver already has (`curve_secret_key_file`: under
`kvbridge serve`, the key of its role). The subscriber (a router) is a CURVE client whose key pair is derived
from the deployment's internal token (`subscriber_keys`: the secret half is HMAC(kv_events key, "kv-subscriber
-curve"), the public half follows from it): the token check stays, and now rides on a handshake that never
sends it, and the events are encrypted. A worker's ZAP handler (`allow_only`) lets in only that public key:

    no server key, or a wrong one    the handshake never completes: the subscriber gets nothing
    a client key not from the token  ZAP refuses it ("Unknown key"): the subscriber gets nothing

Without Curve keys the sockets stay on ZAP PLAIN with the token-derived password (kv_publisher.py). Pure
helpers: key derivation and loading, socket options; never binds or connects.
"""

from __future__ import annotations

import hmac

import zmq
import zmq.auth
from zmq.utils import z85

from ..errors import ExecutorError

__all__ = ["KeyAllow", "public_of", "server_keys", "set_client", "set_server", "subscriber_keys"]


def subscriber_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of a subscriber that holds the deployment's token key `secret`."""
    sk = z85.encode(hmac.new(secret, b"kvbridge kv-subscriber-curve v1", "sha256").digest())
    return zmq.curve_public(sk), sk


def server_keys(path: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 of a worker's transceiver key file (a zmq certificate with its secret half)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ExecutorError(f"KV events over CurveZMQ: cannot read the key file {path}: {e}") from None
    if not secret:
        raise ExecutorError(f"KV events over CurveZMQ: {path} holds no secret key (the transceiver's "
                          f"curve_secret_key_file is needed)")
    return public, secret


def public_of(path: str) -> str:
    """The z85 public key of a key file (public or secret certificate), as text."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ExecutorError(f"KV events over CurveZMQ: cannot read the key file {path}: {e}") from None
    return public.decode("ascii")


class KeyAllow:
    """A ZAP credentials provider (ThreadAuthenticator.configure_curve_callback) allowing one public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, _domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def set_server(sock: zmq.Socket, keys: tuple[bytes, bytes], domain: str) -> None:
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.curve_server = True
    sock.zap_domain = domain.encode()


def set_client(sock: zmq.Socket, server_public: str | bytes, keys: tuple[bytes, bytes]) -> None:
    """A CURVE client of the server `server_public` (z85, 40 characters), with key pair `keys`."""
    sp = server_public.encode("ascii") if isinstance(server_public, str) else server_public
    if len(sp) != 40:
        raise ExecutorError(f"KV events over CurveZMQ: a server key must be 40 z85 characters, got {len(sp)}")
    sock.curve_serverkey = sp
    sock.curve_publickey, sock.curve_secretkey = keys
