"""A generation worker in another network namespace (its own veth, its own address) joins a deployment
through etcd and serves: the router, the context worker and etcd stay in this namespace; the worker reaches
etcd and the context worker's transceiver over the veth, the router reaches the worker's HTTP over it.
Exact answers and the positional KV check through the official `openai` client. Twice: open (plain HTTP, which
needs `insecure: true`: the router would send the internal token in clear; a control plane without CurveZMQ
keys, which needs the transceiver's `insecure: true`), and closed (HTTPS through `tls:` and CurveZMQ keys), with
no `insecure` anywhere. Needs root and `ip netns` (skips with the reason otherwise) and etcd (etcd_server.py);
the TLS run also the openssl command line (tls_certs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import openai
import pytest
import zmq.auth
from kvbridge.serving.auth import TOKEN_ENV

from ..reliability.netns import netns_unavailable
from .cluster import MODEL, PROMPTS, TOKEN, stop_process
from .conftest import MAX_TOKENS
from .etcd_server import EtcdServer
from .kvcheck import assert_kv_positional
from .members import Deployment, cluster_config
from .tls_certs import make_certs, openssl_missing

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


@pytest.mark.parametrize("http", ["plain", "tls"])
def test_a_worker_in_another_network_namespace_joins_through_etcd_and_serves(veth, tmp_path, want, http):
    ns, host_ip, ns_ip = veth
    if http == "tls" and openssl_missing():
        pytest.skip(openssl_missing())
    certs = make_certs(str(tmp_path / "certs"), ("127.0.0.1", host_ip, ns_ip)) if http == "tls" else None
    etcd = EtcdServer(str(tmp_path / "etcd"), str(tmp_path / "etcd.log"), also_on=host_ip).start()
    dep, gen = None, None
    try:
        d = cluster_config(f"etcd://{host_ip}:{etcd.client_port}")
        ctx_tr, gen_tr = {"bind_host": host_ip}, {}
        if certs is None:
            d["insecure"] = True  # plain HTTP to a non-loopback worker: the router would refuse it otherwise
            ctx_tr["insecure"] = True  # and a control plane beyond loopback without CurveZMQ keys
        else:  # closed: HTTPS (the token never crosses the veth in clear) and CurveZMQ, no insecure anywhere
            d["tls"] = certs.tls()
            ctx_pub, ctx_sec = zmq.auth.create_certificates(str(tmp_path), "context")
            _gen_pub, gen_sec = zmq.auth.create_certificates(str(tmp_path), "generation")
            ctx_tr.update(curve_secret_key_file=ctx_sec, curve_authorized_keys_dir=str(tmp_path))
            gen_tr.update(curve_secret_key_file=gen_sec, curve_server_public_key_file=ctx_pub)
        d["context_servers"] = {"tp": 1, "transceiver": ctx_tr}
        d["generation_servers"] = {**d["generation_servers"], "urls": [f"{ns_ip}:0"], "bind_host": ns_ip,
                                   "transceiver": gen_tr}
        dep = Deployment(tmp_path, d, verify=certs.trust() if certs else True)
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
        scheme = "https" if certs else "http"
        assert body["cluster"]["workers"]["gen-ns"]["url"].startswith(f"{scheme}://{ns_ip}:")
        handles = []
        with httpx.Client(verify=certs.trust() if certs else True) as http_client, openai.OpenAI(
                base_url=dep.router + "/v1", api_key="unused", http_client=http_client, timeout=120,
                max_retries=0) as oc:
            for k in range(len(PROMPTS)):
                out = oc.completions.create(model=MODEL, prompt=PROMPTS[k], max_tokens=MAX_TOKENS, temperature=0)
                kb = out.model_extra["kvbridge"]
                assert kb["token_ids"] == want["prompts"][k] and kb["generation_worker"] == "gen-ns"
                handles.append(kb["handle"])
        with pytest.MonkeyPatch.context() as mp:
            if certs:  # the KV check's own calls to the workers trust the deployment's CA
                mp.setenv("SSL_CERT_FILE", certs.ca)
            assert assert_kv_positional(dep.url("ctx-a"), dep.url("gen-ns"), handles) == len(PROMPTS)
    finally:
        if dep is not None:
            dep.stop()
        elif gen is not None:
            stop_process(gen)
        etcd.stop()
