"""Persistent KV reuse across executor instances: the second instance loads the prompt's KV instead of computing it.

TensorRT-LLM's KV Cache Connector example, on kvbridge's executor and its persistent store connector:
instance 1 answers a long prompt and saves the prompt's KV blocks to a folder, and is torn down; instance 2,
a fresh executor (new processes, empty pool), gets the same prompt, loads the stored blocks and computes only
the last partial block. Both answers must be identical (greedy).

    python examples/persistent_kv_cache.py                      # seeded model (fast), ~2000-token prompt
    python examples/persistent_kv_cache.py --model smollm2      # SmolLM2-135M-Instruct
    python examples/persistent_kv_cache.py --tp 2 --store /tmp/kvstore --keep

"Prefill time" is measured from submit to the first token (time to first token): for instance 2 it includes
finding the blocks, reading and verifying them, and computing the rest. Both instances first run a tiny
warm-up request (one that saves nothing), so neither timing includes one-time start-up costs.
Exit status: 0 when the outputs are identical and the second prefill was faster; 1 when outputs differ; 2 when
nothing was loaded; 3 when the load was not faster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

TEXT = ("Nvidia Corporation is an American technology company headquartered in Santa Clara, California. "
        "Founded in 1993 by Jensen Huang, Chris Malachowsky, and Curtis Priem, it develops graphics processing "
        "units (GPUs), systems on chips (SoCs), and application programming interfaces (APIs) for data science, "
        "high-performance computing, and mobile and automotive applications. ")


class Text:
    """Token ids for a model: SmolLM2's tokenizer, or UTF-8 bytes for the seeded models (vocabulary 256)."""

    def __init__(self, model: str) -> None:
        self.tok = None
        if model == "smollm2":
            from kvbridge.executor.gguf_model import GGUFFile, smollm2_path
            from kvbridge.executor.tokenizer import GGUFTokenizer

            self.tok = GGUFTokenizer(GGUFFile(smollm2_path()).meta)

    def prompt(self, tokens: int) -> list[int]:
        """A prompt of `tokens` tokens: numbered paragraphs of the company text, then a question."""
        question = self.encode("Tell me about the company.")
        body, i = "", 0
        while len(self.encode(body)) < tokens:
            i += 1
            body += f"[{i}] {TEXT}"
        return self.encode(body)[:max(0, tokens - len(question))] + question

    def encode(self, s: str) -> list[int]:
        return self.tok.encode(s) if self.tok else list(s.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return repr(self.tok.decode(ids)) if self.tok else f"token ids {ids}"  # a seeded model's bytes are noise


def run_instance(name: str, args, prompt: list[int]):
    """Start a fresh executor with the store connector, answer the prompt, tear it down."""
    from kvbridge.executor.connector import KvConnectorConfig
    from kvbridge.executor.runtime import Executor, ExecutorConfig

    tpb = args.tokens_per_block
    blocks = 2 * (-(-(len(prompt) + args.max_tokens) // tpb)) + 8
    cfg = ExecutorConfig(model=args.model, tp=args.tp, num_blocks=blocks, tokens_per_block=tpb, timeout_s=300,
                         device=args.device, kv_connector_config=KvConnectorConfig.persistent(args.store, max_bytes=args.max_bytes))
    t = time.perf_counter()
    with Executor.start(cfg) as ex:
        started = time.perf_counter() - t
        ex.wait(ex.submit(prompt[:tpb // 2], max_tokens=1))  # warm-up: no full block, nothing saved
        t0 = time.perf_counter()
        rid = ex.submit(prompt, max_tokens=args.max_tokens, stream=True)
        _, done = ex.wait_tokens(rid, 0, timeout=300)
        ttft = time.perf_counter() - t0
        c = done or ex.wait(rid, timeout=300)
        total = time.perf_counter() - t0
    print(f"{name}: start {started:.2f} s, prefill (time to first token) {ttft * 1000:.1f} ms, "
          f"answer {total * 1000:.1f} ms, {c.loaded_tokens} prompt tokens loaded "
          f"({c.loaded_tokens // tpb} blocks of {tpb})")
    return c, ttft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="seeded:tiny", help="seeded:tiny (default), smollm2, or any model spec")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="prompt length (default 2000; smollm2: 1000)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--store", default="", help="store folder (default: a temporary one, removed at the end)")
    ap.add_argument("--max-bytes", type=int, default=1 << 30, help="bound on the store folder (bytes)")
    ap.add_argument("--keep", action="store_true", help="keep the store folder")
    args = ap.parse_args(argv)
    tmp = None
    if not args.store:
        tmp = args.store = tempfile.mkdtemp(prefix="kvbridge-store-")
    try:
        text = Text(args.model)
        prompt = text.prompt(args.prompt_tokens or (1000 if args.model == "smollm2" else 2000))
        print(f"model {args.model}, TP{args.tp} on {args.device}, prompt {len(prompt)} tokens, store {args.store}")
        first, t1 = run_instance("instance 1 (computes, saves)", args, prompt)
        files = [os.path.join(d, f) for d, _, fs in os.walk(args.store) for f in fs if f.endswith(".kvb")]
        print(f"store: {len(files)} block files, {sum(os.path.getsize(f) for f in files)} bytes")
        second, t2 = run_instance("instance 2 (loads)           ", args, prompt)
        print(f"first output:  {text.decode(first.tokens)}")
        print(f"second output: {text.decode(second.tokens)}")
        same = first.tokens == second.tokens
        print(f"identical: {same}; prefill {t1 * 1000:.1f} ms -> {t2 * 1000:.1f} ms ({t1 / t2:.1f}x faster)")
        print("(identical: instance 2, from the loaded KV, decodes exactly the tokens instance 1 computed"
              + ("; a seeded model has random weights, so its output is nonsense by design)"
                 if args.model.startswith("seeded:") else ")"))
        if not same:
            return 1
        if second.loaded_tokens == 0:
            print("nothing was loaded from the store", file=sys.stderr)
            return 2
        return 0 if t2 < t1 else 3
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
