"""Real vLLM prefill and decode servers with KVBridgeConnector, for the connector's tests.

`Servers` keeps a few named vLLM OpenAI servers (integrations/vllm/launch.py) and runs only those a test asks
for (`use`), so a module starts each engine once and never has more than three alive on a small machine.
Requests go through vLLM's own HTTP API (the proxy protocol: prefill with max_tokens 1 and
`{"do_remote_decode": true}`, then the decode request with the answer's kv_transfer_params). Each server
writes kvbridge's positional KV digests to its own folder; `digests_equal` compares a request's prefill-side
and decode-side digests key by key ("layer.head.K|V" over global ids), whatever either side's TP and block
size.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass

import httpx
import numpy as np

from kvbridge.integrations.vllm.launch import VllmServer, VllmServerSpec, free_port, vllm_missing
from kvbridge.integrations.vllm.tiny_model import tiny_llama

CONNECTOR = "kvbridge.integrations.vllm.connector"
TIMEOUT = 120.0


def kv_transfer_config(digest_dir: str, transceiver: dict | None = None) -> dict:
    return {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": {"transceiver": transceiver or {"handshake_timeout_s": 20.0,
                                                                         "pickup_timeout_s": 30.0,
                                                                         "publish_wait_s": 20.0},
                                          "kv_digest_dir": digest_dir}}


@dataclass(frozen=True)
class Cell:
    """One server: TP size, block size, the cores it runs on, whether its prefix cache is on, and at most how many
    tokens one engine step computes (None: vLLM's default; smaller than a prompt: its prefill runs in chunks)."""

    tp: int = 1
    block: int = 32
    cpus: str = "0"
    prefix_cache: bool = False
    step_tokens: int | None = None
    args: tuple[str, ...] = ()  # more of vLLM's command line


class Servers:
    """Servers by name (`define`, then `use`); `transceiver`: the connector's transceiver options (default:
    kv_transfer_config's patient waits)."""

    def __init__(self, tmp: str, transceiver: dict | None = None) -> None:
        self.tmp, self.model, self.transceiver = tmp, str(tiny_llama()), transceiver
        self.cells: dict[str, Cell] = {}
        self.running: dict[str, VllmServer] = {}

    def define(self, name: str, cell: Cell) -> None:
        self.cells[name] = cell

    def digest_dir(self, name: str) -> str:
        return os.path.join(self.tmp, f"digests-{name}")

    def use(self, *names: str) -> list[VllmServer]:
        """Exactly these servers running (others stopped first), each healthy; in the order named."""
        for n in [n for n in self.running if n not in names]:
            self.running.pop(n).stop()
        starting = []
        for n in names:
            if n in self.running and self.running[n].alive():
                continue
            c = self.cells[n]
            os.makedirs(self.digest_dir(n), exist_ok=True)
            extra = () if c.prefix_cache else ("--no-enable-prefix-caching",)
            if c.step_tokens is not None:
                extra += ("--max-num-batched-tokens", str(c.step_tokens))
            extra += c.args
            kv = kv_transfer_config(self.digest_dir(n), self.transceiver)
            spec = VllmServerSpec(self.model, free_port(), kv_transfer_config=kv,
                                  block_size=c.block, tensor_parallel_size=c.tp, cpus=c.cpus, max_num_seqs=4,
                                  extra_args=extra)
            self.running[n] = VllmServer(spec, os.path.join(self.tmp, f"{n}-{spec.port}.log")).start()
            starting.append(n)
        for n in starting:
            self.running[n].wait_healthy(300)
        return [self.running[n] for n in names]

    def restart(self, name: str) -> VllmServer:
        self.running.pop(name).stop()
        return self.use(*self.running, name)[-1]

    def close(self) -> None:
        for s in self.running.values():
            s.stop()
        self.running.clear()


def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, size=n)]


