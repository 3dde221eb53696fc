"""`kvbridge generate`: run a prompt on the reference executor (aggregated mode) and print the completion.

    kvbridge generate --model smollm2 --prompt "What is the capital of France?"
    kvbridge generate --model seeded:tiny --tp 2 --pp 2 --prompt "abc" --max-tokens 16

Prints the completion on stdout and one timing line on stderr. Text goes through the one text codec
(`executor/text.py`, the serving workers' too); models without a tokenizer (seeded) take the prompt's UTF-8
bytes as token ids, and their completion is printed as token ids (a random model's bytes are rarely text).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import KvBridgeError
from .runtime import Executor, ExecutorConfig
from .sampling import SamplingParams
from .sources import describe_models
from .text import TextCodec

__all__ = ["main"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help=describe_models())
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--layers-per-stage", default=None, help="e.g. 20,10 (default: as even as possible)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="wrap the prompt in the model's chat template (default: when it has one)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (CUDA default), float16")
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        sp = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed, a.presence_penalty, a.frequency_penalty,
                            a.repetition_penalty, min_tokens=a.min_tokens, ignore_eos=a.ignore_eos)
    except ValueError as e:
        print(f"kvbridge generate: {e}", file=sys.stderr)
        return 2
    try:
        codec = TextCodec(a.model)
        chat = codec.has_chat_template if a.chat is None else a.chat
        ids = codec.encode(codec.chat_prompt([{"role": "user", "content": a.prompt}]) if chat else a.prompt)
        world = a.tp * a.pp
        cfg = ExecutorConfig(model=a.model, tp=a.tp, pp=a.pp, num_blocks=a.num_blocks,
                             tokens_per_block=a.tokens_per_block, device=a.device, dtype=a.dtype,
                             layers_per_stage=tuple(int(x) for x in a.layers_per_stage.split(","))
                             if a.layers_per_stage else None, timeout_s=a.timeout,
                             threads_per_rank=max(1, (os.cpu_count() or 1) // world))
        with Executor.start(cfg) as ex:
            t1 = time.monotonic()
            out = ex.generate([ids], max_tokens=a.max_tokens, sampling=sp, timeout=a.timeout)[0]
            t2 = time.monotonic()
    except KvBridgeError as e:
        print(f"kvbridge generate: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(codec.decode(out) if codec.has_tokenizer else " ".join(map(str, out)))
    print(f"[kvbridge generate] {a.model} TP{a.tp}xPP{a.pp} {a.device}: prompt {len(ids)} tokens, "
          f"{len(out)} new; "
          f"load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s, total {t2 - t0:.1f}s", file=sys.stderr)
    return 0
