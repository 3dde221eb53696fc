"""Rank processes for transceiver tests: real processes, real ZeroMQ, real agents, element-encoding pools.

A `RankProc` is one spawned interpreter that can be (re)initialised as a context or generation rank of any
layout. Context ranks fill the blocks of each published request with `pool_image` codes (salted per request)
and publish them; generation ranks pull, then compare their WHOLE pool against the image it must hold.
The pipe between the test and its processes carries test commands only (our own processes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(conn) -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    from kvbridge.formatter.layout import KVLayout
    from kvbridge.formatter.verify import pool_image
    from kvbridge.transceiver import CacheTransceiver, TransceiverConfig
    from kvbridge.transceiver.handles import RequestKey

    state: dict = {}

    def close():
        if state.get("tr") is not None:
            state["tr"].close()
        state.clear()

    class Req:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    while conn.poll(300):
        cmd, arg = conn.recv()
        try:
            if cmd == "init":
                close()
                layout = KVLayout.from_wire(arg["layout"])
                rank, nb = arg["rank"], arg["num_blocks"]
                bg = (1 + rank) if arg["role"] == "context" else (100 + rank)
                buf = pool_image(layout, rank, nb, [], bg).copy()
                cfg = TransceiverConfig.from_dict(arg.get("config", {}))
                make = CacheTransceiver.context if arg["role"] == "context" else CacheTransceiver.generation
                tr = make(buf, layout, rank, nb, cfg, instance=arg.get("instance"))
                state.update(tr=tr, buf=buf, layout=layout, rank=rank, nb=nb, bg=bg, held=[], results=[],
                             key=RequestKey.from_hex(arg["request_key"]) if arg.get("request_key") else None)
                conn.send(tr.endpoint if arg["role"] == "context" else tr.instance)
            elif cmd in ("publish", "publish_streaming", "publish_minted", "publish_minted_streaming"):
                tr, layout = state["tr"], state["layout"]  # list of (rid, blocks, n, salt)
                for rid, blocks, n, salt in arg:
                    state["held"].append((blocks, n, salt))
                state["buf"][:] = pool_image(layout, state["rank"], state["nb"], state["held"], state["bg"])
                ready = 0 if cmd.endswith("streaming") else None  # streaming: no layer readable yet
                minted = cmd.startswith("publish_minted")  # the transceiver makes the secret (read-ahead)
                out = [tr.respond_and_send_async(Req(
                    request_id=rid, block_ids=np.asarray(blocks), num_tokens=n, layers_ready=ready,
                    secret=None if minted else state["key"].secret(rid))).hex() for rid, blocks, n, salt in arg]
                conn.send(out if minted else True)
            elif cmd == "corrupt_next":  # fault injection: flip a byte of the next pull before it is confirmed
                rx, buf, layout = state["tr"].receiver, state["buf"], state["layout"]

                def flip(pull, rx=rx, buf=buf, layout=layout):
                    off = int(pull.blocks[0]) * layout.block_bytes(state["rank"])
                    buf[off] ^= 0xFF
                    rx.before_confirm = None

                rx.before_confirm = flip
                conn.send(True)
            elif cmd == "arena_in_use":  # staged path: bytes of this rank's staging arena still handed out
                arena = state["tr"].pool.arena
                conn.send(arena.in_use if arena is not None else None)
            elif cmd == "layers_ready":  # (rid, layers)
                state["tr"].sender.mark_layers_ready(*arg)
                conn.send(True)
            elif cmd == "ctx_status":
                tr = state["tr"]
                state["results"] += tr.check_context_transfer_status()
                conn.send({"pinned": tr.sender.pinned, "fetches": tr.sender.fetches, "sessions": tr.sender.sessions,
                           "finished": [(r.ctx_request_id, r.status, r.detail) for r in state["results"]]})
            elif cmd == "cancel":
                state["tr"].cancel_request(arg)
                conn.send(True)
            elif cmd == "withdraw":  # (params dict, num_tokens): Receiver.withdraw
                from kvbridge.transceiver import DisaggParams

                state["tr"].receiver.withdraw(DisaggParams.from_dict(arg[0]), arg[1])
                conn.send(True)
            elif cmd == "gen_status":  # pulls this generation rank still has in flight
                conn.send({"in_flight": state["tr"].receiver.in_flight})
            elif cmd == "arrived_layers":  # (blocks, n, salt) of a pull in flight: its local layers whose
                blocks, n, salt = arg  # bytes in those blocks already equal the context's (block_major pools)
                lay, nb = state["layout"], state["nb"]
                img = pool_image(lay, state["rank"], nb, state["held"] + [(blocks, n, salt)], state["bg"])
                per = lambda a: a.reshape(nb, lay.local_layers(state["rank"]), -1)[list(blocks)]  # noqa: E731
                got, want_ = per(state["buf"]), per(img)
                conn.send([li for li in range(got.shape[1]) if np.array_equal(got[:, li], want_[:, li])])
            elif cmd == "pool_digest":  # xxh3-64 of the whole pool: did anything write into it since?
                import xxhash

                conn.send(xxhash.xxh3_64_hexdigest(memoryview(state["buf"]).cast("B")))
            elif cmd in ("pull", "submit", "collect"):
                # pull: submit the pulls (rid, params dict, blocks, n, salt[, timeout]) and collect them;
                # submit: only submit (answers True); collect: wait for what was submitted.
                tr = state["tr"]
                want = state.setdefault("want", {})
                for item in arg.get("pulls", ()) if cmd != "collect" else ():
                    rid, params, blocks, n, salt = item[:5]
                    want[rid] = (blocks, n, salt)
                    tr.request_and_receive_async(Req(request_id=rid, disagg_params=params,
                                                     block_ids=np.asarray(blocks), num_tokens=n,
                                                     timeout_s=item[5] if len(item) > 5 else None))
                if cmd == "submit":
                    conn.send(True)
                    continue
                if cmd == "collect" and arg.get("cancel") is not None:
                    tr.cancel_request(arg["cancel"])
                t0 = time.monotonic()
                res = tr.check_gen_transfer_status(len(want), timeout_s=arg.get("timeout", 60))
                state["want"] = {}
                wall = time.monotonic() - t0
                dirty = state.setdefault("dirty", set())  # blocks of failed pulls: the executor would free them
                failed_blocks: set[int] = set()
                for r in res:
                    blocks = [int(b) for b in want[r.request_id][0]]
                    if r.ok:
                        state["held"].append(want[r.request_id])
                        dirty.difference_update(blocks)
                    else:
                        failed_blocks.update(blocks)
                image = pool_image(state["layout"], state["rank"], state["nb"], state["held"], state["bg"])
                owner = _byte_blocks(state["layout"], state["rank"], state["nb"])
                diff = state["buf"] != image
                in_failed = np.isin(owner, sorted(failed_blocks))
                mism = int(np.count_nonzero(diff & ~np.isin(owner, sorted(dirty | failed_blocks))))
                conn.send({"results": [r.__dict__ for r in res], "mismatched_bytes": mism, "wall_s": wall,
                           "failed_written_bytes": int(np.count_nonzero(diff & in_failed)),
                           "pool_bytes": int(state["buf"].nbytes)})
                dirty.update(failed_blocks)
            elif cmd == "exit":
                close()
                conn.send("bye")
                return
        except Exception as e:  # noqa: BLE001 - report to the test, keep serving
            conn.send({"exception": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    close()


def _byte_blocks(layout, rank: int, nb: int) -> np.ndarray:
    """The block id owning each byte of a rank's pool memory (block_major or layer_pools)."""
    per_block = layout.block_bytes(rank)
    idx = np.arange(per_block * nb, dtype=np.int64)
    if layout.order == "block_major":
        return idx // per_block
    per_layer_block = per_block // layout.local_layers(rank)
    return (idx % (per_layer_block * nb)) // per_layer_block


