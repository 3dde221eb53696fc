"""A real etcd server with authentication on (as production etcds run): `cluster_uri: etcd://USER@host:port`
logs in with the password from $KVBRIDGE_ETCD_PASSWORD or `etcd_password_file`; the Store contract holds under
it, a client without the password or with a wrong one is refused by etcd and says so, a password is never
taken from the config itself, and a deployment's router and workers join through it and serve."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvbridge.errors import ServeConfigError
from kvbridge.serving.cluster_config import ETCD_PASSWORD_ENV
from kvbridge.serving.config import parse_config
from kvbridge.serving.registry import StoreUnavailable, open_store

from .cluster import MODEL, PROMPTS
from .conftest import MAX_TOKENS
from .etcd_server import EtcdServer
from .members import Deployment, cluster_config
from .test_cluster_registry import KEY, _cfg
from .test_cluster_registry import test_store_sets_conditionally_expires_leases_and_watches_snapshot_then_changes \
    as store_contract

pytestmark = pytest.mark.timeout(600)
USER, PASSWORD = "kvb", "etcd-pw-7f3a"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd-auth")
    srv = EtcdServer(str(d / "data"), str(d / "etcd.log")).start()
    srv.enable_auth(USER, PASSWORD, prefixes=("/kvbridge/", "/t"))  # kvbridge's keys; the contract's test keys
    yield srv
    srv.stop()


def _uri(srv: EtcdServer, user: str | None = USER) -> str:
    return f"etcd://{user + '@' if user else ''}127.0.0.1:{srv.client_port}"


def test_the_password_comes_from_the_environment_or_a_file_never_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv(ETCD_PASSWORD_ENV, raising=False)
    with pytest.raises(ServeConfigError, match=f"etcd user 'kvb' but no password: set {ETCD_PASSWORD_ENV}"):
        parse_config(_cfg({"cluster_uri": "etcd://kvb@10.0.0.1:2379"}))
    with pytest.raises(ServeConfigError, match="never a password"):
        parse_config(_cfg({"cluster_uri": "etcd://kvb:secret@10.0.0.1:2379"}))
    with pytest.raises(ServeConfigError, match="only with an etcd user"):
        parse_config(_cfg({"cluster_uri": "etcd://10.0.0.1:2379", "etcd_password_file": "/x"}))
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD + "\n")
    cl = parse_config(_cfg({"cluster_uri": "etcd://kvb@10.0.0.1:2379", "etcd_password_file": str(pw)})).cluster
    assert (cl.etcd_user, cl.etcd_password()) == (USER, PASSWORD)
    monkeypatch.setenv(ETCD_PASSWORD_ENV, "from-env")
    assert cl.etcd_password() == "from-env"  # the environment first


def test_the_store_contract_holds_under_etcds_auth(etcd):
    store_contract(lambda: open_store(_uri(etcd), KEY, 2.0, PASSWORD))


@pytest.mark.parametrize("user, password, says", [(None, None, "user name is empty"),
                                                  (USER, "wrong", "authentication failed")])
def test_etcd_refuses_a_client_without_the_password_and_the_store_says_why(etcd, user, password, says):
    async def body():
        s = open_store(_uri(etcd, user), KEY, 2.0, password)
        try:
            with pytest.raises(StoreUnavailable, match=says):
                await s.get("/kvbridge/x")
        finally:
            await s.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_deployment_joins_and_serves_through_an_etcd_with_auth(etcd, tmp_path, monkeypatch, want):
    monkeypatch.setenv(ETCD_PASSWORD_ENV, PASSWORD)  # the router's and the workers' environment
    dep = Deployment(tmp_path, cluster_config(_uri(etcd), cluster_name="auth"))
    try:
        dep.start_worker("context", "ctx-a")
        dep.start_worker("generation", "gen-a")
        dep.wait_healthy("ctx-a", "gen-a")
        with openai.OpenAI(base_url=dep.router + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
            out = oc.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert out.model_extra["kvbridge"]["token_ids"] == want["prompts"][0]
    finally:
        dep.stop()