def _body(p: list[int], max_tokens: int, **kw) -> dict:
    return {"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def completion(url: str, p: list[int], max_tokens: int, timeout: float = TIMEOUT, **kw) -> httpx.Response:
    body = _body(p, max_tokens, **kw)
    body["model"] = models(url)
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


_MODELS: dict[str, str] = {}


def models(url: str) -> str:
    if url not in _MODELS:
        _MODELS[url] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return _MODELS[url]


def prefill(url: str, p: list[int]) -> dict:
    r = completion(url, p, 1, kv_transfer_params={"do_remote_decode": True})
    r.raise_for_status()
    return r.json()["kv_transfer_params"]


def decode(url: str, p: list[int], params: dict, max_tokens: int = 8) -> httpx.Response:
    return completion(url, p, max_tokens, kv_transfer_params=params)


def tokens(r: httpx.Response) -> list[int]:
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def stream_tokens(url: str, p: list[int], params: dict, max_tokens: int = 8) -> tuple[list[int], list[str]]:
    """Token ids and error messages of a streamed decode (vLLM reports a failure as an error chunk)."""
    body = _body(p, max_tokens, stream=True, kv_transfer_params=params)
    body["model"] = models(url)
    out, errors = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"].get("message", ""))
            for c in chunk.get("choices", ()):
                out += c.get("token_ids") or []
    return out, errors


def digests(folder: str, side: str, handle: int, wait_s: float = 10.0) -> dict[str, str]:
    """Union of every rank's digest of request `handle` on one side ("ctx" or "gen")."""
    deadline = time.monotonic() + wait_s
    while True:
        files = glob.glob(os.path.join(folder, f"{side}-{handle}-r*.json"))
        if files or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out: dict[str, str] = {}
    for f in files:
        with open(f) as fh:
            out.update(json.load(fh)["digest"])
    return out


def kv_usage(url: str) -> float:
    """vLLM's vllm:kv_cache_usage_perc gauge (0 when no request holds a block)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:kv_cache_usage_perc")]
    return max(vals) if vals else 0.0


def wait_no_blocks_held(url: str, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while (u := kv_usage(url)) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return u


def skip_reason() -> str | None:
    return vllm_missing()


def wait_log(server: VllmServer, text: str, timeout: float = 20.0) -> bool:
    """Whether `text` appears in the server's log within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(server.log_path, encoding="utf-8", errors="replace") as f:
                if text in f.read():
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def describe_of(params: dict) -> dict:
    """What a router keeps of a prefill engine from any of its answers (params.py: early decode)."""
    return {k: v for k, v in params["kvbridge"].items()
            if k not in ("ctx_request_id", "secret", "num_tokens", "prompt_hash", "early", "prefill_done_unix_ms")}


def early_pair(p_url: str, d_url: str, p: list[int], describe: dict, max_tokens: int = 8,
               decode_prompt: list[int] | None = None) -> tuple[httpx.Response, httpx.Response, int]:
    """Both hops at once, as a router does for an engine it knows: the decode request first (it starts
    pulling and waits for the publish), the prefill right behind it. (prefill answer, decode answer, handle)."""
    from concurrent.futures import ThreadPoolExecutor

    early, prefill_params = early_params(describe)
    with ThreadPoolExecutor(2) as ex:
        dec = ex.submit(decode, d_url, decode_prompt or p, early, max_tokens)
        pre = ex.submit(completion, p_url, p, 1, kv_transfer_params=prefill_params)
        return pre.result(), dec.result(), early["kvbridge"]["ctx_request_id"]


def early_params(describe: dict) -> tuple[dict, dict]:
    """A fresh handle and secret as a router mints them: (the decode hop's params, the prefill hop's)."""
    import secrets

    handle, secret = secrets.randbits(62) + 1, secrets.token_hex(16)
    return ({"do_remote_prefill": True, "do_remote_decode": False,
             "kvbridge": {**describe, "version": 1, "early": True, "ctx_request_id": handle, "secret": secret}},
            {"do_remote_decode": True, "kvbridge_early": {"ctx_request_id": handle, "secret": secret}})
