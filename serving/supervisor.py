"""Supervision of a running deployment: what `kvbridge serve` does when one of its processes dies.

Owns the policy, not the processes (launcher.Cluster starts, reaps and restarts them):
    on_worker_exit: restart (default)  a dead child (worker or router) is reaped (its process group killed)
        and started again on the port it had, after a back-off that starts at 0.5 s and doubles up to 10 s;
        it starts over at 0.5 s once the child had run for a minute. The router takes the worker out when
        its calls fail and back in when its /health answers 200 again (same url: nothing to tell it).
    on_worker_exit: stop               the first death stops everything; serve exits 1 naming it.
A process that runs but answers no /health at all (not even an error) for hang_timeout_s (default 60 s;
0: never) — stopped, deadlocked, wedged in a system call — is killed (SIGKILL to its process group) and then
handled as any death: restarted, or everything stops. So is a worker whose /health answers but says its
executor's ranks have answered nothing that long (`stalled` with executor_silent_s: a rank process stopped or
wedged behind a live HTTP server, worker_state.watch_ranks). Each live process is asked every PROBE_S (at most 1 s
each). `serve` exits non-zero only when a role (context, generation or the router) had no live process —
running and answering /health — for role_grace_s. Never sends a request and never touches the KV: a request caught
by a death fails (the router reports it) or is retried by the router.
"""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass

__all__ = ["Supervisor", "BACKOFF_MIN_S", "BACKOFF_MAX_S", "HEALTHY_RESET_S", "PROBE_S"]

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
HEALTHY_RESET_S = 60.0
PROBE_S = 2.0  # how often a live process is asked whether it still answers (hang_timeout_s)
_TICK_S = 0.25


class _State(enum.Enum):
    STARTING = "starting"   # running, not yet answered /health
    LIVE = "live"           # running and answered /health since it (re)started
    WAITING = "waiting"     # dead, reaped, restarting at `due`


@dataclass
class _Track:
    state: _State
    backoff: float = 0.0
    due: float = 0.0
    restarts: int = 0
    answered: float = 0.0    # when it last answered /health (LIVE)
    next_probe: float = 0.0


class Supervisor:
    """Watches a started, healthy Cluster until a stop signal (KeyboardInterrupt) or a role stays dead.

    Args:
        cluster: the launcher's Cluster, after start() and wait_healthy().
        out: where the supervisor's lines go (default stderr).
        now: the monotonic time it starts at (default: now).
    """

    def __init__(self, cluster, out=None, now: float | None = None) -> None:
        self.cluster = cluster
        self.policy = cluster.cfg.on_worker_exit
        self.grace_s = cluster.cfg.role_grace_s
        self.out = out or sys.stderr
        self.hang_s = cluster.cfg.hang_timeout_s
        now = time.monotonic() if now is None else now
        self.track = {c.name: _Track(_State.LIVE, answered=now) for c in cluster.children}
        self.last_live = {c.role: now for c in cluster.children}

    def run(self) -> int:
        """Supervise until a role had no live process for role_grace_s (returns 1) or stop policy hits."""
        while True:
            time.sleep(_TICK_S)  # the launcher's own pace of polling its children; nothing waits on it
            why = self.step(time.monotonic())
            if why:
                self._say(f"{why}; stopping the others")
                return 1

    def step(self, now: float) -> str | None:
        """One round: reap the dead, restart the due, mark the healthy; a reason to stop, or None."""
        for c in list(self.cluster.children):
            t = self.track[c.name]
            if t.state is not _State.WAITING and c.proc.poll() is not None:
                self.cluster.reap(c)
                if self.policy == "stop":
                    return c.describe()
                self._schedule(c, t, now)
            elif t.state is _State.WAITING and now >= t.due:
                t.restarts += 1
                self._say(f"restarting {c.label} at {c.url} (restart {t.restarts})")
                self.cluster.restart(c)
                t.state = _State.STARTING
            elif t.state is _State.STARTING and self.cluster.healthy(c, timeout=0.5):
                t.state, t.answered = _State.LIVE, now
                self._say(f"{c.label} is back at {c.url}")
            elif t.state is _State.LIVE and self.hang_s and now >= t.next_probe:
                self._probe(c, t, now)
        return self._role_gone(now)

    def _probe(self, c, t: _Track, now: float) -> None:
        """Ask a live process for /health; one silent for hang_timeout_s is killed (its death is then seen
        like any other: restarted, or everything stops)."""
        t.next_probe = now + min(PROBE_S, self.hang_s / 3)
        silent = self.cluster.silence(c, timeout=min(1.0, self.hang_s / 3))
        if silent is not None:
            t.answered = now - silent
        if now - t.answered >= self.hang_s:
            what = "answered no /health" if silent is None else "answers /health, but its executor's ranks " \
                                                                "answered nothing"
            self._say(f"{c.label} ({c.url}) {what} for {now - t.answered:.0f}s (hang_timeout_s={self.hang_s:g}); "
                      f"killing it")
            self.cluster.kill_hung(c)

    def _schedule(self, c, t: _Track, now: float) -> None:
        ran = now - c.started_at
        t.backoff = BACKOFF_MIN_S if ran >= HEALTHY_RESET_S or not t.backoff else min(t.backoff * 2,
                                                                                     BACKOFF_MAX_S)
        t.due, t.state = now + t.backoff, _State.WAITING
        self._say(f"{c.describe()}; restarting it in {t.backoff:g}s{self.cluster.tail(c, 5)}")

    def _role_gone(self, now: float) -> str | None:
        for role in self.last_live:
            live = [c for c in self.cluster.children if c.role == role
                    and self.track[c.name].state is _State.LIVE]
            if live:
                self.last_live[role] = now
            elif now - self.last_live[role] > self.grace_s:
                what = "the router has not" if role == "router" else f"no {role} worker has"
                return f"{what} been live for role_grace_s={self.grace_s:g}s"
        return None

    def _say(self, line: str) -> None:
        print(f"kvbridge serve: {line}", file=self.out, flush=True)
