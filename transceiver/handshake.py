"""Handshake helpers: what a context rank makes of a Hello, what a generation rank makes of a Welcome, and
the context side's verification digests.

`check_hello` validates a generation rank's Hello against this context rank's layout (compatible layout, a
rank inside it, the same mapping version). `accept_welcome` validates everything the Welcome carries (layout,
pool bases, memory kind) and picks the transfer agent for the peer pair: the first kind, in this rank's
preference order, that the context rank offers and that connects (an intra-node agent refuses a peer on
another host, so "auto" falls back to NIXL). `context_digests` hashes what a context rank holds of one
generation rank's pieces (verification mode; the generation side hashes with formatter.digest.piece_digests).
All raise KvBridgeError subclasses naming what was wrong; none touches a socket or keeps state.
"""

from __future__ import annotations

import logging

from ..agents import MemoryKind
from ..errors import KvBridgeError, LayoutMismatchError, PeerError, ProtocolError
from ..formatter.layout import KVLayout
from ..formatter.mapping import MAPPING_VERSION, check_compatible, mapping_for
from ..formatter.planner import RankPool
from . import messages as m
from .pool import LocalPool

log = logging.getLogger(__name__)

__all__ = ["accept_welcome", "check_hello", "context_digests"]


def check_hello(layout: KVLayout, msg: m.Hello) -> KVLayout:
    """The generation layout a Hello announces, checked against this context rank's `layout`; raises
    LayoutMismatchError (layouts or mapping versions differ) or ProtocolError (a rank outside its layout)."""
    gen_layout = KVLayout.from_wire(msg.gen_layout)
    check_compatible(layout, gen_layout)
    if not 0 <= msg.gen_rank < gen_layout.world_size:
        raise ProtocolError(f"hello: gen_rank {msg.gen_rank} outside its layout's {gen_layout.world_size}")
    if msg.mapping_version != MAPPING_VERSION:
        raise LayoutMismatchError(f"context and generation map ranks differently (mapping version: "
                                  f"context {MAPPING_VERSION}, generation {msg.mapping_version}); "
                                  f"run the same kvbridge version on both sides")
    return gen_layout


def accept_welcome(pool: LocalPool, w: m.Welcome, endpoint: str) -> tuple[RankPool, str, str]:
    """(the context rank's RankPool, chosen agent kind, peer name); raises with the reason otherwise."""
    layout = KVLayout.from_wire(w.ctx_layout)
    check_compatible(layout, pool.layout)
    bases = m.int_list(w.pool_bases, "welcome pool_bases", 100000)
    if w.pool_kind not in ("DRAM", "VRAM"):
        raise ProtocolError(f"welcome: pool_kind {w.pool_kind!r} is not DRAM or VRAM")
    remote = RankPool.of(layout, w.ctx_rank, bases, w.num_blocks, MemoryKind(w.pool_kind), w.pool_device)
    tried = []
    for kind, agent in pool.agents.items():
        blob = w.agents.get(kind)
        if not isinstance(blob, bytes):
            continue
        try:
            peer_name = agent.connect(blob)
        except KvBridgeError as e:
            tried.append(f"{kind}: {e}")
            continue
        log.info("gen rank %d <- ctx rank %d (%s): agent %s", pool.rank, w.ctx_rank, endpoint, kind)
        return remote, kind, peer_name
    raise PeerError(f"no transfer agent in common with context rank at {endpoint}: this rank offers "
                    f"{list(pool.agents)}, it offers {sorted(w.agents)}; " + "; ".join(tried))


def context_digests(pool: LocalPool, gen_layout: KVLayout, gen_rank: int, blocks, num_tokens: int,
                    first_token: int = 0) -> tuple[list[bytes], list[int]]:
    """Context side of verification: digests (and their global layers) of what `gen_rank` reads here
    (tokens [first_token, num_tokens))."""
    from ..formatter.digest import piece_digests  # torch + xxhash, only in verification mode

    pieces = [p for p in mapping_for(pool.layout, gen_layout).pieces(gen_rank) if p.ctx_rank == pool.rank]
    digests = [d for p in pieces
               for d in piece_digests(pool.buffers, pool.rank_pool, p, blocks, num_tokens, first_token)]
    return digests, [layer for p in pieces for layer in p.layers]
