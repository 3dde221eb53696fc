"""Text <-> token ids for a model spec: prompts, chat messages, and text streamed as tokens arrive.

The one text codec of kvbridge: `kvbridge generate` (executor/generate.py) and the serving workers
(serving/worker_app.py, through serving/text.py) both use it, so a prompt becomes the same ids everywhere.
Owns the choice of tokenizer for a model spec (the GGUF's byte-level BPE and chat template, a Hugging Face
tokenizer.json, or raw UTF-8 bytes for seeded models) and incremental detokenization. Never loads weights.
"""

from __future__ import annotations

import os

from ..errors import ExecutorError

__all__ = ["TextCodec", "Detokenizer", "REPLACEMENT"]

REPLACEMENT = "\ufffd"


class TextCodec:
    """Tokenizer of one model spec.

    Args:
        spec: the model spec the executor runs (smollm2, gguf:<file>, a safetensors directory, seeded:...).
    """

    def __init__(self, spec: str) -> None:
        self.tok = self.hf = None
        self.template: str | None = None
        self.eos_text = ""
        if spec == "smollm2" or spec.startswith("gguf:"):
            from .gguf_model import GGUFFile, smollm2_path
            from .tokenizer import GGUFTokenizer

            self.tok = GGUFTokenizer(GGUFFile(smollm2_path() if spec == "smollm2" else spec[5:]).meta)
            self.template = self.tok.chat_template
        elif os.path.isdir(spec):
            from .hf_model import hf_tokenizer

            self.hf, self.template = hf_tokenizer(spec)

    @property
    def has_tokenizer(self) -> bool:
        return self.tok is not None or self.hf is not None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.template)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (seeded models: its UTF-8 bytes)."""
        if self.tok:
            return self.tok.encode(text)
        if self.hf:
            return self.hf.encode(text, add_special_tokens=False).ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens left out (seeded models: the bytes as UTF-8, bad bytes replaced)."""
        if self.tok:
            return self.tok.decode(ids)
        if self.hf:
            return self.hf.decode(ids, skip_special_tokens=True)
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a chat: the model's chat template, or "role: content" lines without one."""
        if self.template:
            if self.tok:
                return self.tok.apply_chat_template(messages)
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            try:
                return env.from_string(self.template).render(messages=messages, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template error is the model's, reported as such
                raise ExecutorError(f"the model's chat template failed: {e}") from None
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Detokenizer:
    """Text of a growing token list, handed out in pieces that never split a UTF-8 character."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.sent = ""

    def delta(self, tokens: list[int], final: bool = False) -> str:
        """The text of `tokens` not handed out yet (held back while it ends inside a character)."""
        text = self.codec.decode(tokens)
        if not final and text.endswith(REPLACEMENT):
            return ""
        if not text.startswith(self.sent):  # decoding is not always prefix-stable: send what is new
            common = os.path.commonprefix([text, self.sent])
            out = text[len(common):]
        else:
            out = text[len(self.sent):]
        self.sent = text
        return out
