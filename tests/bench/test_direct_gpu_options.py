"""bench/direct_gpu.py's per-rank agent options (`--gen-option RANK:key=value`): merged into that generation rank's
config only, the shared config untouched, and a malformed one refused before any process starts."""

from __future__ import annotations

import pytest

from kvbridge.bench import direct_gpu


def test_a_rank_option_is_merged_into_a_copy_for_that_agent_only():
    cfg = {"agents": ("cuda_ipc",), "options": {"cuda_ipc": {"post_chunk": 8192}, "nixl": {"x": 1}}}
    got = direct_gpu._rank_cfg(cfg, "cuda_ipc", {"launch_on": "peer"})
    assert got["options"]["cuda_ipc"] == {"post_chunk": 8192, "launch_on": "peer"}
    assert got["options"]["nixl"] == {"x": 1}
    assert cfg["options"]["cuda_ipc"] == {"post_chunk": 8192}  # the other ranks' config is unchanged
    assert direct_gpu._rank_cfg(cfg, "cuda_ipc", {}) is cfg
    assert direct_gpu._rank_cfg({"agents": ("cuda_ipc",)}, "cuda_ipc", {"max_blocks": 66})["options"] == {
        "cuda_ipc": {"max_blocks": 66}}


@pytest.mark.parametrize("bad", ["launch_on=peer", "x:launch_on=peer", "1:launch_on"])
def test_a_malformed_rank_option_is_refused_naming_it(bad, capsys):
    with pytest.raises(SystemExit):
        direct_gpu.main(["--gen-option", bad, "--cpu"])
    assert f"--gen-option wants RANK:key=value, got {bad!r}" in capsys.readouterr().err
