"""The tiny random Llama: written once per spec (cached by content), loadable, a tokenizer for all of it."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from kvbridge.integrations.vllm.tiny_model import TinyLlamaSpec, kv_bytes_per_token, tiny_llama


def test_a_model_is_written_once_per_spec_and_found_again_by_its_content(tmp_path):
    first = tiny_llama(TinyLlamaSpec(), tmp_path)
    stamp = {f: os.stat(first / f).st_mtime_ns for f in os.listdir(first)}
    t0 = time.monotonic()
    again = tiny_llama(TinyLlamaSpec(), tmp_path)
    assert again == first and time.monotonic() - t0 < 1.0
    assert {f: os.stat(first / f).st_mtime_ns for f in os.listdir(first)} == stamp  # not rewritten
    other = tiny_llama(TinyLlamaSpec(seed=1), tmp_path)
    assert other != first
    a, b = load_file(str(first / "model.safetensors")), load_file(str(other / "model.safetensors"))
    k = "model.layers.0.self_attn.k_proj.weight"
    assert not np.array_equal(a[k], b[k])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no temp folder


def test_the_weights_match_the_config_tensor_by_tensor(tmp_path):
    spec = TinyLlamaSpec(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=300)
    folder = tiny_llama(spec, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 300
    assert w["model.embed_tokens.weight"].shape == (300, 64)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert w["lm_head.weight"].shape == (300, 64)
    assert all(v.dtype == np.float32 for v in w.values())
    assert kv_bytes_per_token(spec) == 2 * 2 * 2 * 16 * 4


def test_the_tokenizer_covers_every_id_and_round_trips_text(tmp_path):
    folder = tiny_llama(TinyLlamaSpec(), tmp_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    text = "Write a haiku about the sea. Ünïcödé, digits 0123 and\ttabs."
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    for i in range(512):
        tok.decode([i])  # every id the model can emit decodes
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in cfg["chat_template"] and cfg["eos_token"] == "</s>"


@pytest.mark.parametrize("bad, field", [({"heads": 3, "kv_heads": 2}, "kv_heads"), ({"vocab": 100}, "vocab"),
                                        ({"layers": 0}, "layers")])
def test_a_bad_spec_is_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        TinyLlamaSpec(**bad)
