"""The OpenAI-compatible HTTP surface: request parsing, response and stream-chunk objects, error objects.

Owns validating a client's JSON (every bad field named in a 400 error), the `disaggregated_params` object
that travels router -> context worker -> router -> generation worker, and the shapes of what goes back.
Never runs a model and never trusts a peer: everything here is checked before it reaches an executor.

Non-standard fields: a request may carry `disaggregated_params` ({"request_type": "context_only"} or the
generation_only object a context worker returned); every response carries `kvbridge` (token ids, the KV
transfer's stats, which workers served it, whether the generation worker recomputed the prompt).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["ApiError", "GenRequest", "DisaggRequest", "parse_request", "parse_disagg", "response", "chunk",
           "usage_chunk", "sse", "SSE_DONE", "DEADLINE_HEADER", "new_id", "read_json"]

SSE_DONE = b"data: [DONE]\n\n"
MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) before it is read
DEADLINE_HEADER = "x-kvbridge-timeout-s"  # seconds the caller still waits for this hop
MAX_PROMPT_TOKENS = 1 << 20
MAX_PROMPT_CHARS = 8 << 20  # a text prompt (or a chat's messages together) longer than this is refused
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
                "tools": None, "functions": None, "tool_choice": None, "function_call": None,
                "parallel_tool_calls": None, "audio": None, "modalities": None, "prediction": None}


class ApiError(Exception):
    """An error returned to the client as {"error": {"message", "type", "code", "param"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after  # seconds; sent as Retry-After (429/503 of a busy or empty pool)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(max(1, round(self.retry_after)))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    @classmethod
    def from_body(cls, status: int, body: Any, prefix: str = "") -> "ApiError":
        """Rebuild an error a worker returned (anything else becomes a server_error naming what came)."""
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return cls(status, prefix + err["message"], str(err.get("type") or "server_error"),
                       err.get("code") if isinstance(err.get("code"), str) else None,
                       err.get("param") if isinstance(err.get("param"), str) else None)
        return cls(502 if status < 400 else status,
                   f"{prefix}unexpected answer (HTTP {status}): {body!r:.300}", "server_error",
                   "bad_worker_response")


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


@dataclass
class DisaggRequest:
    """`disaggregated_params`: context_only (no other field) or generation_only (the context's answer)."""

    request_type: str
    first_token: int | None = None
    prompt_token_ids: list[int] | None = None
    ctx_params: dict[str, Any] | None = None
    seed: int | None = None
    context_worker: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_type": self.request_type}
        if self.request_type == "generation_only":
            d.update(first_token=self.first_token, prompt_token_ids=self.prompt_token_ids,
                     ctx_params=self.ctx_params, seed=self.seed, context_worker=self.context_worker)
        return d


async def read_json(request, budget=None) -> Any:
    """The JSON body of a Starlette request: 413 when larger than MAX_BODY_BYTES, 400 when not strict JSON
    (NaN, Infinity, nested too deep: validate.loads_strict). `budget(n)`, if given, is told of every `n`
    bytes as they arrive (before the body is whole) and may refuse them by raising ApiError."""
    from .validate import loads_strict

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
    from .validate import GREEDY_BELOW, text_content
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for k, ok in _UNSUPPORTED.items():
        if body.get(k, ok) not in (ok, None) and not (k in ("logprobs",) and body.get(k) is False):
            raise ApiError(400, f"{k}={body[k]!r} is not supported by this server", code="unsupported",
                           param=k)
    if body.get("stop") not in (None, [], ""):
        raise ApiError(400, "stop sequences are not supported by this server (stop tokens of the model are)",
                       code="unsupported", param="stop")
    prompt = messages = None
    if kind == "completion":
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
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: expected a non-empty list of {role, content} objects",
                           param="messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                raise ApiError(400, f"messages[{i}]: expected {{'role': str, 'content': str}}",
                               param="messages")
        messages = [{"role": m["role"], "content": text_content(m["content"], f"messages[{i}]")}
                    for i, m in enumerate(messages)]
        if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise ApiError(400, f"messages: more than {MAX_PROMPT_CHARS} characters of content",
                           code="context_length_exceeded", param="messages")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if mt is None else _int(mt, "max_tokens", 1)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise ApiError(400, "stream_options: expected an object", param="stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model: expected a string", param="model")
    temperature = _num(body.get("temperature", 1.0), "temperature", 0.0, 100.0)
    top_p = _num(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p <= 0:
        raise ApiError(400, f"top_p: expected a number in (0, 1], got {body['top_p']!r}", param="top_p")
    return GenRequest(kind=kind, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
                      temperature=0.0 if temperature < GREEDY_BELOW else temperature, top_p=top_p,
                      top_k=_int(body.get("top_k", 0) or 0, "top_k", 0),
                      seed=None if body.get("seed") is None else _int(body["seed"], "seed", 0),
                      stream=_bool(body.get("stream", False), "stream"),
                      include_usage=_bool(so.get("include_usage", False), "stream_options.include_usage"),
                      disagg=parse_disagg(body.get("disaggregated_params")))


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
    return DisaggRequest("generation_only", first, ids, d["ctx_params"], _seed(d),
                         cw if isinstance(cw, str) else "")


# --- what goes back -------------------------------------------------------------------------------------
def response(rid: str, req: GenRequest, model: str, text: str, finish: str, prompt_len: int, n_out: int,
             extra: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(prompt_len, n_out), "kvbridge": extra}


def chunk(rid: str, req: GenRequest, model: str, text: str | None, finish: str | None,
          extra: dict[str, Any] | None = None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk: a text delta, and on the last one the finish reason."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if extra:
        out["kvbridge"] = extra
    return out


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


def _seed(d: dict) -> int | None:
    return None if d.get("seed") is None else _int(d["seed"], "disaggregated_params.seed", 0)


def _int(v: Any, name: str, lo: int, hi: int = (1 << 63) - 1) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ApiError(400, f"{name}: expected an integer in [{lo}, {hi}], got {v!r:.40}",
                       param=name.split(".")[0])
    return v


def _num(v: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # NaN fails here too
        raise ApiError(400, f"{name}: expected a number in [{lo}, {hi}], got {v!r:.40}", param=name)
    return float(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ApiError(400, f"{name}: expected true or false, got {v!r}", param=name.split(".")[0])
    return v
