"""What one prefill -> decode request came to, against aggregated vLLM: exact, wrong, refused, hang or error.

Owns the classification of `kvbridge bench vllm-cells` (bench/vllm_cells.py) and nothing else: pure functions
over what the client saw (an `Answer`) and the aggregated server's answer to the same prompt. No vLLM, no
network, no clock: the fast tests pin every rule here.

The kinds, from the most to the least serious (a cell's row takes the most serious of its prompts):

    wrong    answered, but the tokens differ from aggregated, or a logprob differs by more than the tolerance,
             or (KVBridgeConnector) the positional KV check found a block that differs
    hang     no answer within the deadline (the prefill hop or the decode hop)
    error    the bench could not get an answer for another reason (a server died or did not start, a reset)
    refused  an error answer (HTTP >= 400, an error body or error chunk); the detail is the reason the decode
             (or prefill) server's log gave, else the client's message
    exact    tokens equal, every logprob within the tolerance, and (KVBridgeConnector) every block's KV equal

The logprob tolerance (`LOGPROB_TOL`) absorbs fp32 reduction-order noise between engines of different TP or
block size (measured at most 4.8e-7 on this model); KV read from the wrong blocks moved logprobs by 0.05-0.07.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KINDS", "LOGPROB_TOL", "Answer", "Outcome", "classify", "combine", "log_reason"]

KINDS = ("wrong", "hang", "error", "refused", "exact")  # most serious first
LOGPROB_TOL = 1e-4


@dataclass(frozen=True)
class Answer:
    """What the client saw of one prefill -> decode request.

    tokens / logprobs: the decode's greedy token ids and their logprobs (None when it did not answer).
    status: the HTTP status of the hop that failed, or of the decode hop. message: the client's error text.
    log_reason: what the servers' logs said about it (log_reason() of their new lines), "" if nothing.
    timed_out: no answer within the deadline; stage names the hop ("prefill" or "decode").
    failure: the bench's own failure to get an answer (a reset connection, a dead server), "" if none.
    kv_equal: the positional KV check (KVBridgeConnector's digests, prefill vs decode side); None: none made.
    """

    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    status: int | None = None
    message: str = ""
    log_reason: str = ""
    timed_out: bool = False
    stage: str = "decode"
    failure: str = ""
    kv_equal: bool | None = None
    kv_detail: str = ""


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str
    max_dlogprob: float | None = None


def classify(ref_tokens: list[int], ref_logprobs: list[float] | None, a: Answer,
             tol: float = LOGPROB_TOL) -> Outcome:
    """One request's outcome against the aggregated answer (ref_tokens, ref_logprobs) to the same prompt."""
    if a.timed_out:
        return Outcome("hang", f"{a.stage} hop: no answer within the deadline"
                               + (f"; log: {a.log_reason}" if a.log_reason else ""))
    if a.failure:
        return Outcome("error", a.failure + (f"; log: {a.log_reason}" if a.log_reason else ""))
    if a.tokens is None or (a.status is not None and a.status >= 400) or a.message:
        why = a.log_reason or a.message or f"HTTP {a.status}"
        return Outcome("refused", f"{a.stage} hop: {why}" if a.stage != "decode" else why)
    if a.tokens != ref_tokens:
        first = next((i for i, (x, y) in enumerate(zip(a.tokens, ref_tokens)) if x != y),
                     min(len(a.tokens), len(ref_tokens)))
        return Outcome("wrong", f"tokens differ from aggregated at position {first} "
                                f"({len(a.tokens)} vs {len(ref_tokens)} tokens)")
    dlp = None
    if ref_logprobs is not None:
        if a.logprobs is None or len(a.logprobs) != len(ref_logprobs):
            return Outcome("wrong", "tokens equal, but the logprobs are missing or of another length")
        dlp = max((abs(x - y) for x, y in zip(a.logprobs, ref_logprobs)), default=0.0)
        if not dlp <= tol:  # NaN is wrong too
            return Outcome("wrong", f"tokens equal, logprobs off by up to {dlp:.2g}", dlp)
    if a.kv_equal is False:
        return Outcome("wrong", f"tokens equal, KV differs: {a.kv_detail or 'positional check failed'}", dlp)
    kv = {True: ", KV equal position by position", None: ""}[a.kv_equal]
    return Outcome("exact", f"tokens + logprobs equal (max |dlogprob| {dlp or 0:.1g}){kv}", dlp)


def combine(outcomes: list[Outcome]) -> tuple[str, str]:
    """A cell's row from its prompts' outcomes: (outcome, detail).

    outcome is the most serious kind among them (KINDS), written `exact`, `wrong`, `hang`, `refused: <each
    distinct reason, up to three>` or `error: <the same>`; detail counts each kind ("3/3 exact") with what
    it was (exact: the largest logprob difference; other kinds: the first prompt's reason), the outcome's own
    reasons not repeated.
    """
    if not outcomes:
        return "error: no request was run", ""
    kinds = [k for k in KINDS if any(o.kind == k for o in outcomes)]
    kind, n = kinds[0], len(outcomes)
    reasons = list(dict.fromkeys(o.detail for o in outcomes if o.kind == kind))
    outcome = f"{kind}: {'; '.join(reasons[:3])}" if kind in ("refused", "error") else kind
    parts = []
    for k in kinds:
        of_k = [o for o in outcomes if o.kind == k]
        worst = max(of_k, key=lambda o: o.max_dlogprob or 0.0) if k == "exact" else of_k[0]
        same = k == kind and kind in ("refused", "error")
        parts.append(f"{len(of_k)}/{n} {k}" + ("" if same else f": {worst.detail}"))
    return outcome, "; ".join(parts)


_KVBRIDGE = re.compile(r"kvbridge: (.*?(?:refused|failed)[^\n]*)")
_EXC = re.compile(r"\b((?:[\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exceeded|Gone|NotFound))\b: ?([^\n]*)")
_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:([A-Z]+)\s+\d\d-\d\d [\d:]+\s+\[[^\]]*\]\s*)?")


def log_reason(text: str, limit: int = 300) -> str:
    """The reason a server's new log lines give for a failed request, or "".

    KVBridgeConnector's own line first ("kvbridge: ... refused: <why>" or "... failed: <why>", the request's id
    left out), else the first
    exception line (`SomeError: message`, the root of a chained traceback) outside traceback frames, with
    vLLM's logging prefix removed; cut to `limit` characters.
    """
    m = _KVBRIDGE.search(text)
    if m:  # without the request's id: the same refusal reads the same on every prompt
        why = re.sub(r"^request \S+: ", "", m.group(1).strip())
        return re.sub(r"^KV load of request \S+ ", "KV load ", why)[:limit]
    for line in text.splitlines():
        p = _PREFIX.match(line.strip())
        body = line.strip()[p.end():]
        if p.group(1) in ("INFO", "DEBUG") or not body or body.startswith(("File ", "Traceback", "raise ", "^")):
            continue
        m = _EXC.search(body)
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}".rstrip(": ")[:limit]
    return ""
