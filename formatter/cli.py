"""`kvbridge verify-layout`: will this prefill/decode split work? Runs one cell byte-exact in-process.

    kvbridge verify-layout --ctx tp=6,pp=1 --gen tp=4,pp=3 --layers 30 --kv-heads 3 --head-dim 64 \\
        --ctx-block 16 --gen-block 48 [--mla] [--ctx-layers 8,8,7,7] [--gen-layers ...] [--dtype bfloat16] \\
        [--tokens N] [--seed S] [--ctx-order block_major|layer_pools] [--gen-order ...] [--path both]
        [--mapping]

Builds both executors' pools in one host buffer, moves one request of N tokens with the real mapping and
planner (the direct path, then the staged pack -> read -> unpack path), and compares every byte of every
generation pool. Prints OK with the fragment counts per generation rank, or the reason the split cannot work.
Exit code: 0 ok, 1 a byte mismatched (a kvbridge bug: please report the command line), 2 invalid split or
arguments. Owns argument parsing and the report only; the checking is formatter/verify.py's.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import KvBridgeError, LayoutError
from .layout import DTYPE_SIZES, POOL_ORDERS, KVLayout, KVShape, ParallelSplit
from .mapping import mapping_for
from .staging import DEFAULT_THRESHOLD_BYTES, MIN_STAGED_FRAGMENTS
from .verify import pool_nbytes, verify_split

__all__ = ["main"]

MAX_ARENA_BYTES = 512 << 20  # what one in-process check may allocate for the pools of both executors


class _Invalid(Exception):
    """A bad argument: reported like an invalid split (exit code 2)."""


def _split(text: str, layers: str | None, side: str) -> ParallelSplit:
    kv = {}
    for part in filter(None, text.split(",")):
        k, eq, v = part.partition("=")
        if not eq or k.strip() not in ("tp", "pp") or not v.strip().isdigit():
            raise _Invalid(f"--{side} {text!r}: expected tp=N,pp=M (e.g. tp=4,pp=2)")
        kv[k.strip()] = int(v)
    lps = None
    if layers:
        try:
            lps = tuple(int(x) for x in layers.split(","))
        except ValueError:
            raise _Invalid(f"--{side}-layers {layers!r}: expected layers per stage, e.g. 8,8,7,7") from None
    return ParallelSplit(kv.get("tp", 1), kv.get("pp", len(lps) if lps else 1), lps)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvbridge verify-layout", description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", required=True, help="context split, e.g. tp=1,pp=4")
    ap.add_argument("--gen", required=True, help="generation split, e.g. tp=4,pp=1")
    ap.add_argument("--layers", type=int, required=True, help="the model's layer count")
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (required unless --mla)")
    ap.add_argument("--head-dim", type=int, required=True, help="head dim (MLA: the latent width)")
    ap.add_argument("--mla", action="store_true", help="one latent cache per layer, replicated over TP")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_SIZES))
    ap.add_argument("--ctx-block", type=int, default=16, help="context tokens per block")
    ap.add_argument("--gen-block", type=int, default=16, help="generation tokens per block")
    ap.add_argument("--ctx-layers", default=None, help="explicit context layers per stage, e.g. 8,8,7,7")
    ap.add_argument("--gen-layers", default=None, help="explicit generation layers per stage")
    orders = f"pool memory order: {' or '.join(POOL_ORDERS)}, or any permutation of lbkhn (e.g. lbhkn: vLLM's CPU cache)"
    ap.add_argument("--ctx-order", default="block_major", help=orders)
    ap.add_argument("--gen-order", default="block_major", help=orders)
    ap.add_argument("--tokens", type=int, default=None, help="request length (default: 4 blocks + 3 tokens)")
    ap.add_argument("--seed", type=int, default=0, help="picks the block ids on both sides")
    ap.add_argument("--path", default="both", choices=("direct", "staged", "both"))
    ap.add_argument("--mapping", action="store_true", help="print which context rank serves what")
    return ap


def _layouts(a) -> tuple[KVLayout, KVLayout]:
    if a.kv_heads is None and not a.mla:
        raise _Invalid("--kv-heads is required (or --mla)")
    heads = 1 if a.kv_heads is None else a.kv_heads
    out = []
    sides = (("ctx", "context", a.ctx, a.ctx_block, a.ctx_layers, a.ctx_order),
             ("gen", "generation", a.gen, a.gen_block, a.gen_layers, a.gen_order))
    for side, name, split, block, layers, order in sides:
        try:
            out.append(KVLayout(KVShape(a.layers, heads, a.head_dim, a.dtype, block, a.mla),
                                _split(split, layers, side), order))
        except LayoutError as e:
            raise LayoutError(f"{name} layout: {e}") from None
    return out[0], out[1]


def _path_note(ctx: KVLayout, gen: KVLayout, res) -> str:
    """Mean direct fragment size and the path `choose_path` would take for it."""
    frags = sum(res.fragments.values())
    if not frags:
        return ""
    mean = res.nbytes / frags
    per_piece = frags / sum(len(mapping_for(ctx, gen).pieces(g)) for g in range(gen.world_size))
    staged = per_piece >= MIN_STAGED_FRAGMENTS and mean < DEFAULT_THRESHOLD_BYTES
    return (f"mean fragment {mean:.0f} bytes -> {'staged' if staged else 'direct'} path at the default "
            f"threshold "
            f"({DEFAULT_THRESHOLD_BYTES >> 10} KiB, >= {MIN_STAGED_FRAGMENTS} fragments per piece)")


def main(argv: list[str]) -> int:
    """Run `kvbridge verify-layout`; returns 0 (ok), 1 (mismatch) or 2 (invalid split or arguments)."""
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the problem
        return 0 if e.code == 0 else 2
    try:
        ctx, gen = _layouts(a)
        mapping = mapping_for(ctx, gen)
        n = a.tokens if a.tokens is not None else 4 * max(a.ctx_block, a.gen_block) + 3
        if n <= 0:
            raise _Invalid(f"--tokens must be positive, got {n}")
        arena = sum(pool_nbytes(ctx, r, -(-n // a.ctx_block) + 3) for r in range(ctx.world_size)) + \
            sum(pool_nbytes(gen, r, -(-n // a.gen_block) + 2) for r in range(gen.world_size))
        if arena > MAX_ARENA_BYTES:
            raise _Invalid(f"the pools of both executors need {arena >> 20} MiB for {n} tokens, over the "
                           f"{MAX_ARENA_BYTES >> 20} MiB an in-process check may use: pass fewer --tokens or "
                           f"--layers (the mapping does not depend on them)")
    except (_Invalid, LayoutError) as e:
        print(f"INVALID  {e}", file=sys.stderr)
        return 2
    print(f"context:    {ctx.describe()}")
    print(f"generation: {gen.describe()}")
    if a.mapping:
        print(mapping.describe())
    failed = False
    for path in (("direct", "staged") if a.path == "both" else (a.path,)):
        try:
            res = verify_split(ctx, gen, n, seed=a.seed, path=path)
        except KvBridgeError as e:  # a plan the formatter itself refused: a bug for a valid layout pair
            print(f"{path:>6}: FAILED  {type(e).__name__}: {e}")
            failed = True
            continue
        print(f"{path:>6}: {res.summary()}  tokens={n}")
        if path == "direct" and res.ok:
            note = _path_note(ctx, gen, res)
            if note:
                print(f"        {note}")
        failed |= not res.ok
    print("MISMATCH" if failed else "OK")
    return 1 if failed else 0
