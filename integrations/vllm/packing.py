"""How an attention kernel packs K and V inside one (block, head) region, learned from the kernel itself.

vLLM's CPU attention stores each (block, head) as a K region then a V region of block_size x head_dim
elements, but the order of the elements inside a region is the kernel's own and depends on the ISA it picked:
with the vector kernel K is column-major ([head_dim, block_size]) and V row-major; with AMX (bf16) K keeps
pairs of dims together per token ([head_dim/2, block_size, 2]) and V pairs of tokens per dim. Rather than
hard-code one guess per ISA, `probe` asks the kernel: it writes K and V whose values encode (token, dim) into
a one-block cache with the kernel's own store op and reads where each element landed. The result, a
`Packing`, is a permutation per K|V: region element o holds logical element perm[o] = token * head_dim + dim.

With it a region unpacks to token rows and packs back (`unpack` / `pack`), which is what moving KV between
two block sizes needs (reblock.py), and what a positional digest of a packed cache compares (layout.kv_digest).
Owns no memory and imports torch, never vllm: the store op is handed in by connector.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import xxhash

from ...errors import LayoutError

__all__ = ["Packing", "probe", "rows", "unpack", "pack", "ELEMENT_INT"]

# a same-size integer dtype per element size: packing moves elements, never does arithmetic on them
ELEMENT_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BASE = 8  # digits small enough for every KV dtype to hold exactly (fp8 e5m2 holds 1..8)

# store(key, value, key_cache, value_cache, slot_mapping): key/value [tokens, 1, head_dim]; the caches
# [1, 1, block_size, head_dim] views of one block's K and V halves, as the backend hands them to its kernel
StoreOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Packing:
    """Where each element of a (block, head) K|V region sits: perm[kv][o] = token * head_dim + dim."""

    name: str  # the kernel variant, e.g. "vec", "amx"
    tokens_per_block: int
    head_dim: int
    perm: torch.Tensor  # int64 [2, tokens_per_block * head_dim]

    @property
    def digest(self) -> str:
        """Names this packing exactly: two engines whose digests differ pack the same KV differently."""
        return f"{self.name}:{self.tokens_per_block}x{self.head_dim}:" + xxhash.xxh3_64_hexdigest(
            self.perm.numpy().astype("<i8").tobytes())

    @property
    def is_rows(self) -> bool:
        """True when K and V are plain token rows (any block size maps by the formatter alone)."""
        return bool(torch.equal(self.perm, torch.arange(self.perm.shape[1]).expand(2, -1)))


def probe(store: StoreOp, name: str, tokens_per_block: int, head_dim: int, dtype: torch.dtype) -> Packing:
    """Learn the kernel's packing for one block size (LayoutError when the store is not a permutation)."""
    T, D = int(tokens_per_block), int(head_dim)
    cache = torch.zeros(1, 1, 2 * T, D, dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    slots = torch.arange(T, dtype=torch.int64)
    t = torch.arange(T).view(T, 1, 1).expand(T, 1, D)
    d = torch.arange(D).view(1, 1, D).expand(T, 1, D)
    logical = (t * D + d).reshape(-1)
    found = torch.zeros(2, T * D, dtype=torch.int64)
    digits = 1
    while _BASE ** digits < T * D:
        digits += 1
    for i in range(digits):
        cache.zero_()
        v = ((logical // _BASE ** i) % _BASE + 1).view(T, 1, D).to(dtype)
        store(v.contiguous(), v.contiguous(), kc, vc, slots)
        got = cache.reshape(2, T * D).float().round().to(torch.int64) - 1
        if bool(((got < 0) | (got >= _BASE)).any()):
            raise LayoutError(f"the {name} attention kernel's store does not keep the values it is given "
                              f"({dtype}, block {T}): kvbridge cannot learn its packing")
        found += got * _BASE ** i
    for kv in range(2):
        if not torch.equal(torch.sort(found[kv]).values, torch.arange(T * D)):
            raise LayoutError(f"the {name} attention kernel's {'KV'[kv]} packing (block {T}, head_dim {D}) is not "
                              f"a permutation of the region: kvbridge cannot move it token by token")
    return Packing(name, T, D, found)


def rows(tokens_per_block: int, head_dim: int) -> Packing:
    """The packing of a cache whose K and V regions are token rows."""
    n = int(tokens_per_block) * int(head_dim)
    return Packing("rows", int(tokens_per_block), int(head_dim), torch.arange(n).expand(2, n).contiguous())


def unpack(regions: torch.Tensor, p: Packing) -> torch.Tensor:
    """[..., 2, T*D] packed regions -> [..., 2, T, D] token rows (any element dtype)."""
    out = torch.empty_like(regions)
    idx = p.perm.view((1,) * (regions.dim() - 2) + tuple(p.perm.shape)).expand(regions.shape)
    out.scatter_(-1, idx, regions)
    return out.view(*regions.shape[:-1], p.tokens_per_block, p.head_dim)


def pack(tokens: torch.Tensor, p: Packing) -> torch.Tensor:
    """[..., 2, T, D] token rows -> [..., 2, T*D] regions in the kernel's packing."""
    flat = tokens.reshape(*tokens.shape[:-2], p.tokens_per_block * p.head_dim)
    idx = p.perm.view((1,) * (flat.dim() - 2) + tuple(p.perm.shape)).expand(flat.shape)
    return torch.gather(flat, -1, idx)
