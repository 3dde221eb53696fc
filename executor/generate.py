"""`kvbridge generate`: run a prompt on the reference executor (aggregated mode) and print the completion.

    kvbridge generate --model smollm2 --prompt "What is the capital of France?"
    kvbridge generate --model seeded:tiny --tp 2 --pp 2 --prompt "abc" --max-tokens 16

Prints the completion on stdout and one timing line on stderr. Models without a tokenizer (seeded) take the
prompt's UTF-8 bytes as token ids and print token ids.
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

__all__ = ["main"]


class _Text:
    """Text <-> ids for a model spec: the GGUF's tokenizer, a Hugging Face tokenizer.json, or raw bytes."""

    def __init__(self, spec: str) -> None:
        self.tok = self.hf = self.template = None
        if spec == "smollm2" or spec.startswith("gguf:"):
            from .gguf_model import GGUFFile, smollm2_path
            from .tokenizer import GGUFTokenizer

            self.tok = GGUFTokenizer(GGUFFile(smollm2_path() if spec == "smollm2" else spec[5:]).meta)
        elif os.path.isdir(spec):
            from .hf_model import hf_tokenizer

            self.hf, self.template = hf_tokenizer(spec)

    @property
    def has_chat(self) -> bool:
        return bool(self.tok.chat_template if self.tok else self.template)

    def prompt_ids(self, text: str, chat: bool) -> list[int]:
        if self.tok:
            return self.tok.encode(self.tok.apply_chat_template([{"role": "user",
                                                                  "content": text}]) if chat else text)
        if self.hf:
            if chat and self.template:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                text = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                    self.template).render(messages=[{"role": "user", "content": text}],
                                          add_generation_prompt=True)
            return self.hf.encode(text, add_special_tokens=False).ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.tok:
            return self.tok.decode(ids)
        if self.hf:
            return self.hf.decode(ids, skip_special_tokens=True)
        return " ".join(map(str, ids))


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
        text = _Text(a.model)
        chat = text.has_chat if a.chat is None else a.chat
        ids = text.prompt_ids(a.prompt, chat)
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
    print(text.decode(out))
    print(f"[kvbridge generate] {a.model} TP{a.tp}xPP{a.pp} {a.device}: prompt {len(ids)} tokens, "
          f"{len(out)} new; "
          f"load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s, total {t2 - t0:.1f}s", file=sys.stderr)
    return 0
