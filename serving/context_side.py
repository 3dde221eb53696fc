"""The context half of a worker's requests, and the inputs both halves derive from a request.

Owns a context_only request's prefill and its answer (first token + disaggregated_params; the early
handover of overlap is overlap_worker.py), the token ids of a request's prompt, and its SamplingParams: the
context and the generation side build the same ones, so disaggregated tokens equal aggregated ones. Never
frees KV (backend.py) and never decodes (worker_app.py).
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from ..errors import KvBridgeError
from ..executor.sampling import SamplingParams
from ..executor.transceiver_hook import disagg_params
from .metrics import WorkerMetrics
from .protocol import ApiError, DisaggRequest, GenRequest, new_id

if TYPE_CHECKING:  # (worker_state imports overlap_worker, which imports this module)
    from .worker_state import WorkerState

__all__ = ["_context", "_context_answer", "_need_context", "_seed", "_sampling", "_prompt_ids", "_kv_bytes_per_token"]


async def _context(st: WorkerState, req: GenRequest, deadline: float) -> dict[str, Any]:
    spec, be = st.spec, st.backend
    _need_context(spec)
    prompt = _prompt_ids(st, req)
    seed = _seed(req)
    t0 = time.monotonic()
    res = await be.prefill(prompt, _sampling(st, req, seed), max(0.1, deadline - t0))
    return _context_answer(st, req, prompt, seed, res, t0)


def _need_context(spec) -> None:
    """A context_only request reached a generation worker: refused by name (400 wrong_role)."""
    if spec.role != "context":
        raise ApiError(400, f"{spec.name} is a generation worker; send context_only requests to a context "
                            f"worker", code="wrong_role", param="disaggregated_params")


def _seed(req: GenRequest) -> int:
    """A context request's seed (the router's, the client's, or a fresh one): the generation side uses it."""
    seed = req.disagg.seed if req.disagg and req.disagg.seed is not None else req.seed
    return secrets.randbits(31) if seed is None else seed


def _context_answer(st: WorkerState, req: GenRequest, prompt: list[int], seed: int, res, t0: float) -> dict:
    """The context worker's answer to a finished prefill: first token + disaggregated_params."""
    spec, be = st.spec, st.backend
    WorkerMetrics(spec.role).prefix(len(prompt), res.reused_tokens, _kv_bytes_per_token(be.ex.layout))
    wire = disagg_params(be.ex, res.request_id, st.endpoints)  # wire handle + secret
    st.record_handle(wire.ctx_request_id, res.request_id)
    out = DisaggRequest("generation_only", res.first_token, prompt, wire.to_dict(), seed, spec.name,
                        res.first_logprob)
    return {"id": new_id(req.kind), "object": "text_completion", "created": int(time.time()),
            "model": st.cfg.model_name,
            "choices": [{"index": 0, "text": st.codec.decode([res.first_token]), "finish_reason": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "disaggregated_params": out.to_dict(),
            "kvbridge": {"context_worker": spec.name, "prefill_ms": round((time.monotonic() - t0) * 1e3, 3),
                         "reused_tokens": res.reused_tokens,
                         "prefill_end_unix_ms": round(res.prefill_end * 1e3, 3)}}


def _sampling(st: WorkerState, req: GenRequest, seed: int) -> SamplingParams:
    """The executor's SamplingParams of a request (the same on the context and the generation side)."""
    vocab = st.backend.ex.model_config.vocab_size
    bad = next((t for t, _ in req.logit_bias if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"logit_bias: token id {bad} is outside the model's vocabulary 0..{vocab - 1}",
                       param="logit_bias")
    try:
        return SamplingParams(req.temperature, req.top_k, req.top_p, seed, req.presence_penalty,
                              req.frequency_penalty, req.repetition_penalty, req.logit_bias, req.min_tokens,
                              req.ignore_eos, req.logprobs)
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(":")[0].split(" ")[0]) from None


def _prompt_ids(st: WorkerState, req: GenRequest) -> list[int]:
    if req.kind == "chat":
        try:
            text = st.codec.chat_prompt(req.messages or [])
        except KvBridgeError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = st.codec.encode(text)
    else:
        ids = list(req.prompt) if isinstance(req.prompt, list) else st.codec.encode(req.prompt or "")
    mc = st.backend.ex.model_config
    bad = next((t for t in ids if t >= mc.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"prompt: token id {bad} is outside the model's vocabulary "
                            f"0..{mc.vocab_size - 1}", param="prompt")
    if len(ids) + req.max_tokens > mc.max_position:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                            f"{mc.max_position} positions", code="context_length_exceeded",
                       param="max_tokens")
    return ids


def _kv_bytes_per_token(layout) -> int:
    """KV bytes of one token over all ranks of an executor."""
    return sum(layout.block_bytes(r) for r in range(layout.world_size)) // layout.shape.tokens_per_block
