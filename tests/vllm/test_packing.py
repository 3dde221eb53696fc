"""The attention kernel's packing, learned by probing it (integrations/vllm/packing.py).

Two layers: the probe and the (un)pack arithmetic against stores whose packing is known (written here in
plain torch, standing for a kernel: K column-major as vLLM's vector kernel keeps it, and dim pairs per token as
its AMX kernel does), and the probe against vLLM's REAL store op in vLLM's own interpreter, for the ISAs this
machine runs (fp32 -> vec, bf16 -> amx where the CPU has AMX): random K and V written by the kernel unpack to
exactly what was written, and pack back to the kernel's bytes.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch

from kvbridge.errors import LayoutError
from kvbridge.integrations.vllm.launch import vllm_missing, vllm_python
from kvbridge.integrations.vllm.packing import pack, probe, rows, unpack


def _column_major_k(k, v, kc, vc, slots):
    """K as [head_dim, tokens], V as [tokens, head_dim] inside the block (slots = token positions)."""
    T, D = kc.shape[2], kc.shape[3]
    kc.view(-1)[:] = k[:, 0, :].t().reshape(-1)[: T * D]
    vc.view(-1)[:] = v[:, 0, :].reshape(-1)


def _dim_pairs_k(k, v, kc, vc, slots):
    """K as [head_dim / 2, tokens, 2], V as [tokens / 2, head_dim, 2]."""
    T, D = kc.shape[2], kc.shape[3]
    kc.view(-1)[:] = k[:, 0, :].view(T, D // 2, 2).permute(1, 0, 2).reshape(-1)
    vc.view(-1)[:] = v[:, 0, :].view(T // 2, 2, D).permute(0, 2, 1).reshape(-1)


@pytest.mark.parametrize("store", [_column_major_k, _dim_pairs_k])
@pytest.mark.parametrize("T,D", [(32, 32), (64, 128), (96, 64)])
def test_probe_learns_a_known_packing_and_round_trips(store, T, D):
    p = probe(store, "known", T, D, torch.float32)
    k, v = torch.randn(T, 1, D), torch.randn(T, 1, D)
    cache = torch.zeros(1, 1, 2 * T, D)
    kc, vc = cache.chunk(2, dim=2)
    store(k, v, kc, vc, torch.arange(T))
    regions = cache.view(2, T * D)
    got = unpack(regions, p)
    assert torch.equal(got[0], k[:, 0]) and torch.equal(got[1], v[:, 0])
    assert torch.equal(pack(got, p), regions)
    assert not p.is_rows and p.digest.startswith(f"known:{T}x{D}:")


def test_token_rows_are_the_identity():
    p = rows(32, 16)
    x = torch.arange(3 * 2 * 32 * 16).view(3, 2, 32 * 16)
    assert p.is_rows and torch.equal(unpack(x, p).reshape(3, 2, -1), x) and torch.equal(pack(unpack(x, p), p), x)


def test_two_block_sizes_have_different_digests():
    assert probe(_column_major_k, "k", 32, 32, torch.float32).digest != \
        probe(_column_major_k, "k", 64, 32, torch.float32).digest


def test_a_store_that_is_not_a_permutation_is_refused_by_name():
    def drops_a_token(k, v, kc, vc, slots):
        _column_major_k(k, v, kc, vc, slots)
        kc[0, 0, 0, 0] = kc[0, 0, 0, 1]

    with pytest.raises(LayoutError, match="not a permutation"):
        probe(drops_a_token, "broken", 32, 32, torch.float32)


def test_a_store_that_changes_values_is_refused_by_name():
    def scales(k, v, kc, vc, slots):
        _column_major_k(k * 100, v, kc, vc, slots)

    with pytest.raises(LayoutError, match="does not keep the values"):
        probe(scales, "scaling", 32, 32, torch.float32)


_REAL = textwrap.dedent("""
    import json, torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from kvbridge.integrations.vllm.packing import probe, unpack, pack
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for T, D in ((32, 32), (64, 32), (32, 128), (96, 64)):
            isa = _get_attn_isa(dtype, T, D)
            store = lambda k, v, kc, vc, s: ops.cpu_attn_reshape_and_cache(k, v, kc, vc, s, isa)
            p = probe(store, isa, T, D, dtype)
            g = torch.Generator().manual_seed(T * D)
            k, v = torch.randn(T, 1, D, generator=g).to(dtype), torch.randn(T, 1, D, generator=g).to(dtype)
            cache = torch.zeros(1, 1, 2 * T, D, dtype=dtype)
            kc, vc = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(T), isa)
            r = cache.view(2, T * D)
            u = unpack(r, p)
            out.append({"dtype": str(dtype), "T": T, "D": D, "isa": isa, "rows": p.is_rows,
                        "exact": bool(torch.equal(u[0], k[:, 0]) and torch.equal(u[1], v[:, 0])
                                      and torch.equal(pack(u, p), r))})
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.skipif(vllm_missing() is not None, reason=f"vLLM not available: {vllm_missing()}")
def test_probe_of_vllms_real_cpu_kernel_round_trips():
    r = subprocess.run([vllm_python(), "-c", _REAL], capture_output=True, text=True, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, r.stderr[-2000:]
    cells = json.loads(line[0][7:])
    assert cells and all(c["exact"] for c in cells), cells
    assert not any(c["rows"] for c in cells), "the CPU kernel now stores token rows: revisit reblock.py"


def test_a_prefill_that_packs_another_way_is_refused_by_name():
    from kvbridge.integrations.vllm.reblock import Reblocker

    mine = {T: probe(_column_major_k, "vec", T, 32, torch.float32) for T in (32, 64)}
    theirs = probe(_dim_pairs_k, "amx", 64, 32, torch.float32)
    r = Reblocker(None, None, "test", mine.__getitem__, 0)  # check() needs only the packings
    assert r.check(64, mine[64].digest) == ""
    why = r.check(64, theirs.digest)
    assert "packs its 64-token blocks as amx" in why and "vec:64x32" in why
    assert "unknown" in r.check(64, "")
