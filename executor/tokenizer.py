"""Text <-> tokens for GGUF models: the byte-level BPE and the chat template stored in the file.

Owns building a `tokenizers` BPE from tokenizer.ggml.{tokens,merges,token_type} (GPT-2 byte-level, with the
pre-tokenizer llama.cpp names in tokenizer.ggml.pre) and rendering tokenizer.chat_template with a sandboxed
Jinja environment (the template is data from a file: it may not call out). Fully offline.
"""

from __future__ import annotations

from ..errors import ExecutorError

__all__ = ["GGUFTokenizer"]

CONTROL = 3  # llama.cpp token type of special/control tokens


class GGUFTokenizer:
    """Tokenizer and chat template of a GGUF model.

    Args:
        meta: the GGUF metadata (GGUFFile.meta).
    """

    def __init__(self, meta: dict) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ExecutorError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r}: only byte-level BPE "
                                f"('gpt2') GGUF tokenizers are supported")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact", "codeshell"):
            # llama.cpp: each digit alone, then GPT-2's byte-level split
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         byte_level])
        elif pre in ("gpt2", "default"):
            tok.pre_tokenizer = byte_level
        else:
            raise ExecutorError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, starcoder, gpt2)")
        tok.decoder = decoders.ByteLevel()
        self.special = {i for i, t in enumerate(types) if t == CONTROL}
        tok.add_special_tokens([AddedToken(tokens[i], special=True,
                                           normalized=False) for i in sorted(self.special)])
        self._tok = tok
        self.tokens = tokens
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = meta.get("tokenizer.chat_template")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to their ids."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [int(self.bos_id)] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (sandboxed Jinja)."""
        if not self.chat_template:
            raise ExecutorError("this model has no chat template; use --no-chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        tokens = self.tokens
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tokens[self.bos_id] if self.bos_id is not None else "",
            eos_token=tokens[self.eos_id] if self.eos_id is not None else "")
