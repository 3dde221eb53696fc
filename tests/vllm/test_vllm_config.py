"""The `engine: vllm` serving config: validation naming the key, and what each vLLM server is started with."""

from __future__ import annotations

import json
import os

import pytest

from kvbridge.errors import ServeConfigError
from kvbridge.serving.config import parse_config
from kvbridge.serving.vllm_member import guarded
from kvbridge.serving.vllm_workers import server_spec, with_ports


def _cfg(**over) -> dict:
    d = {"model": "/models/llama", "vllm": {"kv_connector": "KVBridgeConnector"},
         "transceiver": {"transfer_timeout_s": 30},
         "context_servers": {"engine": "vllm", "urls": ["127.0.0.1:26301"]},
         "generation_servers": {"engine": "vllm", "tp": 2, "urls": ["127.0.0.1:26302"]}}
    d.update(over)
    return d


@pytest.mark.parametrize("change, named", [
    ({"generation_servers": {"urls": ["127.0.0.1:26302"]}}, "generation_servers.engine"),
    ({"vllm": {"kv_conector": "x"}}, "vllm.kv_conector: unknown key"),
    ({"vllm": {"kv_connector": "LMCache"}}, "vllm.kv_connector"),
    ({"vllm": {"cpus": ["0", "1"]}}, "vllm.cpus"),
    ({"vllm": {"cpus": "a-b"}}, "cpus"),
    ({"vllm": {"gpu_memory_utilization": 2}}, "vllm.gpu_memory_utilization"),
    ({"context_servers": {"engine": "sglang"}}, "context_servers.engine"),
    ({"context_servers": {"vllm": {}, "urls": ["127.0.0.1:1"]},
      "generation_servers": {"urls": ["127.0.0.1:2"]}},
     "context_servers.vllm: only for engine: vllm"),
    ({"router": {"policy": "kv_aware"}}, "router.policy: kv_aware over vLLM servers"),  # (no disagg_cluster)
])
def test_a_bad_vllm_config_is_refused_naming_the_key(change, named):
    with pytest.raises(ServeConfigError, match=named.replace(".", r"\.")):
        parse_config(_cfg(**change))


@pytest.mark.parametrize("where", [{"bind_host": "0.0.0.0"}, {"urls": ["10.0.0.2:26302"]}])
def test_a_vllm_server_beyond_loopback_is_refused_unless_the_config_accepts_it(where):
    """vLLM's --api-key guards /v1/* only (its /invocations runs completions without it): kvbridge starts vLLM
    servers on loopback unless `insecure: true` says a firewall or private network stands in front."""
    gen = {"engine": "vllm", "urls": ["127.0.0.1:26302"], **where}
    with pytest.raises(ServeConfigError, match=r"gen0: a vLLM server would listen on (0\.0\.0\.0|10\.0\.0\.2)"
                                               r".*/invocations runs completions.*insecure: true"):
        parse_config(_cfg(generation_servers=gen))
    cfg = parse_config(_cfg(generation_servers=gen, insecure=True))
    assert server_spec(cfg, cfg.generation[0], "tok").host in ("0.0.0.0", "10.0.0.2")
    assert not guarded(cfg, cfg.generation[0])  # insecure: vLLM itself listens there


def test_a_cluster_member_beyond_loopback_is_guarded_and_vllm_stays_on_loopback():
    """In a disagg_cluster a vLLM server reached from other hosts is accepted: its member (`kvbridge worker`)
    listens there with a guard that checks the deployment's token on every route (tests/vllm/
    test_vllm_members.py runs one), and starts vLLM itself on loopback."""
    gen = {"engine": "vllm", "urls": ["10.0.0.2:26302"], "bind_host": "0.0.0.0"}
    cfg = parse_config(_cfg(generation_servers=gen, disagg_cluster={}))
    assert guarded(cfg, cfg.generation[0]) and not guarded(cfg, cfg.context[0])
    cfg = parse_config(_cfg(generation_servers=gen, disagg_cluster={}, insecure=True))
    assert guarded(cfg, cfg.generation[0])  # insecure accepts plain HTTP across hosts, not an open vLLM


def test_each_server_gets_its_role_connector_cores_and_token_out_of_argv():
    cfg = parse_config(_cfg())
    assert cfg.engine == "vllm" and cfg.generation[0].vllm["cpus"] == "auto"
    ctx = server_spec(cfg, cfg.context[0], "tok-123")
    gen = server_spec(cfg, cfg.generation[0], "tok-123")
    kv = json.loads(_arg(ctx, "--kv-transfer-config"))
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_module_path"].endswith("integrations.vllm.connector")
    assert kv["kv_connector_extra_config"]["transceiver"] == {"transfer_timeout_s": 30}
    assert _arg(gen, "--tensor-parallel-size") == "2"
    assert json.loads(_arg(gen, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    cores = sorted(os.sched_getaffinity(0))
    assert ctx.cpus == str(cores[0]) and gen.cpus.count("|") == 1  # one core list per TP rank, round robin
    assert all("tok-123" not in a for a in ctx.command()) and ctx.environment({})["VLLM_API_KEY"] == "tok-123"
    assert ctx.port == 26301 and "--served-model-name" in ctx.command()


def test_nixl_servers_get_a_cpu_buffer_and_port_zero_becomes_a_free_port():
    cfg = parse_config(_cfg(vllm={"kv_connector": "NixlConnector", "cpus": "none"},
                            context_servers={"engine": "vllm", "urls": ["127.0.0.1:0"]}))
    cfg = with_ports(cfg)
    s = server_spec(cfg, cfg.context[0], None)
    assert s.port > 0 and s.cpus is None and "VLLM_API_KEY" not in s.environment({"VLLM_API_KEY": "stale"})
    kv = json.loads(_arg(s, "--kv-transfer-config"))
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_buffer_device"] == "cpu"
    assert s.side_channel_port
    assert s.environment({})["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(s.side_channel_port)


def _arg(spec, flag: str) -> str:
    cmd = spec.command()
    return cmd[cmd.index(flag) + 1]
