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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ProtocolError
from ...transceiver.params import DisaggParams

__all__ = ["KEY", "PARAMS_VERSION", "RemotePrefill", "prefill_answer", "wants_remote_decode", "remote_prefill_of"]

KEY = "kvbridge"
PARAMS_VERSION = 1  # bump when a field changes meaning; new optional fields need no bump
_MAX_TOKENS = 1 << 31


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode instance pulls: `num_tokens` prompt tokens of the prefill request `disagg` names."""

    disagg: DisaggParams
    num_tokens: int
    packing: str = ""  # the prefill kernel's packing digest (packing.Packing.digest), "" for token rows


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
    n = body.get("num_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n < _MAX_TOKENS:
        raise ProtocolError(f"kv_transfer_params.{KEY}.num_tokens must be a positive integer, got {n!r}")
    try:
        disagg = DisaggParams.from_dict(body)
    except ProtocolError as e:
        raise ProtocolError(f"kv_transfer_params.{KEY}: {e}") from None
    if not disagg.secret:
        raise ProtocolError(f"kv_transfer_params.{KEY}.secret is missing")
    packing = body.get("packing", "")
    if not isinstance(packing, str) or len(packing) > 128:
        raise ProtocolError(f"kv_transfer_params.{KEY}.packing must be a string of at most 128 characters")
    return RemotePrefill(disagg, n, packing)
