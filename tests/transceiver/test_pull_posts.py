"""What a pull hands its agent: a grid-native agent gets the leg's plan as DescriptorGrids (exactly the ranges
plan_piece lists), any other agent fragment arrays from the I/O thread's reused memory, which go back for
reuse only once every read of the leg has settled."""

from __future__ import annotations

import time

import numpy as np

from kvbridge.agents import DescriptorGrid, DescriptorList, MemoryKind, XferState
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for
from kvbridge.formatter.planner import RankPool, plan_piece
from kvbridge.transceiver import pull as pull_mod
from kvbridge.transceiver.pull import Leg, LegState, Pull

NB, TOKENS = 40, 16 * 24


class Handle:
    def __init__(self) -> None:
        self.st = XferState.PENDING
        self.released = False

    def state(self):
        return self.st

    def release(self) -> None:
        self.released = True


class RecordingAgent:
    """Records what the pull posts (no data moves)."""

    def __init__(self, grid_native: bool) -> None:
        self.grid_native = grid_native
        self.posts: list[tuple[str, object, object]] = []
        self.handles: list[Handle] = []

    def _handle(self) -> Handle:
        self.handles.append(Handle())
        return self.handles[-1]

    def read(self, peer, local, remote):
        self.posts.append(("list", local, remote))
        return self._handle()

    def read_grid(self, peer, local, remote):
        self.posts.append(("grid", local, remote))
        return self._handle()


def _pull(ctx_tp: int = 2):
    ctx_l = KVLayout(KVShape(4, 4, 8, "float16", 16), ParallelSplit(ctx_tp))
    gen_l = KVLayout(KVShape(4, 4, 8, "float16", 16), ParallelSplit(1))
    gen = RankPool.of(gen_l, 0, [1 << 40], NB, MemoryKind.VRAM, 0)
    rng = np.random.default_rng(4)
    cb, gb = rng.permutation(NB)[:24], rng.permutation(NB)[:24]
    legs = {}
    for p in mapping_for(ctx_l, gen_l).pieces(0):
        leg = Leg(p.ctx_rank, f"tcp://ctx{p.ctx_rank}", p, state=LegState.FETCHED, ctx_blocks=cb, layers_ready=4)
        leg.remote = RankPool.of(ctx_l, p.ctx_rank, [(1 + p.ctx_rank) << 36], NB, MemoryKind.VRAM, 1)
        leg.peer_name = f"peer{p.ctx_rank}"
        legs[p.ctx_rank] = leg
    return Pull(1, 1, "ctx", gb, TOKENS, time.monotonic() + 60, legs), gen


def _expected(pull: Pull, leg: Leg, gen: RankPool):
    return plan_piece(leg.piece, leg.remote, gen, leg.ctx_blocks, pull.blocks, pull.num_tokens)


def test_a_grid_native_agent_gets_the_legs_plan_as_grids_of_exactly_its_fragments():
    pull, gen = _pull()
    agent = RecordingAgent(grid_native=True)
    for leg in pull.legs.values():
        pull.post_ready_layers(leg, gen, agent)
        kind, local, remote = agent.posts[-1]
        assert kind == "grid" and isinstance(local, DescriptorGrid) and isinstance(remote, DescriptorGrid)
        f = _expected(pull, leg, gen)
        np.testing.assert_array_equal(local.to_list().addrs, f.dst)
        np.testing.assert_array_equal(remote.to_list().addrs, f.src)
        assert (local.length, local.kind, remote.kind, remote.device) == (int(f.length[0]), MemoryKind.VRAM,
                                                                         MemoryKind.VRAM, 1)
        assert leg.all_posted and not leg.plans
    assert pull.nbytes == sum(_expected(pull, lg, gen).nbytes for lg in pull.legs.values())
    assert pull.fragments == sum(len(_expected(pull, lg, gen)) for lg in pull.legs.values())


def test_other_agents_get_lists_from_reused_memory_given_back_only_once_reads_settled():
    scratch = pull_mod._scratch()
    lent = scratch.lent
    pull, gen = _pull()
    agent = RecordingAgent(grid_native=False)
    for leg in pull.legs.values():
        pull.post_ready_layers(leg, gen, agent)
        kind, local, remote = agent.posts[-1]
        f = _expected(pull, leg, gen)
        assert kind == "list" and isinstance(local, DescriptorList)
        for a, b in ((local.addrs, f.dst), (remote.addrs, f.src), (local.lengths, f.length)):
            np.testing.assert_array_equal(a, b)
    assert scratch.lent == lent + 2
    agent.handles[0].st = XferState.DONE  # leg 0 settled; leg 1's read still in flight (quarantine over)
    pull.release(None, 1.0)
    assert all(h.released for h in agent.handles)
    assert scratch.lent == lent + 1  # leg 1's arrays stay out of reuse: its read may still touch them
    still_lent, given_back = agent.posts[1][1].addrs, agent.posts[0][1].addrs
    again, gen = _pull()
    for leg in again.legs.values():
        again.post_ready_layers(leg, gen, agent)
    new = [local.addrs for _, local, _ in agent.posts[2:]]
    assert not any(np.shares_memory(a, still_lent) for a in new)  # never handed out while its read may run
    assert any(np.shares_memory(a, given_back) for a in new)  # the settled leg's memory is used again
