"""The serving config: every mistake named by its key path; defaults, overrides and resolved ports."""

from __future__ import annotations

import os

import pytest

from kvbridge.errors import ServeConfigError
from kvbridge.serving.balancer import Pool, WorkerRef
from kvbridge.serving.config import load_config, parse_config

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _base(**kw) -> dict:
    d = {"model": "seeded:tiny", "context_servers": {"tp": 2}, "generation_servers": {}}
    d.update(kw)
    return d


@pytest.mark.parametrize("change, message", [
    ({"modle": "x"}, "modle: unknown key"),
    ({"model": ""}, "model: must name a model"),
    ({"on_transfer_failure": "retry"}, "on_transfer_failure: 'retry' is not one of ('fail', 'recompute')"),
    ({"context_servers": {"tpp": 2}}, "context_servers.tpp: unknown key"),
    ({"context_servers": {"tp": "2"}}, "context_servers.tp: expected int, got '2'"),
    ({"context_servers": {"tp": 0}}, "context_servers: tp and pp must be >= 1"),
    ({"context_servers": {"instances": 2, "urls": ["a:1"]}},
     "context_servers.urls: must list one 'host:port' per instance (2)"),
    ({"generation_servers": {"urls": ["nohost"]}}, "generation_servers.urls[0]: 'nohost' is not 'host:port'"),
    ({"generation_servers": {"pp": 2, "layers_per_stage": [3]}},
     "generation_servers.layers_per_stage: must be a list of 2 positive integers"),
    ({"generation_servers": {"device": "gpu"}}, "generation_servers.device: 'gpu' is not cpu, cuda"),
    ({"executor": {"num_blocks": 0}}, "executor.num_blocks: must be >= 1"),
    ({"executor": {"blocks": 5}}, "executor.blocks: unknown key"),
    ({"generation_servers": {"executor": {"kv_digests": "yes"}}},
     "generation_servers.executor.kv_digests: expected bool, got 'yes'"),
    ({"transceiver": {"agent": "nixl", "lease": 3}}, "transceiver: unknown transceiver settings ['lease']"),
    ({"transceiver": {"heartbeat_s": 9}}, "transceiver: transceiver.heartbeat_s (9) must be at most half"),
    ({"context_servers": {"transceiver": {"port": 70000}}},
     "context_servers.transceiver: transceiver.port 70000"),
    ({"router": {"policy": "random"}},
     "router.policy: 'random' is not one of ('round_robin', 'least_loaded', 'prefix_aware', 'kv_aware')"),
    ({"router": {"request_timeout_s": -1}}, "router.request_timeout_s: must be > 0"),
    ({"generation_servers": None, "context_servers": []}, "context_servers: expected a mapping, got list"),
])
def test_a_bad_config_names_the_key_that_is_wrong(change, message):
    d = _base()
    d.update(change)
    with pytest.raises(ServeConfigError) as e:
        parse_config(d)
    assert message in str(e.value)


def test_missing_server_groups_are_named():
    with pytest.raises(ServeConfigError, match="generation_servers: missing"):
        parse_config({"model": "seeded:tiny", "context_servers": {}})


def test_group_settings_override_the_shared_ones_per_server():
    cfg = parse_config(_base(
        executor={"num_blocks": 64, "device": "cpu"}, transceiver={"agent": "tcp", "lease_s": 20},
        context_servers={"instances": 2, "tp": 2, "urls": ["h1:8001", "http://h2:8001"],
                         "bind_host": "0.0.0.0", "device": ["cuda:1", "cuda:3"],
                         "transceiver": {"advertise_host": "10.0.0.5"}},
        generation_servers={"num_instances": 1, "pp": 2, "executor": {"num_blocks": 32}}))
    c0, c1 = cfg.context
    assert (c0.name, c0.url, c0.bind_host, c1.url) == ("ctx0", "http://h1:8001", "0.0.0.0", "http://h2:8001")
    assert c0.executor == {"num_blocks": 64, "device": "cuda:1"} and c1.executor["device"] == "cuda:3"
    assert c0.transceiver == {"agent": "tcp", "lease_s": 20, "advertise_host": "10.0.0.5"}
    g = cfg.generation[0]
    assert (g.name, g.port, g.pp, g.executor["num_blocks"]) == ("gen0", 0, 2, 32)
    ex = c0.executor_config("seeded:tiny", "ctx-instance", "/tmp/run")
    assert (ex.tp, ex.device, ex.num_blocks, ex.rank_hook) == (2, "cuda:1", 64,
                                                               "kvbridge.executor.transceiver_hook:make")
    args = dict(ex.rank_hook_args)
    assert len(args.pop("request_key")) == 64  # the context executor's RequestKey (transceiver/handles.py)
    assert args == {"role": "context", "instance": "ctx-instance", "run_dir": "/tmp/run",
                    "transceiver": c0.transceiver}
    assert cfg.on_transfer_failure == "fail" and cfg.router.policy == "round_robin"


def test_kv_digests_reach_the_executor_config_of_the_groups_that_ask():
    cfg = parse_config(_base(generation_servers={"executor": {"kv_digests": True}}))
    assert cfg.generation[0].executor_config("seeded:tiny", "g", "/tmp").kv_digests is True
    assert cfg.context[0].executor_config("seeded:tiny", "c", "/tmp").kv_digests is False  # off by default


def test_a_transceiver_bound_to_every_interface_advertises_the_workers_own_host():
    cfg = parse_config(_base(transceiver={"bind_host": "0.0.0.0"},
                             context_servers={"instances": 2, "urls": ["10.0.0.1:8001", "10.0.0.2:8001"]},
                             generation_servers={"transceiver": {"advertise_host": "gen.example"}}))
    assert [s.transceiver["advertise_host"] for s in cfg.servers()] == ["10.0.0.1", "10.0.0.2", "gen.example"]


def test_resolved_ports_round_trip_through_yaml(tmp_path):
    cfg = parse_config(_base()).resolved({"ctx0": 9001, "gen0": 9002}, router_port=9000)
    path = tmp_path / "r.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(str(path))
    assert [s.url for s in again.servers()] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert again.router.url == "http://127.0.0.1:9000" and again.context[0].tp == 2


def test_load_config_names_the_file_and_the_yaml_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("model: [unclosed")
    with pytest.raises(ServeConfigError, match="x.yaml: not valid YAML"):
        load_config(str(p))
    with pytest.raises(ServeConfigError, match="cannot read the serving config"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("name", ["serve_cpu.yaml", "serve_2gpu.yaml"])
def test_the_example_configs_are_valid(name):
    cfg = load_config(os.path.join(EXAMPLES, name))
    assert cfg.context and cfg.generation


def test_round_robin_and_least_loaded_pick_healthy_workers_in_turn():
    ws = [WorkerRef(f"w{i}", f"http://h:{i}", "context", healthy=True) for i in range(3)]
    rr = Pool(ws, "round_robin")
    assert [rr.pick().name for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    ws[1].healthy = False
    assert [rr.pick().name for _ in range(3)] == ["w2", "w0", "w2"]
    assert rr.pick(exclude={"w0", "w2"}).name == "w1"  # only an unhealthy one left: tried anyway
    assert rr.pick(exclude={"w0", "w1", "w2"}) is None
    ws[1].healthy = True
    ll = Pool(ws, "least_loaded")
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 3, 1, 1
    assert [ll.pick().name for _ in range(2)] == ["w1", "w2"]
