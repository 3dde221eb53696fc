"""`kvbridge serve` with `engine: vllm` groups: it starts two real vLLM OpenAI servers (prefill, decode) with
KVBridgeConnector, and its router answers the official openai client, streamed and not, completions and chat,
with the tokens the prefill server computes alone. Stopping serve leaves no vLLM process. One deployment for
the module (two engines: each spins a core)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from ..serving.cluster import TOKEN, config, wait_log
from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
PORTS = {"router": 26100, "ctx0": 26101, "gen0": 26102}  # this suite's range: 26000-26999
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 32 * 4  # K and V x 4 layers x 2 kv heads x head_dim 32 x fp32


def _vllm_pids() -> list[int]:
    """Live processes whose command line names one of our vLLM servers' ports."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in args and any(
                str(PORTS[n]).encode() in args for n in ("ctx0", "gen0")):
            out.append(int(pid))
    return out


@pytest.fixture(scope="module")
def serve(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-vllm")
    group = lambda name: {"engine": "vllm", "urls": [f"127.0.0.1:{PORTS[name]}"]}  # noqa: E731
    cfg = {"model": "tiny-llama", "startup_timeout_s": 600,
           "vllm": {"kv_connector": "KVBridgeConnector", "max_model_len": 1024, "cpus": "auto"},
           "router": {"port": PORTS["router"], "request_timeout_s": 240},
           "context_servers": group("ctx0"), "generation_servers": group("gen0")}
    log = tmp / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "serve", config(tmp, "c", cfg)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, KVBRIDGE_INTERNAL_TOKEN=TOKEN))
    try:
        router = wait_log(log, r"OpenAI API at (\S+)/v1", proc, timeout=700).group(1)
        yield router
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of serve's own group is left
        except ProcessLookupError:
            pass
        left = _vllm_pids()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert code == 0 and left == [], f"serve exited {code}; vLLM processes left: {left}"


def _alone(server: str, **body) -> openai.types.Completion:
    """The prefill server's own answer (no kv_transfer_params: it computes and decodes by itself)."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{PORTS[server]}/v1", api_key=TOKEN, timeout=240)
    return c.completions.create(model="tiny-llama", **{"temperature": 0, **body})


BLOCK = 128  # vLLM's CPU default block size: KVBridgeConnector moves its blocks whole (the last one too)


@pytest.mark.parametrize("n", [128, 384, 16, 300, 700])
def test_completions_streamed_and_not_equal_the_prefill_servers_own_tokens(serve, n):
    c = openai.OpenAI(base_url=serve + "/v1", api_key="unused", timeout=240)
    prompt = [(7 * k + 13 * n) % 500 + 3 for k in range(n)]  # unique per test: no prefix-cache hit
    ref = _alone("ctx0", prompt=prompt, max_tokens=12).choices[0].text
    got = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    kb = got.model_extra["kvbridge"]
    assert (kb["context_worker"], kb["generation_worker"]) == ("ctx0", "gen0")
    assert kb["transfer"]["error"] == ""
    assert kb["transfer"]["bytes"] == -(-n // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
    streamed = c.completions.create(model="tiny-llama", prompt=prompt[::-1], max_tokens=12, temperature=0,
                                    stream=True)
    text = "".join(ch.choices[0].text for ch in streamed if ch.choices)
    assert got.choices[0].text == ref, f"{n}-token prompt"
    ref = _alone("ctx0", prompt=prompt[::-1], max_tokens=12).choices[0].text
    assert text == ref, f"{n}-token prompt, streamed"


def test_n_choices_of_a_list_of_prompts_each_equal_the_prefill_servers_own_answer(serve):
    """n = 2 of two prompts, seeded and sampled: four choices, each run through both hops on its own, choice j
    of a prompt with seed + j, each the prefill server's own answer to that prompt and seed."""
    c = openai.OpenAI(base_url=serve + "/v1", api_key="unused", timeout=240)
    prompts = [[(11 * k + 5 * i) % 400 + 3 for k in range(40 + 30 * i)] for i in range(2)]
    sampled = {"max_tokens": 8, "temperature": 1.0, "seed": 1234}
    got = c.completions.create(model="tiny-llama", prompt=prompts, n=2, **sampled)
    assert [ch.index for ch in got.choices] == [0, 1, 2, 3]
    want = [_alone("ctx0", prompt=p, max_tokens=8, temperature=1.0, seed=1234 + j).choices[0].text
            for p in prompts for j in range(2)]
    assert [ch.text for ch in got.choices] == want
    assert want[0] != want[1] or want[2] != want[3], "the seeds made no difference: nothing was tested"
    assert got.usage.prompt_tokens == 40 + 70 and got.usage.completion_tokens == 4 * 8
    streamed = c.completions.create(model="tiny-llama", prompt=prompts, n=2, stream=True, **sampled)
    texts = ["", "", "", ""]
    for ch in streamed:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == want, "streamed: the four choices' chunks interleave, each indexed"


def test_chat_streamed_and_not(serve):
    c = openai.OpenAI(base_url=serve + "/v1", api_key="unused", timeout=240)
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    full = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0)
    assert full.usage.completion_tokens == 10 and full.choices[0].message.role == "assistant"
    streamed = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0,
                                         stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        full.choices[0].message.content


def test_the_vllm_servers_are_closed_to_callers_without_the_deployments_token(serve):
    r = httpx.post(f"http://127.0.0.1:{PORTS['gen0']}/v1/completions", timeout=30,
                   json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 401


def test_once_the_prefill_engine_is_known_both_hops_go_out_together(serve):
    """Early decode (router.overlap, the default): the router learned the prefill engine from an earlier
    answer, so it sends the decode request with the prefill; the answer is still the prefill server's own."""
    c = openai.OpenAI(base_url=serve + "/v1", api_key="unused", timeout=240)
    for n in (40, 500):
        prompt = [(11 * k + 5 * n) % 500 + 3 for k in range(n)]
        c.completions.create(model="tiny-llama", prompt=[3, 4, 5], max_tokens=2, temperature=0)  # learn it
        got = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
        kb = got.model_extra["kvbridge"]
        assert kb.get("early_decode") is True, kb
        assert kb["transfer"]["error"] == "" and kb["transfer"]["bytes"] == -(-n // BLOCK) * BLOCK * \
            KV_BYTES_PER_TOKEN
        assert got.choices[0].text == _alone("ctx0", prompt=prompt, max_tokens=12).choices[0].text
        streamed = c.completions.create(model="tiny-llama", prompt=prompt[::-1], max_tokens=12, temperature=0,
                                        stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == \
            _alone("ctx0", prompt=prompt[::-1], max_tokens=12).choices[0].text
