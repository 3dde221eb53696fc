"""The OpenAI-compatible HTTP surface: request parsing, response and stream-chunk objects, error objects.

Owns validating a client's JSON (every bad field named in a 400 error), the `disaggregated_params` object
that travels router -> context worker -> router -> generation worker, and the shapes of what goes back.
Never runs a model and never trusts a peer: everything here is checked before it reaches an executor.

Token-level parameters honoured (checked here, applied by executor/sampling.py and serving/stops.py):
temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
min_tokens, ignore_eos, stop, logprobs (+ top_logprobs for chat). A value out of range is a 400 naming it.

Non-standard fields: a request may carry `disaggregated_params` ({"request_type": "context_only"} or the
generation_only object a context worker returned, with `first_logprob` when logprobs were asked for: the
context worker samples the first token); every response carries `kvbridge` (token ids, the KV transfer's
stats, which workers served it, whether the generation worker recomputed the prompt).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..executor.sampling import MAX_LOGIT_BIAS, TokenLogprob
from .api_error import ApiError
from .validate import GREEDY_BELOW, loads_strict, text_content

__all__ = ["ApiError", "GenRequest", "DisaggRequest", "parse_request", "parse_disagg", "response", "chunk",
           "usage_chunk", "sse", "SSE_DONE", "DEADLINE_HEADER", "new_id", "read_json", "logprobs_object"]

SSE_DONE = b"data: [DONE]\n\n"
MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) before it is read
DEADLINE_HEADER = "x-kvbridge-timeout-s"  # seconds the caller still waits for this hop
MAX_PROMPT_TOKENS = 1 << 20
MAX_STOPS, MAX_STOP_CHARS = 4, 1024
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's bounds: chat top_logprobs, completions logprobs
MAX_PROMPT_CHARS = 8 << 20  # a text prompt (or a chat's messages together) longer than this is refused
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "tools": None, "functions": None,
                "tool_choice": None, "function_call": None, "parallel_tool_calls": None, "audio": None,
                "modalities": None, "prediction": None}


@dataclass
class GenRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    kind: str                          # "completion" or "chat"
    model: str | None
    prompt: str | list[int] | None     # completions
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stream: bool
    include_usage: bool
    disagg: "DisaggRequest | None"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int = -1                 # -1: none; else top alternatives per token (chat 0..20, compl. 0..5)
    stop: tuple[str, ...] = ()         # generation ends at the first of these strings (not returned)


@dataclass
class DisaggRequest:
    """`disaggregated_params`: context_only (no other field) or generation_only (the context's answer)."""

    request_type: str
    first_token: int | None = None
    prompt_token_ids: list[int] | None = None
    ctx_params: dict[str, Any] | None = None
    seed: int | None = None
    context_worker: str = ""
    first_logprob: TokenLogprob | None = None  # the first token's logprobs, when the request asked for them

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_type": self.request_type}
        if self.request_type == "generation_only":
            d.update(first_token=self.first_token, prompt_token_ids=self.prompt_token_ids,
                     ctx_params=self.ctx_params, seed=self.seed, context_worker=self.context_worker)
            if self.first_logprob is not None:
                d["first_logprob"] = self.first_logprob.to_wire()
        return d


async def read_json(request, budget=None) -> Any:
    """The JSON body of a Starlette request: 413 when larger than MAX_BODY_BYTES, 400 when not strict JSON
    (NaN, Infinity, nested too deep: validate.loads_strict). `budget(n)`, if given, is told of every `n`
    bytes as they arrive (before the body is whole) and may refuse them by raising ApiError."""
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
        raise ApiError(413, f"the request body ({size} bytes) is larger than {MAX_BODY_BYTES} bytes",
                       code="body_too_large")
    data = bytearray()
    async for piece in request.stream():  # also bounds a chunked body that gave no length
        if budget is not None:
            budget(len(piece))
        data += piece
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                           code="body_too_large")
    return loads_strict(data)


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def parse_request(body: Any, kind: str, default_max_tokens: int) -> GenRequest:
    """Validate a request body; ApiError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for k, ok in _UNSUPPORTED.items():
        if body.get(k, ok) not in (ok, None) and not (k in ("logprobs",) and body.get(k) is False):
            raise ApiError(400, f"{k}={body[k]!r} is not supported by this server", code="unsupported",
                           param=k)
    prompt = _prompt(body) if kind == "completion" else None
    messages = _messages(body) if kind != "completion" else None
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if mt is None else _int(mt, "max_tokens", 1)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise ApiError(400, "stream_options: expected an object", param="stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model: expected a string", param="model")
    min_tokens = _int(_given(body, "min_tokens", 0), "min_tokens", 0)
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens: {min_tokens} is more than max_tokens ({max_tokens})",
                       param="min_tokens")
    temperature = _num(_given(body, "temperature", 1.0), "temperature", 0.0, 100.0)
    top_p = _num(_given(body, "top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p <= 0:
        raise ApiError(400, f"top_p: expected a number in (0, 1], got {body['top_p']!r}", param="top_p")
    return GenRequest(kind=kind, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
                      temperature=0.0 if temperature < GREEDY_BELOW else temperature, top_p=top_p,
                      top_k=_int(body.get("top_k", 0) or 0, "top_k", 0),
                      seed=None if body.get("seed") is None else _int(body["seed"], "seed", 0),
                      stream=_bool(body.get("stream", False), "stream"),
                      include_usage=_bool(so.get("include_usage", False), "stream_options.include_usage"),
                      disagg=parse_disagg(body.get("disaggregated_params")),
                      presence_penalty=_num(_given(body, "presence_penalty", 0.0), "presence_penalty",
                                            -2.0, 2.0),
                      frequency_penalty=_num(_given(body, "frequency_penalty", 0.0), "frequency_penalty",
                                             -2.0, 2.0),
                      repetition_penalty=_positive(_given(body, "repetition_penalty", 1.0),
                                                   "repetition_penalty"),
                      logit_bias=_logit_bias(body.get("logit_bias")), min_tokens=min_tokens,
                      ignore_eos=_bool(_given(body, "ignore_eos", False), "ignore_eos"),
                      logprobs=_logprobs(body, kind), stop=_stop(body.get("stop")))


def _prompt(body: dict) -> str | list[int]:
    """A completions prompt: a non-empty string (bounded) or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not _token_ids(prompt):
            raise ApiError(400, "prompt: a token-id prompt must be a non-empty list of non-negative "
                                "integers (one prompt per request)", param="prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt: expected a non-empty string or a list of token ids", param="prompt")
    elif len(prompt) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"prompt: {len(prompt)} characters; at most {MAX_PROMPT_CHARS}",
                       code="context_length_exceeded", param="prompt")
    return prompt


