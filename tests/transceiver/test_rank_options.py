"""`transceiver.rank_options`: agent options for one rank, merged over `options` (e.g. cuda_ipc `launch_on: peer`
for one of two generation ranks sharing a GPU). Real NIXL agents on host pools; bad values named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbridge.agents.base import AgentError
from kvbridge.errors import ServeConfigError
from kvbridge.bench.soak_frames import LAY_TP2
from kvbridge.transceiver.config import ConfigError, TransceiverConfig
from kvbridge.transceiver.pool import LocalPool

pytest.importorskip("nixl_cu13", reason="the NIXL agent is not installed")


def _pool(rank: int, cfg: TransceiverConfig) -> LocalPool:
    return LocalPool(LAY_TP2, rank, np.zeros(LAY_TP2.block_bytes(rank) * 4, np.uint8), 4, cfg)


def test_each_rank_gets_its_own_options_over_the_common_ones():
    cfg = TransceiverConfig.from_dict({"agents": ["nixl"], "options": {"nixl": {"idle_progress_s": 0.004}},
                                       "rank_options": {"1": {"nixl": {"idle_progress_s": 0.002}}}})
    assert cfg.rank_options == {1: {"nixl": {"idle_progress_s": 0.002}}}  # a JSON / YAML key, as an int
    assert cfg.agent_options("nixl", 0) == {"idle_progress_s": 0.004}
    assert cfg.agent_options("nixl", 1) == {"idle_progress_s": 0.002}
    assert cfg.agent_options("cuda_ipc", 1) == {}
    pools = [_pool(r, cfg) for r in (0, 1)]
    try:
        assert [p.agents["nixl"]._idle_s for p in pools] == [0.004, 0.002]
    finally:
        for p in pools:
            p.close()


def test_a_bad_option_for_one_rank_fails_that_rank_only():
    cfg = TransceiverConfig(agents=("nixl",), rank_options={1: {"nixl": {"progress": "sometimes"}}})
    p0 = _pool(0, cfg)
    p0.close()
    with pytest.raises(AgentError, match="nixl: NixlAgent progress must be 'thread', 'nixl' or 'manual', "
                                         "got 'sometimes'"):
        _pool(1, cfg)


@pytest.mark.parametrize("value, message", [
    ({-1: {}}, r"rank_options: -1 is not a rank"),
    ({"one": {}}, r"rank_options: 'one' is not a rank"),
    ({"\u00b2": {}}, r"rank_options: '\u00b2' is not a rank"),
    ({True: {}}, r"rank_options: True is not a rank"),
    ({1: {}, "1": {}}, r"rank_options names rank 1 twice"),
    ({0: ["cuda_ipc"]}, r"rank_options\[0\] must map agent kinds to their options, got list"),
    ({0: {"cuda_ipc": "peer"}}, r"rank_options\[0\]\['cuda_ipc'\] must be an agent kind mapped to its options"),
    ([1], r"rank_options must map ranks to agent options, got list"),
])
def test_bad_rank_options_are_named(value, message):
    with pytest.raises(ConfigError, match=message):
        TransceiverConfig(rank_options=value)


def test_bad_options_are_named():
    with pytest.raises(ConfigError, match=r"transceiver.options\['nixl'\] must be an agent kind mapped to its "
                                          r"options, got int"):
        TransceiverConfig.from_dict({"options": {"nixl": 3}})


def test_a_serving_config_gives_one_worker_rank_its_options():
    """`kvbridge serve`'s config: a generation group's `transceiver.rank_options`, as YAML (int ranks) or JSON
    (string ranks) gives it, is checked at parse time and reaches the worker's ranks as TransceiverConfig."""
    from kvbridge.serving.config import parse_config

    gen = {"tp": 2, "transceiver": {"rank_options": {1: {"cuda_ipc": {"launch_on": "peer"}}}}}
    for d in (gen, json.loads(json.dumps(gen))):
        cfg = parse_config({"model": "seeded:tiny", "context_servers": {"tp": 1}, "generation_servers": d})
        tc = TransceiverConfig.from_dict(cfg.generation[0].transceiver)
        assert [tc.agent_options("cuda_ipc", r) for r in (0, 1)] == [{}, {"launch_on": "peer"}]
        assert TransceiverConfig.from_dict(cfg.context[0].transceiver).rank_options == {}
    with pytest.raises(ServeConfigError, match=r"generation_servers.transceiver: transceiver.rank_options: -1 is "
                                               r"not a rank"):
        parse_config({"model": "seeded:tiny", "context_servers": {}, "generation_servers": {
            "transceiver": {"rank_options": {-1: {}}}}})
