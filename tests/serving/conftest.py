"""Serving tests share one aggregated reference run (the tokens every disaggregated answer must equal)."""

from __future__ import annotations

import pytest

from kvbridge.serving.text import TextCodec

from .cluster import MODEL, PROMPTS, reference

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 10


@pytest.fixture(scope="session")
def want() -> dict:
    """Greedy tokens of one aggregated executor: 'prompts' (PROMPTS), 'chat' (CHAT through the template)."""
    codec = TextCodec(MODEL)
    chat_ids = codec.encode(codec.chat_prompt(CHAT))
    got = reference(PROMPTS + [chat_ids], MAX_TOKENS)
    return {"prompts": got[:-1], "chat": got[-1]}
