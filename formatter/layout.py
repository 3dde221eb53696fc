"""KV geometry: the model's KV shape, how an executor splits it (TP/PP), and where each element lives.

Owns the layout types and their wire form (msgpack-able dicts, strictly validated) and the stable
fingerprint both sides compare. Pure values: no memory, no transport.

Terms:
    KVShape      num_layers, num_kv_heads, head_dim, dtype, tokens_per_block, mla
    ParallelSplit tp, pp, layers per pipeline stage (explicit, or as even as possible, first stages larger)
    KVLayout     KVShape + ParallelSplit + pool memory order: one executor's layout
    rank         pp_rank * tp + tp_rank (TP fastest, the Megatron / TensorRT-LLM convention)

Pool memory orders (per rank). An order is the physical order of the five axes l (local layer), b (block),
k (K/V), h (local kv head), n (token in block), outermost first, written as a permutation of "lbkhn"; a
token's head_dim elements are always innermost and contiguous. Two have names:
    "block_major"  = "blkhn": one pool [num_blocks, local_layers, kv_factor, local_heads, tokens_per_block,
                   head_dim]: a block holds every local layer; inside a layer heads are outside tokens, so a
                   head range of a token range is contiguous. kvbridge's executor uses it.
    "layer_pools"  = "lbknh": one pool per local layer, [num_blocks, kv_factor, tokens_per_block, local_heads,
                   head_dim] (TensorRT-LLM's per-layer view).
Others describe an engine's own cache, e.g. vLLM's CPU backend "lbhkn" (per layer [blocks, heads, K/V,
tokens, head_dim]) or its flash-attention layout "lkbnh" (per layer [K/V, blocks, tokens, heads, head_dim]).
When l is outermost each layer may be its own allocation (one base per local layer, or one base for all);
otherwise the rank has one pool and one base.
MLA keeps one latent cache per layer (kv_factor 1, one "head" of head_dim = latent width) replicated on every
TP rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import LayoutError, ProtocolError

__all__ = ["KVShape", "ParallelSplit", "KVLayout", "PoolAddressing", "DTYPE_SIZES", "POOL_ORDERS", "order_axes"]

DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
POOL_ORDERS = ("block_major", "layer_pools")  # the named orders; any permutation of "lbkhn" is accepted too
_ORDER_AXES = {"block_major": "blkhn", "layer_pools": "lbknh"}


def order_axes(order: str) -> str:
    """The axis permutation ("lbkhn" letters, outermost first) of a pool order; LayoutError if it is none."""
    axes = _ORDER_AXES.get(order, order)
    if not isinstance(axes, str) or sorted(axes) != sorted("lbkhn"):
        raise LayoutError(f"pool order {order!r} is neither one of {POOL_ORDERS} nor a permutation of 'lbkhn' "
                          f"(physical axis order: l layer, b block, k K/V, h kv head, n token)")
    return axes
# Bounds on splits (layouts arrive from peers; the mapping is built for every generation rank up front).
MAX_TP = MAX_PP = 1024
MAX_WORLD = 4096


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise LayoutError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the model's KV cache looks like, independent of how it is split."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    tokens_per_block: int = 16
    mla: bool = False

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            _pos_int(f, getattr(self, f))
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if self.mla and self.num_kv_heads != 1:
            raise LayoutError(f"an MLA cache has one latent 'head' per layer, got num_kv_heads={self.num_kv_heads}")

    @property
    def kv_factor(self) -> int:
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class ParallelSplit:
    """How an executor is sharded: TP size, PP size and the layers of each pipeline stage."""

    tp: int = 1
    pp: int = 1
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _pos_int("tp", self.tp)
        _pos_int("pp", self.pp)
        if self.tp > MAX_TP or self.pp > MAX_PP or self.tp * self.pp > MAX_WORLD:
            raise LayoutError(f"tp={self.tp} x pp={self.pp} is beyond kvbridge's limits (tp, pp <= {MAX_TP}, "
                              f"tp x pp <= {MAX_WORLD})")
        if self.layers_per_stage is not None:
            lps = tuple(int(x) for x in self.layers_per_stage)
            if len(lps) != self.pp:
                raise LayoutError(f"layers_per_stage has {len(lps)} entries but pp={self.pp}")
            if min(lps) <= 0:
                raise LayoutError(f"every pipeline stage needs at least one layer, got {lps}")
            object.__setattr__(self, "layers_per_stage", lps)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_sizes(self, num_layers: int) -> tuple[int, ...]:
        if self.layers_per_stage is not None:
            if sum(self.layers_per_stage) != num_layers:
                raise LayoutError(f"layers_per_stage {self.layers_per_stage} sums to {sum(self.layers_per_stage)}"
                                  f", the model has {num_layers} layers")
            return self.layers_per_stage
        if self.pp > num_layers:
            raise LayoutError(f"pp={self.pp} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp)
        return tuple(base + (1 if i < extra else 0) for i in range(self.pp))


@dataclass(frozen=True)
class KVLayout:
    """One executor's KV layout: shape, split and pool memory order. Validated on construction."""

    shape: KVShape
    split: ParallelSplit = field(default_factory=ParallelSplit)
    order: str = "block_major"

    def __post_init__(self) -> None:
        order_axes(self.order)
        s, tp = self.shape, self.split.tp
        self.split.stage_sizes(s.num_layers)  # validates the layer split
        if not s.mla and s.num_kv_heads % tp and tp % s.num_kv_heads:
            raise LayoutError(
                f"tp={tp} cannot shard {s.num_kv_heads} kv heads: it must divide them (each rank holds "
                f"kv_heads/tp heads) or be a multiple of them (each head replicated on tp/kv_heads ranks)")

    def __hash__(self) -> int:
        """The fields' hash, computed once: a layout is hashed per request (the mapping cache, fingerprints)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.split, self.order))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}  # str hashes differ between processes

    # --- ranks --------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.split.world_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside 0..{self.world_size - 1}")
        return rank % self.split.tp, rank // self.split.tp

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.split.tp + tp_rank

    def stage_layers(self, pp_rank: int) -> range:
        """Global layer ids held by pipeline stage `pp_rank`."""
        sizes = self.split.stage_sizes(self.shape.num_layers)
        start = sum(sizes[:pp_rank])
        return range(start, start + sizes[pp_rank])

    @property
    def local_kv_heads(self) -> int:
        s, tp = self.shape, self.split.tp
        if s.mla or tp >= s.num_kv_heads:
            return 1
        return s.num_kv_heads // tp

    def head_range(self, tp_rank: int) -> range:
        """Global kv head ids held by `tp_rank` (one head, replicated, when tp >= kv heads; all for MLA)."""
        s, tp = self.shape, self.split.tp
        if s.mla:
            return range(0, 1)
        if tp >= s.num_kv_heads:
            h = tp_rank // (tp // s.num_kv_heads)
            return range(h, h + 1)
        n = s.num_kv_heads // tp
        return range(tp_rank * n, tp_rank * n + n)

    def local_layers(self, rank: int) -> int:
        return len(self.stage_layers(self.coords(rank)[1]))

    @property
    def per_layer_pools(self) -> bool:
        """True when the layer axis is outermost: each local layer's pool may be its own allocation."""
        return order_axes(self.order)[0] == "l"

    def pool_shape(self, rank: int, num_blocks: int) -> tuple[int, ...]:
        """Element shape of the rank's pool, or of each layer pool when the layer axis is outermost."""
        s = self.shape
        size = {"l": self.local_layers(rank), "b": num_blocks, "k": s.kv_factor, "h": self.local_kv_heads,
                "n": s.tokens_per_block}
        axes = order_axes(self.order)
        return tuple(size[a] for a in axes if not (a == "l" and axes[0] == "l")) + (s.head_dim,)

    def block_bytes(self, rank: int) -> int:
        """Bytes of one block on `rank`, all its local layers included."""
        s = self.shape
        return self.local_layers(rank) * s.kv_factor * self.local_kv_heads * s.tokens_per_block * s.head_dim \
            * s.itemsize

    # --- wire form ------------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        s, p = self.shape, self.split
        return {
            "num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "dtype": s.dtype, "tokens_per_block": s.tokens_per_block, "mla": s.mla,
            "tp": p.tp, "pp": p.pp, "layers_per_stage": list(p.stage_sizes(s.num_layers)), "order": self.order,
        }

    @classmethod
    def from_wire(cls, d: Any) -> "KVLayout":
        """Build from a peer's dict; ProtocolError naming the field if anything is missing or invalid."""
        if not isinstance(d, dict):
            raise ProtocolError("layout: expected a map")
        want = {"num_layers": int, "num_kv_heads": int, "head_dim": int, "dtype": str, "tokens_per_block": int,
                "mla": bool, "tp": int, "pp": int, "layers_per_stage": list, "order": str}
        for k, t in want.items():
            if k not in d:
                raise ProtocolError(f"layout: missing field {k!r}")
            if not isinstance(d[k], t) or (t is int and isinstance(d[k], bool)):
                raise ProtocolError(f"layout: field {k!r} should be {t.__name__}, got {type(d[k]).__name__}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in d["layers_per_stage"]):
            raise ProtocolError("layout: field 'layers_per_stage' must be a list of integers")
        try:
            return cls(KVShape(d["num_layers"], d["num_kv_heads"], d["head_dim"], d["dtype"],
                               d["tokens_per_block"], d["mla"]),
                       ParallelSplit(d["tp"], d["pp"], tuple(d["layers_per_stage"])), d["order"])
        except LayoutError as e:
            raise ProtocolError(f"layout: {e}") from None

    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of the layout (same on every machine and Python version)."""
        w = self.to_wire()
        text = ";".join(f"{k}={w[k]}" for k in sorted(w))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def describe(self) -> str:
        s, p = self.shape, self.split
        stages = "/".join(map(str, p.stage_sizes(s.num_layers)))
        kind = "MLA latent" if s.mla else f"{s.num_kv_heads} kv heads"
        return (f"{s.num_layers} layers, {kind}, head_dim {s.head_dim}, {s.dtype}, {s.tokens_per_block} tokens/"
                f"block, TP{p.tp} x PP{p.pp} (layers {stages}), {self.order}")


@dataclass(frozen=True)
class PoolAddressing:
    """Where element (local layer, kv, local head, block, token) of one rank lives, as byte arithmetic.

    address = layer_base[layer] + block * block_stride + kv * kv_stride + head * head_stride
              + token * token_stride; head_dim * itemsize contiguous bytes start there.
    """

    layer_base: np.ndarray  # int64 [local_layers]
    block_stride: int
    kv_stride: int
    head_stride: int
    token_stride: int
    num_blocks: int
    row_bytes: int  # head_dim * itemsize

    @classmethod
    def for_rank(cls, layout: KVLayout, rank: int, bases: list[int] | tuple[int, ...], num_blocks: int
                 ) -> "PoolAddressing":
        """Addressing of `rank`'s pool(s): one base, or one per local layer where the layer axis is outermost."""
        s = layout.shape
        L = layout.local_layers(rank)
        size = {"l": L, "b": num_blocks, "k": s.kv_factor, "h": layout.local_kv_heads, "n": s.tokens_per_block}
        row = s.head_dim * s.itemsize
        stride, step = {}, row
        for a in reversed(order_axes(layout.order)):
            stride[a] = step
            step *= size[a]
        if layout.per_layer_pools and len(bases) == L:
            layer_base = np.asarray(bases, dtype=np.int64)
        elif len(bases) == 1:
            layer_base = np.int64(bases[0]) + np.arange(L, dtype=np.int64) * stride["l"]
        else:
            want = f"one base per local layer ({L}) or one" if layout.per_layer_pools else "one base"
            raise LayoutError(f"a {layout.order} pool needs {want}, got {len(bases)}")
        return cls(layer_base, stride["b"], stride["k"], stride["h"], stride["n"], num_blocks, row)

    def pool_bytes(self, layout: KVLayout, rank: int) -> list[tuple[int, int]]:
        """(base, length) of each contiguous pool, for registration and remote bounds checks."""
        if not layout.per_layer_pools:
            return [(int(self.layer_base[0]), layout.block_bytes(rank) * self.num_blocks)]
        per_layer = layout.block_bytes(rank) // layout.local_layers(rank) * self.num_blocks
        return [(int(b), per_layer) for b in self.layer_base]
