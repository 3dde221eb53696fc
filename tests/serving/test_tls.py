"""HTTPS between the router, the workers and their clients (`tls:` in the serving config, serving/tls.py):
a live deployment (real processes, tcp agent) serves the official `openai` client over HTTPS with exact tokens
and the positional KV check; plain HTTP and a client that does not trust the deployment's CA get nothing from
the router or any worker; a bad `tls:` section is refused naming its key and file. (A worker on another
host joining over HTTPS with no `insecure: true`: tests/serving/test_cluster_netns.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvbridge.errors import ServeConfigError
from kvbridge.serving.config import parse_config

from .cluster import HEADERS, MODEL, PROMPTS, exact_config, launch
from .conftest import MAX_TOKENS
from .kvcheck import assert_kv_positional
from .tls_certs import make_certs, openssl_missing

CFG = exact_config()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    why = openssl_missing()
    if why:
        pytest.skip(why)
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def cluster(certs, tmp_path_factory):
    c = launch({**CFG, "tls": certs.tls()}, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def _urls(cluster) -> list[str]:
    return [cluster.router_url, *(s.url for s in cluster.cfg.servers())]


def test_the_deployment_serves_https_with_exact_tokens_and_kv(cluster, certs, want, monkeypatch):
    assert all(u.startswith("https://127.0.0.1:") for u in _urls(cluster)), _urls(cluster)
    handles = []
    with httpx.Client(verify=certs.trust()) as http, openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="unused",
                                                             http_client=http, timeout=120, max_retries=0) as oc:
        for k, prompt in enumerate(PROMPTS):
            out = oc.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert out.model_extra["kvbridge"]["token_ids"] == want["prompts"][k]
            handles.append(out.model_extra["kvbridge"]["handle"])
        stream = oc.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == \
            oc.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)  # the KV check's own calls to the workers trust the CA
    assert assert_kv_positional(cluster.cfg.context[0].url, cluster.cfg.generation[0].url, handles) == len(PROMPTS)


def test_plain_http_and_clients_that_do_not_trust_the_ca_get_nothing(cluster, certs):
    untrusting = certs.trust(certs.other_ca)
    for url in _urls(cluster):
        with pytest.raises(httpx.HTTPError):  # a TLS port answers no plain request (the handshake fails)
            httpx.get(url.replace("https://", "http://") + "/health", headers=HEADERS, timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", headers=HEADERS, verify=untrusting, timeout=10)
    for url in _urls(cluster):  # and each still serves those who trust the CA
        assert httpx.get(url + "/health", headers=HEADERS, verify=certs.trust(), timeout=10).status_code == 200


def _bad(certs, tmp_path) -> list[tuple[object, str]]:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    other_key = certs.other_ca.replace(".crt", ".key")
    return [
        ("x", "tls: expected a mapping"),
        ({"cert": certs.cert, "key": certs.key}, "tls.ca: missing"),
        ({**certs.tls(), "verify": False}, "tls.verify: unknown key"),
        ({**certs.tls(), "cert": str(tmp_path / "none.crt")}, "tls.cert: '"),
        ({**certs.tls(), "ca": str(garbage)}, "tls.ca: "),
        ({**certs.tls(), "key": other_key}, "tls.cert / tls.key: "),
        ({**certs.tls(), "cert": str(garbage)}, "tls.cert / tls.key: "),
    ]


def test_a_bad_tls_section_is_refused_naming_the_key(certs, tmp_path):
    for tls, message in _bad(certs, tmp_path):
        with pytest.raises(ServeConfigError) as e:
            parse_config({**CFG, "tls": tls})
        assert message in str(e.value), (tls, str(e.value))
    with pytest.raises(ServeConfigError, match="tls: with engine: vllm needs disagg_cluster"):
        parse_config({**CFG, "tls": certs.tls(), "context_servers": {"engine": "vllm"},
                      "generation_servers": {"engine": "vllm"}})
    with pytest.raises(ServeConfigError, match="the config has tls: the router speaks https"):
        parse_config({**CFG, "tls": certs.tls(), "disagg_cluster": {"cluster_uri": "http://127.0.0.1:8000"}})


def test_tls_turns_every_url_into_https_and_keeps_absolute_paths(certs, tmp_path, monkeypatch):
    monkeypatch.chdir(certs.ca.rpartition("/")[0])
    cfg = parse_config({**CFG, "tls": {"cert": "host.crt", "key": "host.key", "ca": "ca.crt"},
                        "disagg_cluster": {}})
    assert cfg.tls.ca == certs.ca and cfg.raw["tls"] == certs.tls()  # what a started worker reads
    assert cfg.router.url.startswith("https://") and cfg.cluster.uri.startswith("https://")
    assert cfg.cluster.router_registry and all(s.url.startswith("https://") for s in cfg.servers())
    from kvbridge.serving.check import describe

    assert f"tls: HTTPS with {certs.cert}" in describe(cfg)  # what `kvbridge serve --check` prints
    plain = parse_config(CFG)
    assert plain.tls is None and plain.router.url.startswith("http://") and "tls:" not in describe(plain)


def test_a_worker_whose_certificate_does_not_name_its_host_stops_at_once_saying_why(tmp_path):
    """A cluster member checks its own URL through TLS before it registers: a certificate that does not name
    the url's host (here: made for 10.9.9.9, the worker at 127.0.0.1) is a deployment's mistake, so the worker
    exits 2 naming it instead of waiting out its start-up timeout (and the router never lists it)."""
    from .members import Deployment, cluster_config

    if openssl_missing():
        pytest.skip(openssl_missing())
    wrong = make_certs(str(tmp_path / "certs"), ("10.9.9.9",))
    dep = Deployment(tmp_path, {**cluster_config(None), "tls": wrong.tls()}, verify=wrong.trust())
    try:
        p = dep.start_worker("context", "ctx-a")
        assert p.wait(120) == 2, dep.tail("ctx-a")
        assert "this worker's own certificate does not verify there" in dep.tail("ctx-a"), dep.tail("ctx-a")
    finally:
        dep.stop()


def test_the_example_client_talks_to_an_https_router_with_the_ca(cluster, certs):
    """examples/client.py --cacert: what a newcomer runs against a router with tls (and without the CA: an
    error that names the certificate)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "examples", "client.py"), "--url", cluster.router_url + "/v1",
           "--completion", "--max-tokens", "4", "hello"]
    ok = subprocess.run([*cmd, "--cacert", certs.ca], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "ctx0 -> gen0" in ok.stdout + ok.stderr, ok.stdout + ok.stderr
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in bad.stdout + bad.stderr