def _messages(body: dict) -> list[dict[str, str]]:
    """Chat messages as {role, content} with text content (text parts joined), bounded in total."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise ApiError(400, f"messages[{i}]: expected {{'role': str, 'content': str}}", param="messages")
    messages = [{"role": m["role"], "content": text_content(m["content"], f"messages[{i}]")}
                for i, m in enumerate(messages)]
    if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"messages: more than {MAX_PROMPT_CHARS} characters of content",
                       code="context_length_exceeded", param="messages")
    return messages


def parse_disagg(d: Any) -> DisaggRequest | None:
    """Validate `disaggregated_params` (the ctx_params inside are checked by DisaggParams.from_dict later)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ApiError(400, "disaggregated_params: expected an object", param="disaggregated_params")
    rt = d.get("request_type")
    if rt == "context_only":
        return DisaggRequest("context_only", seed=_seed(d))
    if rt != "generation_only":
        raise ApiError(400, f"disaggregated_params.request_type: {rt!r} is not 'context_only' or "
                            f"'generation_only'", param="disaggregated_params")
    ids = d.get("prompt_token_ids")
    if not _token_ids(ids):
        raise ApiError(400, "disaggregated_params.prompt_token_ids: expected a non-empty list of token ids",
                       param="disaggregated_params")
    if not isinstance(d.get("ctx_params"), dict):
        raise ApiError(400, "disaggregated_params.ctx_params: expected the object a context worker returned",
                       param="disaggregated_params")
    cw = d.get("context_worker", "")
    first = _int(d.get("first_token"), "disaggregated_params.first_token", 0)
    lp = None
    if d.get("first_logprob") is not None:
        try:
            lp = TokenLogprob.from_wire(d["first_logprob"])
        except ValueError as e:
            raise ApiError(400, f"disaggregated_params.first_logprob: {e}",
                           param="disaggregated_params") from None
    return DisaggRequest("generation_only", first, ids, d["ctx_params"], _seed(d),
                         cw if isinstance(cw, str) else "", lp)


