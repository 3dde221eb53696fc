"""A prompt's token ids as a vLLM server will see them, for `policy: kv_aware` over vLLM servers (the router's
KV index is keyed by token ids: serving/kv_index.py).

Token ids a client gives are used as they are. Text, and chat messages, go to a healthy prefill server's own
`/tokenize` with what changes its tokenization (special tokens, the chat template and its arguments): vLLM's
tokenizer and template make the ids, so they match what its prefix cache hashes (a tokenizer of the router's
own would differ in a BOS token or a template detail and silently match nothing). One bounded request
(TOKENIZE_TIMEOUT_S, within the request's deadline); when it fails the request is routed least loaded, never
refused. Reads the answer as untrusted input (a list of non-negative ints, bounded). Never imports vLLM.
"""

from __future__ import annotations

import logging
import time

import httpx

from .kv_policy import given_tokens
from .relay import json_or_none

__all__ = ["TOKENIZE_TIMEOUT_S", "prompt_tokens"]

log = logging.getLogger("kvbridge.serving.vllm_backend")

TOKENIZE_TIMEOUT_S = 5.0
MAX_PROMPT_TOKENS = 1 << 22
# what changes how vLLM tokenizes a prompt or renders a chat (passed on to /tokenize as the request has them)
_TOKENIZE_KEYS = ("add_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "tools", "documents")


async def prompt_tokens(backend, body: dict, deadline: float) -> list[int] | None:
    """The prompt's token ids as vLLM will see them (`backend`: the router's VllmBackend, for its client,
    pools and API key): token ids given by the client as they are; text (or chat messages) through a healthy
    prefill server's own /tokenize. None when it cannot tell (the request is then routed least loaded)."""
    given = given_tokens(body)
    if given is not None:
        return given
    if isinstance(body.get("prompt"), str):
        req = {"prompt": body["prompt"]}
    elif isinstance(body.get("messages"), list):
        req = {"messages": body["messages"]}
    else:
        return None
    req.update({k: body[k] for k in _TOKENIZE_KEYS if k in body}, model=backend.r.cfg.model_name)
    w = backend.r.ctx.peek(set(), None, healthy_only=True)
    left = deadline - time.monotonic()
    if w is None or left <= 0:
        return None
    t = min(left, TOKENIZE_TIMEOUT_S)
    try:
        tmo = httpx.Timeout(t, connect=min(backend.r.rc.connect_timeout_s, t))
        r = await backend.r.client.post(w.url + "/tokenize", json=req, headers=backend.headers, timeout=tmo)
    except httpx.HTTPError as e:
        log.warning("router: %s/tokenize failed (%s); routing this request least loaded", w.name,
                    type(e).__name__)
        return None
    data = json_or_none(r.content)
    toks = data.get("tokens") if r.status_code == 200 and isinstance(data, dict) else None
    if not isinstance(toks, list) or not toks or len(toks) > MAX_PROMPT_TOKENS or \
            not all(type(t) is int and t >= 0 for t in toks):
        log.warning("router: %s/tokenize answered HTTP %s without token ids; routing this request least "
                    "loaded", w.name, r.status_code)
        return None
    return toks
