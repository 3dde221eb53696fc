"""Real rank processes (gloo, float32, CPU): every TP/PP split decodes the seeded models as TP1 x PP1 does."""

from __future__ import annotations

import pytest
import torch

from kvbridge.executor.runtime import Executor, ExecutorConfig

from ..listeners import listening

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [1, 2, 3], list(range(200, 219))]  # 19 tokens: spans several blocks


def _run(model: str, tp: int, pp: int, layers_per_stage=None, max_tokens: int = 10):
    cfg = ExecutorConfig(model=model, tp=tp, pp=pp, layers_per_stage=layers_per_stage, num_blocks=48,
                         tokens_per_block=4, timeout_s=60)
    with Executor.start(cfg) as ex:
        tokens = ex.generate(PROMPTS, max_tokens=max_tokens)
        ctx = ex.prefill(PROMPTS[2])
        kv = ex.read_kv(ctx.request_id)
        ex.release(ctx.request_id)
        assert ex.free_blocks() == [48] * (tp * pp), "every block returns to the free list"
    return tokens, kv


@pytest.fixture(scope="module")
def reference():
    return {m: _run(m, 1, 1) for m in ("seeded:tiny", "seeded:tiny3")}


@pytest.mark.parametrize("model,tp,pp,lps", [
    ("seeded:tiny", 2, 1, None),
    ("seeded:tiny3", 3, 1, None),
    ("seeded:tiny", 1, 2, None),
    ("seeded:tiny", 2, 2, None),
    ("seeded:tiny", 1, 2, (3, 1)),   # an uneven explicit split
], ids=["tp2", "tp3", "pp2", "tp2xpp2", "pp2-uneven-3-1"])
def test_greedy_tokens_and_kv_match_tp1_pp1(reference, model, tp, pp, lps):
    ref_tokens, ref_kv = reference[model]
    tokens, kv = _run(model, tp, pp, lps)
    assert tokens == ref_tokens
    assert kv.shape == ref_kv.shape
    # TP sums partial products in another order: the same KV up to float32 rounding, never a shuffled head
    torch.testing.assert_close(kv, ref_kv, rtol=1e-4, atol=1e-4)


def test_replicated_kv_head_when_tp_exceeds_kv_heads():
    ref, ref_kv = _run("seeded:tiny-mqa", 1, 1)
    tokens, kv = _run("seeded:tiny-mqa", 2, 1)   # read_kv checks both ranks hold the same replica
    assert tokens == ref
    torch.testing.assert_close(kv, ref_kv, rtol=1e-4, atol=1e-4)


def test_the_ranks_rendezvous_is_a_private_file_not_a_port():
    """The ranks meet in a FileStore in a 0700 folder of this user, removed with the executor: not a TCPStore,
    which listens on every interface (whatever host it is given) and serves and lists its keys (NCCL's unique
    id, gloo's addresses) to anyone who reaches it."""
    import os
    import stat
    from datetime import timedelta

    from torch.distributed import FileStore

    from kvbridge.executor.launch import rendezvous_store
    rdv = rendezvous_store()
    assert stat.S_IMODE(os.stat(rdv.folder).st_mode) == 0o700
    a, b = FileStore(rdv.path, -1), FileStore(rdv.path, -1)
    a.set("k", "v")
    b.wait(["k"], timedelta(seconds=10))
    assert b.get("k") == b"v"
    del a, b
    rdv.close()
    assert not os.path.exists(rdv.folder)


def test_the_ranks_listen_on_loopback_only():
    """Nothing of a multi-rank executor is reachable from the network: no rendezvous port (a private file;
    torch's TCPStore, which it used, listens on every interface), and gloo's pair sockets on loopback (the
    ranks are this host's processes)."""
    before = listening()
    cfg = ExecutorConfig(model="seeded:tiny", tp=2, pp=1, num_blocks=16, tokens_per_block=4, timeout_s=60)
    with Executor.start(cfg) as ex:
        ex.generate([PROMPTS[1]], max_tokens=2)  # the groups are formed and used
        addrs = listening(with_children=True) - before
    assert addrs, "the ranks' gloo groups listen somewhere"
    for ip, port in addrs:
        assert ip.is_loopback, f"the executor listens on {ip}:{port}, beyond loopback"
