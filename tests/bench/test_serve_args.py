"""`kvbridge bench serve --hetero-peer`: the extra phase-B row's generation worker carries generation rank 1's
cuda_ipc `launch_on: peer` as a serving config the workers accept (through JSON, as `kvbridge serve` writes
it), and the flag is refused, naming why, without cuda_ipc first."""

from __future__ import annotations

import json

import pytest

from kvbridge.bench import serve
from kvbridge.serving.config import parse_config
from kvbridge.transceiver import TransceiverConfig


def test_hetero_peer_row_config_gives_rank_1_only_the_peer_kernel():
    d = serve._config("seeded:tiny", serve._server(1, "cuda:1", "cuda_ipc"),
                      [serve._server(2, "cuda:0", "cuda_ipc", serve.PEER1)], False, 64, 32)
    cfg = parse_config(json.loads(json.dumps(d)))  # rank keys become strings in JSON
    (gen,), (ctx,) = cfg.generation, cfg.context
    tc = TransceiverConfig.from_dict(gen.transceiver)
    assert [tc.agent_options("cuda_ipc", r) for r in (0, 1)] == [{}, {"launch_on": "peer"}]
    assert TransceiverConfig.from_dict(ctx.transceiver).rank_options == {}


def test_hetero_peer_needs_cuda_ipc_first(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--quick", "--hetero-peer"])
    assert "--hetero-peer runs generation rank 1's cuda_ipc kernel on the context's GPU: the first of --agents " \
           "must be cuda_ipc/..., got 'tcp/direct'" in capsys.readouterr().err
