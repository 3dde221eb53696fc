"""Model sources: a Hugging Face safetensors directory serves the same model; bad specs fail clearly; CLI."""

from __future__ import annotations

import json

import pytest
import torch

from kvbridge.errors import ExecutorError
from kvbridge.executor.config import parse_seeded_spec
from kvbridge.executor.hf_model import SafetensorsWeights, save_safetensors_dir
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.sources import load_source
from kvbridge.executor.weights import SeededWeights, weight_names


def test_safetensors_directory_round_trips_every_tensor(tmp_path):
    src = SeededWeights(*parse_seeded_spec("seeded:tiny-tied,layers=3"))
    save_safetensors_dir(src, str(tmp_path))
    st = load_source(str(tmp_path))
    assert isinstance(st, SafetensorsWeights) and st.config == src.config
    for n in weight_names(src.config):
        assert torch.equal(st.get(n), src.get(n)), n


def test_safetensors_model_decodes_like_its_seeded_original_at_tp2(tmp_path):
    save_safetensors_dir(SeededWeights(*parse_seeded_spec("seeded:tiny")), str(tmp_path))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    outs = []
    for model, tp in (("seeded:tiny", 1), (str(tmp_path), 2)):
        with Executor.start(ExecutorConfig(model=model, tp=tp, num_blocks=16, tokens_per_block=4,
                                           timeout_s=60)) as ex:
            outs.append(ex.generate([prompt], max_tokens=8)[0])
    assert outs[0] == outs[1]


def test_bad_specs_and_configs_fail_with_a_reason(tmp_path):
    with pytest.raises(ExecutorError, match="unknown model 'nope'"):
        load_source("nope")
    with pytest.raises(ExecutorError, match="unknown seeded preset"):
        load_source("seeded:huge")
    with pytest.raises(ExecutorError, match="unknown key 'wat'"):
        load_source("seeded:tiny,wat=3")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ExecutorError, match="supported"):
        load_source(str(tmp_path))


def test_generate_cli_prints_the_completion(capsys):
    from kvbridge.cli import main

    assert main(["generate", "--model", "seeded:tiny", "--tp", "2", "--prompt", "abc", "--max-tokens",
                 "5"]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 5 and "TP2xPP1" in err
