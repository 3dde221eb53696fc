"""bench/direct_gpu.py's per-rank agent options (`--gen-option RANK:key=value`): the generation side's
`transceiver.rank_options`, the context side's config untouched, and a malformed one refused before any process
starts."""

from __future__ import annotations

import pytest

from kvbridge.bench import direct_gpu
from kvbridge.transceiver import TransceiverConfig


def test_rank_options_go_to_the_generation_side_only():
    cfg = {"agents": ("cuda_ipc",), "options": {"cuda_ipc": {"post_chunk": 8192}}}
    got = direct_gpu._gen_cfg(cfg, "cuda_ipc", {1: {"launch_on": "peer"}})
    assert got["rank_options"] == {1: {"cuda_ipc": {"launch_on": "peer"}}}
    assert "rank_options" not in cfg and direct_gpu._gen_cfg(cfg, "cuda_ipc", {}) is cfg  # the context's config
    tc = TransceiverConfig(**got)
    assert tc.agent_options("cuda_ipc", 1) == {"post_chunk": 8192, "launch_on": "peer"}
    assert tc.agent_options("cuda_ipc", 0) == {"post_chunk": 8192}


@pytest.mark.parametrize("bad", ["launch_on=peer", "x:launch_on=peer", "1:launch_on"])
def test_a_malformed_rank_option_is_refused_naming_it(bad, capsys):
    with pytest.raises(SystemExit):
        direct_gpu.main(["--gen-option", bad, "--cpu"])
    assert f"--gen-option wants RANK:key=value, got {bad!r}" in capsys.readouterr().err


def test_spread_gives_every_rank_a_gpu_of_its_own_and_the_default_shares_two():
    assert direct_gpu.placement(1, 2, spread=True) == ([2], [0, 1])
    assert direct_gpu.placement(2, 1, spread=True) == ([1, 2], [0])
    assert direct_gpu.placement(1, 2, spread=False) == ([1], [0, 0])
    assert direct_gpu.placement(2, 1, spread=False) == ([1, 1], [0])
