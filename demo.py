"""`make demo` / `kvbridge demo`: disaggregated serving of a real model on CPU, checked against aggregated.

Launches SmolLM2-135M-Instruct as a context worker at TP3 (its 3 kv heads split over 3 rank processes) and
a generation worker at TP1 (all 3 heads on one rank), plus the OpenAI-compatible router, exactly as
`kvbridge serve` does. Chat prompts go through the router over HTTP: the context worker prefills, the
transceiver moves each prompt's KV from the 3 context ranks into the generation rank, which decodes. Each
answer is printed with its transfer stats and checked token for token against one aggregated executor
running the same prompts greedily; at the end every worker's KV pool must be full again. Exits 0 only if
every answer matched and nothing failed; every process it started is stopped on the way out. No network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["What is the capital of France?", "Name the three primary colors.", "Write a haiku about the sea.",
           "What is 12 times 12?"]
BLOCKS = 128
IDENTICAL = """
      identical = the disaggregated answer has exactly the tokens of aggregated decoding of the
      same prompt (greedy, same model): the KV crossed intact. SmolLM2-135M is a small model and
      can still answer wrongly (both ways alike): that is the model, not the transfer."""


def _config(agent: str) -> dict:
    return {"model": "smollm2", "on_transfer_failure": "fail",  # a failed transfer must show, not be hidden
            "executor": {"num_blocks": BLOCKS, "tokens_per_block": 16, "threads_per_rank": 1,
                         "timeout_s": 240},
            "transceiver": {"agent": agent, "transfer_timeout_s": 120, "peer_timeout_s": 60, "lease_s": 60,
                            "heartbeat_s": 1},
            "router": {"port": 0, "request_timeout_s": 300, "context_timeout_s": 240},
            "context_servers": {"tp": 3}, "generation_servers": {"tp": 1}, "startup_timeout_s": 300}


class _Out:
    """Terminal output: colour when stdout is a terminal, plain text otherwise."""

    def __init__(self) -> None:
        self.color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None

    def c(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def step(self, n: int, total: int, text: str) -> None:
        print(self.c(f"[{n}/{total}]", "1;36") + f" {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (default 24)")
    ap.add_argument("--agent", default="auto", help="transceiver agent: auto (nixl on CPU), nixl, tcp, ...")
    ap.add_argument("--prompt", action="append", help="a chat prompt (repeatable; default: four of ours)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the workers' logs (the folder is printed)")
    a = ap.parse_args(argv if argv is not None else [])
    t_start = time.monotonic()
    out = _Out()
    import httpx

    from .errors import KvBridgeError
    from .serving.config import parse_config
    from .serving.launcher import Cluster

    prompts = a.prompt or PROMPTS
    print(out.c("kvbridge demo", "1") + " - disaggregated serving of SmolLM2-135M-Instruct on CPU, offline\n")
    log_dir = tempfile.mkdtemp(prefix="kvbridge-demo-")
    ref = _Reference(prompts, a.max_tokens)
    cluster = None
    ok = False
    try:
        out.step(1, 4, "starting the context worker (TP3), the generation worker (TP1) and the router; "
                       "the aggregated reference alongside ...")
        ref.start()
        cluster = Cluster(parse_config(_config(a.agent)), log_dir=log_dir)
        cluster.start()
        took = cluster.wait_healthy()
        ctx_url, gen_url, api = cluster.cfg.context[0].url, cluster.cfg.generation[0].url, cluster.router_url
        with httpx.Client(timeout=300, headers=cluster.headers) as http:  # the workers want the token
            _topology(out, http, ctx_url, gen_url, api, took)
            out.step(2, 4, "one request streamed through the router (POST /v1/chat/completions, stream):")
            results = [_stream(out, http, api, prompts[0], a.max_tokens)]
            if prompts[1:]:
                n = len(prompts) - 1
                out.step(3, 4, f"{n} more requests at once (batched by the generation worker) ...")
                with ThreadPoolExecutor(len(prompts) - 1) as pool:
                    results += list(pool.map(lambda p: _ask(http, api, p, a.max_tokens), prompts[1:]))
            want = ref.result(300)
            out.step(4, 4, "answers, KV transfers, and the same prompts on an aggregated executor:\n")
            ok = _report(out, prompts, results, want)
            ok &= _pools_full(out, http, ctx_url, gen_url)
    except (KvBridgeError, httpx.HTTPError, RuntimeError, TimeoutError) as e:
        print(out.c(f"\nFAILED: {type(e).__name__}: {e}", "1;31"), file=sys.stderr)
        if cluster is not None:
            print(f"(worker logs: {log_dir})", file=sys.stderr)
            a.keep_logs = True
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.stop()
        ref.stop()
        if not a.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    total = time.monotonic() - t_start
    print(out.c("\nOK", "1;32") + f": every answer equals aggregated decoding; every KV block came home "
          f"({total:.0f} s)" if ok else out.c(f"\nFAILED ({total:.0f} s)", "1;31"))
    return 0 if ok else 1


class _Reference(threading.Thread):
    """One aggregated executor (TP1) answering the same chat prompts greedily, while the cluster starts."""

    def __init__(self, prompts: list[str], max_tokens: int) -> None:
        super().__init__(daemon=True, name="kvbridge-demo-reference")
        self.prompts, self.max_tokens = prompts, max_tokens
        self.tokens: list[list[int]] | None = None
        self.error: BaseException | None = None
        self.ex = None

    def run(self) -> None:
        from .executor.runtime import Executor, ExecutorConfig
        from .serving.text import TextCodec

        try:
            codec = TextCodec("smollm2")
            ids = [codec.encode(codec.chat_prompt([{"role": "user", "content": p}])) for p in self.prompts]
            self.ex = Executor.start(ExecutorConfig(model="smollm2", num_blocks=BLOCKS, threads_per_rank=1,
                                                    timeout_s=240))
            self.tokens = self.ex.generate(ids, max_tokens=self.max_tokens, timeout=240)
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self.error = e
        finally:
            if self.ex is not None:
                self.ex.close()

    def result(self, timeout: float) -> list[list[int]]:
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"the aggregated reference did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"the aggregated reference failed: {self.error}")
        return self.tokens

    def stop(self) -> None:
        if self.is_alive() and self.ex is not None:
            self.ex.close()
        self.join(30)


def _topology(out: _Out, http, ctx_url: str, gen_url: str, api: str, took: float) -> None:
    from .formatter.layout import KVLayout

    for name, url in (("context worker", ctx_url), ("generation worker", gen_url)):
        h = http.get(url + "/health").json()
        lay = KVLayout.from_wire(h["layout"])
        heads = ", ".join(f"rank {r}: kv heads {_heads(lay.head_range(lay.coords(r)[0]))}"
                          for r in range(lay.world_size))
        print(f"      {name:<18} TP{lay.split.tp} x PP{lay.split.pp}  {url}  ({heads})")
    print(f"      {'router':<18} OpenAI API at {api}/v1   — all healthy after {took:.1f} s\n")


def _heads(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def _ask(http, api: str, prompt: str, max_tokens: int) -> dict:
    r = http.post(api + "/v1/chat/completions", json=_body(prompt, max_tokens, False))
    body = r.json()
    if r.status_code != 200:
        raise RuntimeError(f"{prompt!r}: HTTP {r.status_code}: {body.get('error', body)}")
    return {"text": body["choices"][0]["message"]["content"], "kvbridge": body["kvbridge"]}


def _stream(out: _Out, http, api: str, prompt: str, max_tokens: int) -> dict:
    import json

    print(out.c(f"      > {prompt}", "2"))
    print("        ", end="", flush=True)
    text, tokens, last = "", [], None
    with http.stream("POST", api + "/v1/chat/completions", json=_body(prompt, max_tokens, True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{prompt!r}: HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"{prompt!r}: the stream failed: {ev['error']['message']}")
            if not ev.get("choices"):
                continue
            piece = ev["choices"][0]["delta"].get("content", "")
            print(piece.replace("\n", "\n        "), end="", flush=True)
            text += piece
            tokens += ev["kvbridge"]["token_ids"]
            last = ev
    print("\n")
    if last is None:
        raise RuntimeError(f"{prompt!r}: the stream ended without an answer")
    return {"text": text, "kvbridge": {**last["kvbridge"], "token_ids": tokens}}


def _report(out: _Out, prompts: list[str], results: list[dict], want: list[list[int]]) -> bool:
    ok = True
    print(f"      {'prompt':<32} {'answer':<44} {'KV bytes':>10} {'frags':>6} {'ms':>7}  agent  aggregated")
    for p, res, w in zip(prompts, results, want):
        kb = res["kvbridge"]
        t = kb.get("transfer") or {}
        same = kb["token_ids"] == w
        ok &= same and not kb.get("recomputed")
        answer = " ".join(res["text"].split())
        diff = f"DIFFERS ({_first_diff(kb['token_ids'], w)})"
        mark = out.c("identical", "32") if same else out.c(diff, "1;31")
        print(f"      {_cut(p, 32):<32} {_cut(answer, 44):<44} {t.get('bytes', 0):>10,} "
              f"{t.get('fragments', 0):>6} {t.get('ms', {}).get('total', 0):>7.1f}  "
              f"{'+'.join(t.get('agents', ['?'])):<5}  {mark}")
    print(out.c(IDENTICAL, "2"))
    return ok


def _first_diff(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"from token {i}"


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _pools_full(out: _Out, http, ctx_url: str, gen_url: str) -> bool:
    """Every rank's pool back to all BLOCKS free (context blocks are released once the reader confirmed)."""
    deadline = time.monotonic() + 30
    while True:
        ctx = http.get(ctx_url + "/debug/free_blocks").json()["free_blocks"]
        gen = http.get(gen_url + "/debug/free_blocks").json()["free_blocks"]
        if all(f == BLOCKS for f in ctx + gen) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    full = all(f == BLOCKS for f in ctx + gen)
    line = f"\n      free KV blocks after: context ranks {ctx}, generation rank {gen} (of {BLOCKS} each)"
    print(line if full else out.c(line + " - blocks LEAKED", "1;31"))
    return full


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
