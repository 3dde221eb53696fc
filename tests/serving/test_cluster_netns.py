"""A generation worker in another network namespace (its own veth, its own address) joins a deployment
through etcd and serves: the router, the context worker and etcd stay in this namespace; the worker reaches
etcd and the context worker's transceiver over the veth, the router reaches the worker's HTTP over it.
Exact answers and the positional KV check through the official `openai` client. Needs root and `ip netns`
(skips with the reason otherwise) and etcd (etcd_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import openai
import pytest
from kvbridge.serving.auth import TOKEN_ENV

from ..reliability.netns import netns_unavailable
from .cluster import MODEL, PROMPTS, TOKEN, stop_process
from .conftest import MAX_TOKENS
from .etcd_server import EtcdServer
from .kvcheck import assert_kv_positional
from .members import Deployment, cluster_config

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # the veth's host end has an address here


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=True)


@pytest.fixture
def veth():
    """A namespace joined to this one by a veth pair: (namespace, host-side address, namespace address)."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    ns, host_dev, ns_dev = f"kvb-w-{tag}", f"kvbh{tag}", f"kvbn{tag}"
    subnet = 200 + int(tag[:2], 16) % 50
    host_ip, ns_ip = f"10.{subnet}.{int(tag[2:4], 16)}.1", f"10.{subnet}.{int(tag[2:4], 16)}.2"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
        _ip("link", "set", ns_dev, "netns", ns)
        _ip("addr", "add", f"{host_ip}/24", "dev", host_dev)
        _ip("link", "set", host_dev, "up")
        for args in (("addr", "add", f"{ns_ip}/24", "dev", ns_dev), ("link", "set", ns_dev, "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", ns, "ip", *args)
        yield ns, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_dev], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_a_worker_in_another_network_namespace_joins_through_etcd_and_serves(veth, tmp_path, want):
    ns, host_ip, ns_ip = veth
    etcd = EtcdServer(str(tmp_path / "etcd"), str(tmp_path / "etcd.log"), also_on=host_ip).start()
    dep, gen = None, None
    try:
        d = cluster_config(f"etcd://{host_ip}:{etcd.client_port}")
        d["insecure"] = True  # plain HTTP to a non-loopback worker: the router would refuse it otherwise
        d["context_servers"] = {"tp": 1, "transceiver": {"bind_host": host_ip, "insecure": True}}
        d["generation_servers"] = {**d["generation_servers"], "urls": [f"{ns_ip}:0"], "bind_host": ns_ip}
        dep = Deployment(tmp_path, d)
        with pytest.MonkeyPatch.context() as mp:  # the tcp agent's data socket too, not only the control one
            mp.setenv("KVBRIDGE_AGENT_HOST", host_ip)
            dep.start_worker("context", "ctx-a")
        with open(tmp_path / "gen-ns.log", "w") as out:
            gen = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "kvbridge.cli", "worker",
                                    "--config", dep.worker_config, "--role", "generation", "--name", "gen-ns"],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, **{TOKEN_ENV: TOKEN}))
        dep.procs["gen-ns"] = gen
        body = dep.wait_healthy("ctx-a", "gen-ns")
        assert body["cluster"]["workers"]["gen-ns"]["url"].startswith(f"http://{ns_ip}:")
        handles = []
        with openai.OpenAI(base_url=dep.router + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
            for k in range(len(PROMPTS)):
                out = oc.completions.create(model=MODEL, prompt=PROMPTS[k], max_tokens=MAX_TOKENS, temperature=0)
                kb = out.model_extra["kvbridge"]
                assert kb["token_ids"] == want["prompts"][k] and kb["generation_worker"] == "gen-ns"
                handles.append(kb["handle"])
        assert assert_kv_positional(dep.url("ctx-a"), dep.url("gen-ns"), handles) == len(PROMPTS)
    finally:
        if dep is not None:
            dep.stop()
        elif gen is not None:
            stop_process(gen)
        etcd.stop()