def ask(conn, cmd: str, arg=None, timeout: float = 120):
    """Send a command to a rank process over `conn` (send/poll/recv) and return its answer; raise on a harness
    exception or when no answer comes within `timeout`."""
    conn.send((cmd, arg))
    if not conn.poll(timeout):
        raise TimeoutError(f"rank process did not answer {cmd!r} within {timeout} s")
    out = conn.recv()
    if isinstance(out, dict) and "exception" in out:
        raise RuntimeError(f"rank process failed on {cmd!r}: {out['exception']}\n{out['traceback']}")
    return out


class RankProc:
    """A spawned rank process; `call(cmd, arg)` returns its answer (raises on a harness exception)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()

    def call(self, cmd: str, arg=None, timeout: float = 120):
        return ask(self.conn, cmd, arg, timeout)

    def close(self) -> None:
        try:
            self.call("exit", timeout=20)
        except (OSError, TimeoutError, EOFError, RuntimeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Cluster:
    """Context and generation executors made of RankProcs (reused across layouts to save start-up time)."""

    def __init__(self, n: int) -> None:
        self.procs = [RankProc() for _ in range(n)]

    def setup(self, ctx_layout, gen_layout, ctx_blocks: int, gen_blocks: int, config: dict | None = None):
        nc, ng = ctx_layout.world_size, gen_layout.world_size
        assert nc + ng <= len(self.procs), "cluster too small for this cell"
        self.ctx = self.procs[:nc]
        self.gen = self.procs[nc:nc + ng]
        self.ctx_layout, self.gen_layout = ctx_layout, gen_layout
        instance = f"ctx-{time.monotonic_ns()}"
        from kvbridge.transceiver.handles import RequestKey

        self.key = RequestKey.new()  # every context rank derives each request's secret from it
        self.endpoints = [p.call("init", {"role": "context", "layout": ctx_layout.to_wire(), "rank": r,
                                          "num_blocks": ctx_blocks, "config": config or {}, "instance": instance,
                                          "request_key": self.key.hex})
                          for r, p in enumerate(self.ctx)]
        for r, p in enumerate(self.gen):
            p.call("init", {"role": "generation", "layout": gen_layout.to_wire(), "rank": r,
                            "num_blocks": gen_blocks, "config": config or {}, "instance": f"gen-{instance}"})
        self.instance = instance

    def params(self, rid: int) -> dict:
        from kvbridge.transceiver import DisaggParams

        return DisaggParams(rid, self.instance, tuple(self.endpoints), self.ctx_layout,
                            self.key.secret(rid)).to_dict()

    def publish(self, reqs) -> None:
        for p in self.ctx:
            p.call("publish", reqs)

    def pull(self, pulls, timeout: float = 60) -> list[dict]:
        """Send the same pulls to every generation rank at once; return each rank's answer."""
        for p in self.gen:
            p.conn.send(("pull", {"pulls": pulls, "timeout": timeout}))
        out = []
        for p in self.gen:
            if not p.conn.poll(timeout + 30):
                raise TimeoutError("generation rank did not answer pull")
            ans = p.conn.recv()
            if "exception" in ans:
                raise RuntimeError(ans["exception"] + "\n" + ans["traceback"])
            out.append(ans)
        return out

    def ctx_status(self) -> list[dict]:
        return [p.call("ctx_status") for p in self.ctx]

    def wait_ctx_released(self, timeout: float = 10.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.ctx_status()
            if all(s["pinned"] == 0 for s in st) or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.procs:
            p.close()


def raw_session(endpoint: str, layout, name: str = "raw-gen"):
    """A raw generation-side DEALER that completed the handshake (Hello answered by Welcome), as any peer
    allowed on the control plane can: for tests that speak the wire protocol frame by frame."""
    import zmq

    from kvbridge.transceiver import messages as m

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(m.Hello(name, 0, layout.to_wire(), ["nixl"]).encode())
    assert s.poll(10000) and isinstance(m.decode(s.recv()), m.Welcome)
    return s
