"""`kvbridge serve` reads a `trtllm-serve disaggregated -c` config as is; `serve --check` validates any config."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from kvbridge.errors import ServeConfigError
from kvbridge.serving.config import parse_config

from ..serving.cluster import PATIENT, launch, reference

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "trtllm_disagg.yaml")


def _example() -> dict:
    with open(EXAMPLE, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _check(path: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", "--check", path], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_every_field_of_the_example_maps_onto_kvbridge():
    cfg = parse_config(_example())
    (ctx,), (gen,) = cfg.context, cfg.generation
    assert (cfg.model, cfg.router.host, cfg.router.port, cfg.router.policy) == ("seeded:tiny3", "127.0.0.1", 8000,
                                                                              "round_robin")
    assert (ctx.tp, ctx.pp, ctx.port, gen.tp, gen.port) == (2, 1, 8001, 1, 8002)
    assert ctx.executor == {"num_blocks": 256, "tokens_per_block": 16, "max_batch_seqs": 16,
                            "max_batch_tokens": 1024, "device": "cpu", "threads_per_rank": 1, "timeout_s": 120}
    assert gen.executor["num_blocks"] == 512  # the group's kv_cache_config overrides the top-level one
    assert ctx.transceiver == {"agents": ["nixl"], "transfer_timeout_s": 60.0, "pickup_timeout_s": 60.0}
    assert cfg.on_transfer_failure == "fail"


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["context_servers"].update(enable_attention_dp=True), r"context_servers\.enable_attention_dp: not"),
    (lambda d: d.update(speculative_config={}), r"^speculative_config: not supported"),
    (lambda d: d["cache_transceiver_config"].update(backend="MPI"), r"cache_transceiver_config: .*MPI is not"),
    (lambda d: d["generation_servers"]["kv_cache_config"].update(host_cache_size=1),
     r"generation_servers\.kv_cache_config\.host_cache_size: unknown key"),
    (lambda d: d.update(backend="tensorrt"), r"context_servers\.backend: 'tensorrt' is not supported"),
    (lambda d: d.update(router={"type": "random"}), r"router\.type: 'random' is not supported"),
    (lambda d: d["context_servers"].update(tensor_parallel_size=0), r"context_servers: tp and pp must be >= 1"),
], ids=["group-field", "top-field", "mpi", "kv-key", "backend", "router", "tp0"])
def test_what_kvbridge_cannot_map_is_refused_by_name(edit, match):
    d = _example()
    edit(d)
    with pytest.raises(ServeConfigError, match=match):
        parse_config(d)


def test_router_type_kv_cache_aware_maps_onto_the_kv_aware_policy():
    d = _example()
    d["router"] = {"type": "kv_cache_aware"}
    assert parse_config(d).router.policy == "kv_aware"


def test_serve_check_prints_the_deployment_and_exits_0():
    r = _check(EXAMPLE)
    assert r.returncode == 0, r.stderr
    assert "valid (trtllm-serve disaggregated format)" in r.stdout
    assert "ctx0: context worker at http://127.0.0.1:8001, tp=2 pp=1" in r.stdout and "agents nixl" in r.stdout
    assert "  rank 1 (tp 1, pp 0): cpu" in r.stdout


def test_serve_check_names_the_tensorrt_llm_switches_it_honours_or_refuses():
    r = _check(EXAMPLE, TRTLLM_PARALLEL_CACHE_SEND="1")
    assert r.returncode == 0 and "env TRTLLM_PARALLEL_CACHE_SEND=1: no effect" in r.stdout
    r = _check(EXAMPLE, TRTLLM_USE_MPI_KVCACHE="1")
    assert r.returncode == 2 and "TRTLLM_USE_MPI_KVCACHE=1 asks for the MPI backend" in r.stderr


def test_serve_check_exits_2_naming_the_bad_field(tmp_path):
    d = _example()
    d["generation_servers"]["tensor_parallel_size"] = 5  # tiny3 has 12 heads: 5 does not divide them
    path = str(tmp_path / "bad.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(d, f)
    r = _check(path)
    assert r.returncode == 2 and r.stdout == ""
    assert "invalid" in r.stderr and "generation_servers: tp=5 does not divide" in r.stderr


@pytest.mark.slow
def test_the_example_serves_a_request_on_cpu_with_the_aggregated_tokens(tmp_path):
    d = _example()
    d["port"] = 0  # free ports, reported back by the processes that bind them
    for g in ("context_servers", "generation_servers"):
        d[g]["urls"] = ["127.0.0.1:0"]
    d["kvbridge"]["transceiver"] = PATIENT  # a busy 2-core box
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    (want,) = reference([prompt], 5)
    with launch(d, str(tmp_path)) as c:
        r = httpx.post(c.router_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                       timeout=120)
    assert r.status_code == 200, r.text
    kb = r.json()["kvbridge"]
    assert kb["token_ids"] == want and kb["transfer"]["agents"] == ["nixl"] and kb["transfer"]["bytes"] > 0
