"""Soak, part B: many requests through a context-only and a generation-only executor (different splits, real
rank processes, ZeroMQ + NIXL between them) with client aborts, leases left to expire and one worker restart.

Owns the client side of the soak: worker threads that each carry one request at a time through prefill ->
generation-only decode, the restart of the generation executor mid-run, and the final accounting:
    lost       a request that reached no terminal state within its deadline
    corrupted  a completed request whose tokens differ from aggregated decoding of the same prompt
    kv_mismatched  a completed request whose generation-side prompt KV, position by position (per layer and
               kv head, in token order), differs from its context-side KV (executor/kv_check.py): tokens
               cannot see misplaced KV, this can
    leaked     free blocks per rank at the end vs the start, both executors (the generation one after restart)
Never touches rank internals nor an Executor's private state: the context executor's releases (done by its
rank hooks) are taken with `Executor.take_released` as they arrive.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import ExecutorError
from ..executor.kv_check import mismatches
from ..executor.runtime import Executor, ExecutorConfig
from ..executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config

MODEL = "seeded:tiny3"
CTX_SPLIT = {"tp": 2, "tokens_per_block": 4, "num_blocks": 256}
# The generation pool gets 4 blocks per client thread (a request needs at most 4): freed blocks are reused
# at once.
GEN_SPLIT = {"tp": 1, "pp": 2, "tokens_per_block": 12}
XCFG = {
    "agents": ["nixl"],
    "lease_s": 3.0,
    "heartbeat_s": 0.5,
    "pickup_timeout_s": 3.0,
    "peer_timeout_s": 4.0,
    "handshake_timeout_s": 3.0,
    "transfer_timeout_s": 20.0,
    "drain_timeout_s": 1.0,
}


def prompts(n: int = 50, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < n:
        p = [rng.randrange(1, 256) for _ in range(rng.randrange(5, 45))]
        if p not in out:
            out.append(p)
    return out


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    aborted: int = 0  # generation requests that ended "aborted" by a client abort
    expired: int = 0  # context requests left unfetched, released by their lease
    restart_failed: int = 0  # in flight on the generation executor when it was restarted
    failed: int = 0  # any other terminal failure (named in errors)
    lost: int = 0
    corrupted: int = 0
    kv_checked: int = 0  # completed requests whose KV went through the positional check
    kv_mismatched: int = 0
    late_abort_completed: int = 0  # an abort that came after the request had finished: it completed normally
    errors: Counter = field(default_factory=Counter)
    log: list = field(default_factory=list)  # (seconds into the run, what) of the first 50 failures
    t0: float = field(default_factory=time.monotonic)
    corrupted_prompts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                if k == "error":
                    self.errors[re.sub(r"\d+", "N", v)[:200]] += 1
                    if len(self.log) < 50:
                        self.log.append((round(time.monotonic() - self.t0, 2), v[:300]))
                elif k == "corrupted_prompt":
                    self.corrupted_prompts[v] += 1
                else:
                    setattr(self, k, getattr(self, k) + v)


class RequestSoak:
    """One soak run. Args: requests; seed; concurrency (client threads); abort_p / expire_p (fractions of
    requests aborted by the client / left unfetched); restart (restart the generation executor once, at
    half of the requests); max_tokens; deadline_s (per request); run_dir (context endpoint files)."""

    def __init__(
        self,
        requests: int,
        seed: int,
        run_dir: str,
        concurrency: int = 24,
        abort_p: float = 0.1,
        expire_p: float = 0.05,
        restart: bool = True,
        max_tokens: int = 4,
        deadline_s: float = 60.0,
        progress=None,
    ) -> None:
        self.n, self.seed, self.run_dir = requests, seed, run_dir
        self.concurrency, self.abort_p, self.expire_p = concurrency, abort_p, expire_p
        self.restart_at = requests // 2 if restart else -1
        self.max_tokens, self.deadline_s = max_tokens, deadline_s
        self.progress = progress or (lambda s: None)
        self.prompts = prompts()
        self.gen_split = {**GEN_SPLIT, "num_blocks": 4 * concurrency}
        self.tally = Tally()
        self._next = 0
        self._idx_lock = threading.Lock()
        self._gen_cv = threading.Condition()
        self._gen: Executor | None = None
        self._closed: set[int] = set()  # id() of generation executors closed by the restart
        self.restarts = 0
        self.restart_t: list[float] = []  # seconds into the run: closed, back
        self._released: set[int] = set()
        self._rel_lock = threading.Lock()

    # --- executors --------------------------------------------------------------------------------------
    def _start(self, role: str, tag: str, split: dict) -> Executor:
        d = os.path.join(self.run_dir, tag)
        os.makedirs(d, exist_ok=True)
        return Executor.start(
            hooked_executor_config(role, f"{tag}-instance", d, XCFG, model=MODEL, timeout_s=120, kv_digests=True,
                                   **split)
        )

    def expected(self) -> list[list[int]]:
        """Aggregated decoding of every prompt (one batch), the reference for `corrupted`."""
        with Executor.start(ExecutorConfig(model=MODEL, num_blocks=512, tokens_per_block=8)) as agg:
            return agg.generate(self.prompts, max_tokens=self.max_tokens)

    # --- the run ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.monotonic()
        self.want = self.expected()
        t_expected = time.monotonic() - t0
        self.ctx = self._start("context", "ctx", CTX_SPLIT)
        self._gen = self._start("generation", "gen0", self.gen_split)
        try:
            self.endpoints = context_endpoints(os.path.join(self.run_dir, "ctx"), self.ctx.layout.world_size)
            free0 = (self.ctx.free_blocks(), self._gen.free_blocks())
            t1 = self.tally.t0 = time.monotonic()
            workers = [
                threading.Thread(target=self._worker, args=(w,), daemon=True, name=f"soak-{w}")
                for w in range(self.concurrency)
            ]
            for w in workers:
                w.start()
            bound = time.monotonic() + self.n * 2.0 + 300  # far beyond any sane run: a stuck client thread
            for w in workers:
                w.join(max(1.0, bound - time.monotonic()))
            stuck = sum(w.is_alive() for w in workers)
            run_s = time.monotonic() - t1
            leaked = self._leaks(free0)
        finally:
            self.ctx.close()
            with self._gen_cv:
                if self._gen is not None:
                    self._gen.close()
        t = self.tally
        return {
            "requests": t.requests,
            "completed": t.completed,
            "aborted": t.aborted,
            "expired": t.expired,
            "restarts": self.restarts,
            "restart_failed": t.restart_failed,
            "failed": t.failed,
            "late_abort_completed": t.late_abort_completed,
            "lost": t.lost + stuck,
            "stuck_clients": stuck,
            "leaked_blocks": leaked,
            "corrupted": t.corrupted,
            "kv_checked": t.kv_checked,
            "kv_mismatched": t.kv_mismatched,
            "corrupted_prompts": dict(t.corrupted_prompts),
            "errors": dict(t.errors.most_common(12)),
            "error_log": t.log,
            "restart_at_s": self.restart_t,
            "requests_per_s": round(t.requests / run_s, 2),
            "run_s": round(run_s, 1),
            "expected_s": round(t_expected, 1),
            "concurrency": self.concurrency,
            "max_tokens": self.max_tokens,
            "abort_p": self.abort_p,
            "expire_p": self.expire_p,
            "ctx_split": CTX_SPLIT,
            "gen_split": self.gen_split,
            "transceiver": XCFG,
        }

    def _leaks(self, free0) -> int:
        """Free blocks back to the start on every rank? Waits out leases (bounded); returns blocks missing."""
        deadline = time.monotonic() + XCFG["pickup_timeout_s"] + XCFG["lease_s"] * 3 + 10
        while True:
            ctx_free, gen_free = self.ctx.free_blocks(), self._gen.free_blocks()
            missing = sum(a - b for a, b in zip(free0[0], ctx_free)) + sum(
                a - b for a, b in zip(free0[1], gen_free)
            )
            if missing == 0 or time.monotonic() > deadline:
                if missing:
                    self.tally.add(
                        error=f"leak: ctx free {ctx_free} of {free0[0]}, gen free {gen_free} of {free0[1]}"
                    )
                return missing
            time.sleep(0.25)

    def _take(self) -> int:
        with self._idx_lock:
            i = self._next
            self._next += 1
            return i

    def _worker(self, w: int) -> None:
        while True:
            i = self._take()
            if i >= self.n:
                return
            if i == self.restart_at:
                threading.Thread(target=self._restart, daemon=True, name="soak-restart").start()
            try:
                self._one(i)
            except Exception as e:  # noqa: BLE001 - a harness bug must not hang the run: count it
                self.tally.add(failed=1, error=f"harness: {type(e).__name__}: {e}")
            if i % 500 == 0:
                self.progress(f"requests: {i} started, {self.tally.completed} completed")

    def _one(self, i: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + i)
        k = rng.randrange(len(self.prompts))
        prompt, fate = self.prompts[k], rng.random()
        deadline = time.monotonic() + self.deadline_s
        self.tally.add(requests=1)
        gen = self._current_gen() if fate >= self.expire_p else None  # before the prefill: a restart in
        try:  # between fails the request cleanly
            res = self.ctx.prefill(prompt, timeout=self.deadline_s)
        except ExecutorError as e:
            self.tally.add(failed=1, error=f"prefill: {e}")
            return
        if fate < self.expire_p:  # never picked up: the lease must expire and the context blocks come back
            if self._wait_released(res.request_id, deadline):
                self.tally.add(expired=1)
            else:
                self.tally.add(lost=1, error="context request never released after its pickup timeout")
            return
        params = disagg_params(self.ctx, res.request_id, self.endpoints).to_dict()
        try:
            rid = gen.submit(
                prompt,
                max_tokens=self.max_tokens,
                mode="generation_only",
                first_token=res.first_token,
                ctx_info={"disagg_params": params},
            )
            if fate < self.expire_p + self.abort_p:
                time.sleep(rng.random() * 0.08)  # anywhere from before admission to after the last token
                gen.abort(rid)
        except ExecutorError as e:
            self._ended_by_error(gen, e)
            return
        if self._finish(gen, rid, k, deadline, aborted_by_client=fate < self.expire_p + self.abort_p):
            self._check_kv(gen, res.request_id, rid)

    def _check_kv(self, gen: Executor, ctx_rid: int, gen_rid: int) -> None:
        """The positional KV check of a completed request (both digests were recorded as it ran)."""
        try:
            bad = mismatches(self.ctx.kv_digest(ctx_rid, timeout=self.deadline_s),
                             gen.kv_digest(gen_rid, timeout=self.deadline_s))
        except ExecutorError as e:
            if id(gen) not in self._closed:  # else: the restart closed it before its digest was read
                self.tally.add(failed=1, error=f"kv digest: {e}")
            return
        self.tally.add(kv_checked=1, kv_mismatched=int(bool(bad)))
        if bad:
            self.tally.add(error=f"kv mismatch of context request {ctx_rid}: {bad[0]}")

    def _finish(self, gen: Executor, rid: int, k: int, deadline: float, aborted_by_client: bool) -> bool:
        """Wait for the generation request's end and count it; True when it completed."""
        while True:
            try:
                c = gen.wait(rid, timeout=0.5)
                break
            except ExecutorError as e:
                if id(gen) in self._closed:
                    self.tally.add(restart_failed=1)
                    return False
                if "timed out" not in str(e):
                    self._ended_by_error(gen, e)
                    return False
                if time.monotonic() > deadline:
                    self.tally.add(
                        lost=1, error=f"generation request {rid} not finished within {self.deadline_s} s"
                    )
                    return False
        if c.finish_reason == "aborted":
            if aborted_by_client:
                self.tally.add(aborted=1)
            else:
                self.tally.add(failed=1, error=f"aborted: {c.error}")
            return False
        if c.tokens != self.want[k]:
            self.tally.add(corrupted=1, corrupted_prompt=str(k))
        self.tally.add(completed=1, late_abort_completed=int(aborted_by_client))
        return True

    def _ended_by_error(self, gen: Executor, e: Exception) -> None:
        if id(gen) in self._closed:
            self.tally.add(restart_failed=1)
        else:
            self.tally.add(failed=1, error=f"{type(e).__name__}: {e}")

    # --- restart ----------------------------------------------------------------------------------------
    def _current_gen(self) -> Executor:
        with self._gen_cv:
            self._gen_cv.wait_for(lambda: self._gen is not None, timeout=300)
            if self._gen is None:
                raise ExecutorError("the generation executor did not come back within 300 s")
            return self._gen

    def _restart(self) -> None:
        """Close the generation executor with requests in flight; start a new one (new instance and ports)."""
        with self._gen_cv:
            old, self._gen = self._gen, None
        self._closed.add(id(old))
        self.restart_t = [round(time.monotonic() - self.tally.t0, 2)]
        old.close()
        self.progress("restart: generation executor closed")
        new = self._start("generation", "gen1", self.gen_split)
        with self._gen_cv:
            self._gen = new
            self.restarts += 1
            self.restart_t.append(round(time.monotonic() - self.tally.t0, 2))
            self._gen_cv.notify_all()
        self.progress("restart: generation executor back")

    # --- context releases -------------------------------------------------------------------------------
    def _wait_released(self, ctx_rid: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            self._drain_released()
            with self._rel_lock:
                if ctx_rid in self._released:
                    self._released.discard(ctx_rid)
                    return True
            time.sleep(0.05)
        return False

    def _drain_released(self) -> None:
        rids = self.ctx.take_released()
        with self._rel_lock:
            self._released.update(rids)
