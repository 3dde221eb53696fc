"""The kv_transfer_params of a vLLM request, as kvbridge's connector reads and writes them.

A prefill request asks for remote decode with vLLM's usual `{"do_remote_decode": true}`; its answer's
`kv_transfer_params` carry what a decode instance needs, under one key:

    {"do_remote_prefill": true, "do_remote_decode": false,
     "kvbridge": {"version": 1, "num_tokens": N, ...DisaggParams.to_dict()...}}

(DisaggParams: the request's 63-bit handle, its 128-bit secret, the prefill engine's instance id, every
prefill rank's control endpoint, its KV layout and fingerprint). A router passes that object to the decode
request unchanged. The handle and secret decide what a decode instance may read: no block id ever travels
here, so a forged or edited object can name no other request's KV. Owns only these values: validates
every field of what a client sent and raises ProtocolError naming the one that is wrong.

Early decode (the transfer hidden behind the prefill): a router that knows a prefill engine (its instance,
endpoints, layout and packing: any earlier answer of it) mints a handle and secret itself and sends both hops
at once. The prefill request carries `{"do_remote_decode": true, "kvbridge_early": {"ctx_request_id": H,
"secret": S}}` and publishes its blocks before its last prefill chunk runs, marking layers ready as the
forward writes them; the decode request carries the kvbridge object with `"early": true` (num_tokens may be
left out: the whole prompt) and starts pulling at once. Both sides bind the secret to the prompt
(`bound_secret`), so a decode request holding another text gets no KV: it fails as an unknown request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from ...errors import ProtocolError
from ...transceiver.params import DisaggParams

__all__ = ["KEY", "EARLY_KEY", "PARAMS_VERSION", "RemotePrefill", "EarlyPublish", "prefill_answer",
           "wants_remote_decode", "remote_prefill_of", "early_publish_of", "bound_secret"]

KEY = "kvbridge"
EARLY_KEY = "kvbridge_early"
PARAMS_VERSION = 1  # bump when a field changes meaning; new optional fields need no bump
_MAX_TOKENS = 1 << 31


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode instance pulls: `num_tokens` prompt tokens of the prefill request `disagg` names."""

    disagg: DisaggParams
    num_tokens: int
    packing: str = ""  # the prefill kernel's packing digest (packing.Packing.digest), "" for token rows
    early: bool = False  # told before the prefill ran: the secret is bound to the prompt (bound_secret)

    def for_prompt(self, prompt_hash: str, prompt_len: int) -> "RemotePrefill":
        """An early decode's pull as this request's prompt makes it: the whole prompt when num_tokens was
        left out, the secret bound to the prompt's hash (a late one unchanged)."""
        if not self.early:
            return self
        return RemotePrefill(replace(self.disagg, secret=bound_secret(self.disagg.secret, prompt_hash)),
                             self.num_tokens or prompt_len, self.packing, True)


@dataclass(frozen=True)
class EarlyPublish:
    """Prefill side of an early decode: publish under the router's handle and secret (bound to the prompt)."""

    handle: int
    secret: bytes


def bound_secret(secret: bytes, prompt_hash: str) -> bytes:
    """The secret a prefill publishes under and a decode fetches with when the router minted it: keyed by the
    router's secret over the prompt's hash, so the same secret with another prompt names nothing."""
    return hashlib.blake2b(prompt_hash.encode(), key=secret[:64], digest_size=16, person=b"kvbridge-early").digest()


def prefill_answer(disagg: DisaggParams, num_tokens: int) -> dict[str, Any]:
    """The kv_transfer_params a prefill request's answer carries."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            KEY: {"version": PARAMS_VERSION, "num_tokens": int(num_tokens), **disagg.to_dict()}}


def wants_remote_decode(params: Any) -> bool:
    """True for a prefill request whose KV a decode instance will pull."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True and KEY not in params


def remote_prefill_of(params: Any) -> RemotePrefill | None:
    """The remote prefill a decode request names, None when it names none; ProtocolError when it is malformed.

    A request that asks for a remote prefill (`do_remote_prefill`) without kvbridge's object came from
    another connector (vLLM's NixlConnector answers block ids): refused by name rather than ignored.
    """
    if not isinstance(params, dict):
        return None
    body = params.get(KEY)
    if body is None:
        if params.get("do_remote_prefill"):
            raise ProtocolError(f"kv_transfer_params ask for a remote prefill but carry no {KEY!r} object: they "
                                f"were made by another connector (keys: {sorted(params)[:8]})")
        return None
    if not isinstance(body, dict):
        raise ProtocolError(f"kv_transfer_params.{KEY} should be an object, got {type(body).__name__}")
    version = body.get("version")
    if version != PARAMS_VERSION:
        raise ProtocolError(f"kv_transfer_params.{KEY}.version is {version!r}; this connector speaks "
                            f"{PARAMS_VERSION}")
    early = body.get("early", False)
    if not isinstance(early, bool):
        raise ProtocolError(f"kv_transfer_params.{KEY}.early must be true or false, got {early!r:.40}")
    n = body.get("num_tokens", 0 if early else None)
    if isinstance(n, bool) or not isinstance(n, int) or not (0 if early else 1) <= n < _MAX_TOKENS:
        raise ProtocolError(f"kv_transfer_params.{KEY}.num_tokens must be a positive integer, got {n!r}")
    try:
        disagg = DisaggParams.from_dict(body)
    except ProtocolError as e:
        raise ProtocolError(f"kv_transfer_params.{KEY}: {e}") from None
    if len(disagg.secret) < (16 if early else 1):
        raise ProtocolError(f"kv_transfer_params.{KEY}.secret is missing" if not disagg.secret else
                            f"kv_transfer_params.{KEY}.secret: an early decode's secret has at least 16 bytes")
    packing = body.get("packing", "")
    if not isinstance(packing, str) or len(packing) > 128:
        raise ProtocolError(f"kv_transfer_params.{KEY}.packing must be a string of at most 128 characters")
    return RemotePrefill(disagg, n, packing, early)


def early_publish_of(params: Any) -> EarlyPublish | None:
    """The router's handle and secret for a prefill request told to publish early, None when it was not;
    ProtocolError naming the field when the object is malformed."""
    if not wants_remote_decode(params) or EARLY_KEY not in params:
        return None
    body = params[EARLY_KEY]
    if not isinstance(body, dict):
        raise ProtocolError(f"kv_transfer_params.{EARLY_KEY} should be an object, got {type(body).__name__}")
    h = body.get("ctx_request_id")
    if isinstance(h, bool) or not isinstance(h, int) or not 0 < h < 1 << 63:
        raise ProtocolError(f"kv_transfer_params.{EARLY_KEY}.ctx_request_id must be an integer in (0, 2**63)")
    secret = body.get("secret")
    try:
        raw = bytes.fromhex(secret) if isinstance(secret, str) and len(secret) <= 128 else None
    except ValueError:
        raw = None
    if raw is None or len(raw) < 16:
        raise ProtocolError(f"kv_transfer_params.{EARLY_KEY}.secret must be a hex string of 16 to 64 bytes")
    return EarlyPublish(h, raw)
