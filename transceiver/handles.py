"""Request handles: the id and the secret a generation rank must show to pull a context request.

A context executor's ranks and the process that started them share one `RequestKey` (256 random bits,
made by `RequestKey.new()` where the executor is configured, handed to every rank with the hook's args).
From it and the executor's own request id each side derives, without talking to the other:

    handle(rid)  the request's id on the wire: 63 pseudo-random bits (a positive int64), so ids cannot be
                 guessed or counted from one another;
    secret(rid)  128 pseudo-random bits that every Fetch must carry (compared with hmac.compare_digest).

Both are HMAC-SHA256(key, label | rid), so they are as unguessable as the key. The key never leaves the
deployment's own processes: it travels in rank_hook_args (a pipe to the rank processes), never on the wire.
This module owns only the derivation; it never stores handles or touches sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from .config import ConfigError

__all__ = ["RequestKey", "SECRET_BYTES", "new_secret"]

SECRET_BYTES = 16
_KEY_BYTES = 32
_HANDLE_MASK = (1 << 63) - 1


def new_secret() -> bytes:
    """A fresh random per-request secret (for requests published without a RequestKey)."""
    return secrets.token_bytes(SECRET_BYTES)


class RequestKey:
    """One context executor's key for request handles and secrets.

    Args:
        key: at least 16 random bytes (32 from `new()`).
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ConfigError("a request key must be at least 16 random bytes")
        self._key = key

    @classmethod
    def new(cls) -> "RequestKey":
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def from_hex(cls, text: object, what: str = "request_key") -> "RequestKey":
        """Parse the hex form (as carried in rank_hook_args); ConfigError naming `what` otherwise."""
        try:
            if not isinstance(text, str):
                raise ValueError
            return cls(bytes.fromhex(text))
        except (ValueError, ConfigError):
            raise ConfigError(f"{what} must be a hex string of at least 32 digits (RequestKey.new().hex)") from None

    @property
    def hex(self) -> str:
        return self._key.hex()

    def __repr__(self) -> str:  # never print the key
        return "RequestKey(<hidden>)"

    def _mac(self, label: bytes, rid: int) -> bytes:
        msg = label + b"\0" + int(rid).to_bytes(16, "little", signed=True)
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def handle(self, rid: int) -> int:
        """The wire id of executor request `rid`: 63 pseudo-random bits, never 0."""
        return int.from_bytes(self._mac(b"kvbridge handle", rid)[:8], "little") & _HANDLE_MASK or 1

    def secret(self, rid: int) -> bytes:
        """The secret every Fetch of executor request `rid` must carry."""
        return self._mac(b"kvbridge secret", rid)[:SECRET_BYTES]