# --- what goes back -------------------------------------------------------------------------------------
def response(rid: str, req: GenRequest, model: str, text: str, finish: str, prompt_len: int, n_out: int,
             extra: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion (`logprobs`: from logprobs_object)."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(prompt_len, n_out), "kvbridge": extra}


def chunk(rid: str, req: GenRequest, model: str, text: str | None, finish: str | None,
          extra: dict[str, Any] | None = None, first: bool = False,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta (and the logprobs of its tokens), and on the last one the finish
    reason."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if extra:
        out["kvbridge"] = extra
    return out


def logprobs_object(kind: str, tokens: list[int], entries: list[TokenLogprob],
                    piece_of: Callable[[int], tuple[str, list[int]]], offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs of `tokens` (entries aligned with them; piece_of(token) -> (text, bytes)): chat
    {"content": [{token, logprob, bytes, top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs,
    text_offset} (offsets from `offset`, the characters already sent before these tokens)."""
    if kind == "chat":
        def one(t: int, lp: float) -> dict[str, Any]:
            text, raw = piece_of(t)
            return {"token": text, "logprob": lp, "bytes": raw}
        return {"content": [{**one(t, e.logprob), "top_logprobs": [one(a, v) for a, v in e.top]}
                            for t, e in zip(tokens, entries)]}
    texts = [piece_of(t)[0] for t in tokens]
    offsets = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece_of(a)[0]: v for a, v in e.top} for e in entries], "text_offset": offsets}


def usage_chunk(rid: str, req: GenRequest, model: str, prompt_len: int, n_out: int) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": _usage(prompt_len, n_out)}


def add_common_routes(app, model_name: str, created: float, render) -> None:
    """The routes every kvbridge HTTP server has: GET /metrics (Prometheus, from `render()` -> (bytes,
    content type)) and GET /v1/models (the one served model, created at `created`)."""
    from fastapi.responses import Response

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, ctype = render()
        return Response(data, media_type=ctype)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(created),
                                            "owned_by": "kvbridge"}]}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(p: int, n: int) -> dict[str, int]:
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


# --- field checks ---------------------------------------------------------------------------------------
def _token_ids(v: Any) -> bool:
    return (isinstance(v, list) and 0 < len(v) <= MAX_PROMPT_TOKENS
            and all(type(t) is int and t >= 0 for t in v))


def _given(body: dict, name: str, default: Any) -> Any:
    """body[name], or `default` when absent or null (OpenAI clients send null for "not set")."""
    v = body.get(name)
    return default if v is None else v


def _positive(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
        raise ApiError(400, f"{name}: expected a number > 0, got {v!r}", param=name)
    return float(v)


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} (ids checked against the vocabulary by the worker)."""
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias: expected an object of at most {MAX_LOGIT_BIAS} token id -> bias "
                            f"entries", param="logit_bias")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 10):
            raise ApiError(400, f"logit_bias: key {k!r:.40} is not a token id", param="logit_bias")
        out.append((int(k), _num(b, f"logit_bias[{k}]", -100.0, 100.0, param="logit_bias")))
    return tuple(out)


def _logprobs(body: dict, kind: str) -> int:
    """How many top alternatives per token (-1: no logprobs). Chat: logprobs bool + top_logprobs 0..20;
    completions: logprobs 0..5."""
    hi = MAX_TOP_LOGPROBS[kind]
    v = body.get("logprobs")
    if kind == "completion":
        if v is None or v is False:
            return -1
        if type(v) is not int or not 0 <= v <= hi:
            raise ApiError(400, f"logprobs: expected an integer in [0, {hi}], got {v!r}", param="logprobs")
        return v
    on = False if v is None else _bool(v, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if on else -1
    if type(top) is not int or not 0 <= top <= hi:
        raise ApiError(400, f"top_logprobs: expected an integer in [0, {hi}], got {top!r}",
                       param="top_logprobs")
    if not on and top > 0:
        raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
    return top if on else -1


def _stop(v: Any) -> tuple[str, ...]:
    stops = [v] if isinstance(v, str) else v
    if stops is None:
        return ()
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(x, str) and len(x) <= MAX_STOP_CHARS for x in stops)):
        raise ApiError(400, f"stop: expected a string or a list of at most {MAX_STOPS} strings (each at most "
                            f"{MAX_STOP_CHARS} characters)", param="stop")
    return tuple(x for x in stops if x)


def _seed(d: dict) -> int | None:
    return None if d.get("seed") is None else _int(d["seed"], "disaggregated_params.seed", 0)


def _int(v: Any, name: str, lo: int, hi: int = (1 << 63) - 1) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ApiError(400, f"{name}: expected an integer in [{lo}, {hi}], got {v!r:.40}",
                       param=name.split(".")[0])
    return v


def _num(v: Any, name: str, lo: float, hi: float, param: str | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # NaN fails lo <= v
        raise ApiError(400, f"{name}: expected a number in [{lo}, {hi}], got {v!r:.40}", param=param or name)
    return float(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ApiError(400, f"{name}: expected true or false, got {v!r}", param=name.split(".")[0])
    return v
