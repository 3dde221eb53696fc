"""Request-level OpenAI features the router serves by fanning one request out: `n` > 1, a list of prompts,
`echo`; and merging what comes back (choices indexed, usage summed, streams interleaved).

Owns turning one client body into `Part`s (each a one-choice body a worker accepts, validated here with
protocol.parse_request, so a bad field is a 400 before any hop) and the merge of their answers. Never talks
to a worker: the router runs each part and hands the answers back here.

Usage of a fan-out: prompt tokens counted once per distinct prompt, completion tokens summed over choices.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from .protocol import ApiError, parse_request
from .validate import INT64_MAX, text_content

__all__ = ["Part", "expand", "expand_unread", "merge", "merge_streams", "MAX_CHOICES"]

MAX_CHOICES = 64  # n x prompts of one request


@dataclass(frozen=True)
class Part:
    """One choice of a request: `index` in the answer, which prompt it came from, the body a worker gets."""

    index: int
    prompt_index: int
    body: dict[str, Any]
    echo: str | None  # the prompt text to prepend (echo), or None


def _n(body: dict) -> int:
    n = body.get("n", 1)
    n = 1 if n is None else n
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n: expected an integer in [1, {MAX_CHOICES}], got {n!r:.40}", param="n")
    bo = body.get("best_of")
    if bo is not None and bo != 1 and bo != n:
        raise ApiError(400, f"best_of={bo!r:.40} is not supported by this server (only best_of == n)",
                       code="unsupported", param="best_of")
    return n


def _prompts(body: dict) -> list[Any]:
    """A completions body's prompts: a list of prompts (strings or token-id lists; a batch of one is that
    prompt), else the one prompt as given (parse_request or the engine judges it)."""
    p = body.get("prompt")
    batch = isinstance(p, list) and len(p) > 0 and all(isinstance(x, (str, list)) for x in p)
    return list(p) if batch else [p]


def _echo(body: dict, kind: str) -> bool:
    echo = body.get("echo", False)
    if echo in (None, False):
        return False
    if echo is not True or kind != "completion":
        raise ApiError(400, "echo: expected true or false (completions only)", param="echo")
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "echo together with logprobs is not supported by this server", code="unsupported",
                       param="echo")
    return True


def _response_format(body: dict) -> None:
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported by this server",
                       code="unsupported", param="response_format")


def expand(body: dict, kind: str, default_max_tokens: int, decode=lambda ids: "") -> list[Part]:
    """The parts of one request (validated); ApiError(400) naming the first bad field."""
    n = _n(body)
    _response_format(body)
    echo_wanted = _echo(body, kind)
    prompts = _prompts(body) if kind == "completion" else [None]
    base = {k: v for k, v in body.items() if k not in ("n", "best_of", "echo", "response_format")}
    if kind == "chat" and isinstance(body.get("messages"), list):
        base["messages"] = [{**m, "content": text_content(m["content"], f"messages[{i}]")}
                            if isinstance(m, dict) and "content" in m else m
                            for i, m in enumerate(body["messages"])]
    parts, echo = [], None
    for sub, pi, j in _choices(body, base, kind, prompts, n):
        parse_request(sub, kind, default_max_tokens)  # every field checked before any hop
        if j == 0 and echo_wanted:  # every choice of a prompt echoes it
            echo = prompts[pi] if isinstance(prompts[pi], str) else decode(prompts[pi])
        parts.append(Part(len(parts), pi, sub, echo))
    return parts


def expand_unread(body: dict, kind: str, model: str) -> list[Part]:
    """The parts of one request for workers that validate its fields themselves (`engine: vllm`): `n`
    choices and a list of prompts fan out here, every other field passes through unread (echo included:
    each part's answer carries its own); `model` is set to the one the workers serve."""
    n = _n(body)
    prompts = _prompts(body) if kind == "completion" else [None]
    base = {k: v for k, v in body.items() if k not in ("n", "best_of")}
    base["model"] = model
    return [Part(i, pi, sub, None) for i, (sub, pi, _j) in enumerate(_choices(body, base, kind, prompts, n))]


def _choices(body: dict, base: dict, kind: str, prompts: list, n: int):
    """(body, prompt index, choice index within its prompt) of every choice: a seeded request's choice j
    gets seed + j (else its n choices would be one)."""
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"n x prompts = {n * len(prompts)} choices; at most {MAX_CHOICES} per request",
                       param="n")
    for pi, prompt in enumerate(prompts):
        for j in range(n):
            sub = dict(base) if kind == "chat" else {**base, "prompt": prompt}
            if n > 1 and type(body.get("seed")) is int and 0 <= body["seed"] <= INT64_MAX:
                sub["seed"] = (body["seed"] + j) % (INT64_MAX + 1)
            yield sub, pi, j


def _usage_of(objs: list[dict], parts: list[Part]) -> dict[str, int]:
    p = c = 0
    seen: set[int] = set()
    for part, o in zip(parts, objs):
        u = o.get("usage") if isinstance(o.get("usage"), dict) else {}
        if part.prompt_index not in seen:
            seen.add(part.prompt_index)
            p += int(u.get("prompt_tokens", 0))
        c += int(u.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def merge(objs: list[dict], parts: list[Part]) -> dict:
    """One answer from the parts' whole answers (in part order)."""
    if len(objs) == 1 and parts[0].echo is None:
        return objs[0]
    out = dict(objs[0])
    choices = []
    for part, o in zip(parts, objs):
        ch = {**o["choices"][0], "index": part.index}
        if part.echo is not None:
            ch["text"] = part.echo + ch.get("text", "")
        choices.append(ch)
    out["choices"], out["usage"] = choices, _usage_of(objs, parts)
    if len(objs) > 1:
        out["kvbridge"] = {"choices": [o.get("kvbridge") for o in objs]}
    return out


def _rewrite(obj: dict, part: Part, first: bool) -> dict:
    choices = []
    for ch in obj.get("choices") or []:
        ch = {**ch, "index": part.index}
        if first and part.echo is not None and "text" in ch:
            ch["text"] = part.echo + (ch.get("text") or "")
        choices.append(ch)
    return {**obj, "choices": choices}


async def merge_streams(streams: list[AsyncIterator[dict]], parts: list[Part]) -> AsyncIterator[dict]:
    """Interleave the parts' event objects (choices re-indexed, echo on each part's first chunk); the parts'
    usage chunks (choices == []) are summed into one, sent last. An ApiError of any part ends the merge."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(s: AsyncIterator[dict], part: Part) -> None:
        try:
            async for obj in s:
                await q.put((part, obj))
            await q.put((part, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await q.put((part, e))

    tasks = [asyncio.ensure_future(pump(s, p)) for s, p in zip(streams, parts)]
    usage: dict[int, dict] = {}
    started: set[int] = set()
    try:
        left = len(tasks)
        while left:
            part, obj = await q.get()
            if isinstance(obj, BaseException):
                raise obj
            if obj is None:
                left -= 1
            elif not obj.get("choices") and isinstance(obj.get("usage"), dict):
                usage[part.index] = obj
            else:
                yield _rewrite(obj, part, part.index not in started)
                started.add(part.index)
        if usage:
            objs = [usage.get(p.index, {}) for p in parts]
            any_u = next(iter(usage.values()))
            yield {**any_u, "usage": _usage_of(objs, parts)}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:  # each part's stream ends here, iterated to its end or not
            await s.aclose()
