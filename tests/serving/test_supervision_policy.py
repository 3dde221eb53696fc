"""The supervisor's policy on its own, with injected deaths (the real processes are in test_supervision.py):
back-off 0.5 s doubling to 10 s and reset after a healthy minute, on_worker_exit: stop, role_grace_s, a hung
process killed after hang_timeout_s; and the config keys that drive it."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

import pytest

from kvbridge.errors import ServeConfigError
from kvbridge.serving.config import parse_config
from kvbridge.serving.supervisor import Supervisor


@dataclass
class _Proc:
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class _Child:
    name: str
    role: str
    started_at: float
    proc: _Proc = field(default_factory=_Proc)
    what: str = "context worker"
    url: str = "http://127.0.0.1:1"

    @property
    def label(self) -> str:
        return f"{self.what} {self.name}"

    def describe(self) -> str:
        return f"{self.label} exited with code {self.proc.returncode}"


class _Cluster:
    """Injects deaths: kill(name) ends a child; restart() starts a fresh one that is healthy when told."""

    def __init__(self, policy: str = "restart", grace: float = 30.0, hang: float = 60.0) -> None:
        self.cfg = parse_config({"model": "m", "context_servers": {}, "generation_servers": {},
                                 "on_worker_exit": policy, "role_grace_s": grace, "hang_timeout_s": hang})
        self.children = [_Child("ctx0", "context", 0.0), _Child("gen0", "generation", 0.0, what="gen")]
        self.now, self.up, self.restarts = 0.0, True, []
        self.silent: set[str] = set()  # running, answering nothing (hung)
        self.stalled: dict[str, float] = {}  # answering /health, its executor's ranks silent since then
        self.probes: list[tuple[float, str]] = []

    def kill(self, name: str) -> None:
        next(c for c in self.children if c.name == name).proc.returncode = -9

    def reap(self, c) -> None:
        pass

    def restart(self, c) -> None:
        self.restarts.append(self.now)
        self.children[self.children.index(c)] = _Child(c.name, c.role, self.now, what=c.what)

    def healthy(self, c, timeout: float = 1.0) -> bool:
        return self.up

    def silence(self, c, timeout: float = 1.0) -> float | None:
        self.probes.append((self.now, c.name))
        if c.name in self.silent:
            return None
        return self.now - self.stalled[c.name] if c.name in self.stalled else 0.0

    def kill_hung(self, c) -> None:
        self.silent.discard(c.name)
        self.stalled.pop(c.name, None)
        c.proc.returncode = -9

    def tail(self, c, n: int = 15) -> str:
        return ""


def _run(sup: Supervisor, cl: _Cluster, until: float, dt: float = 0.25) -> str | None:
    while cl.now < until:
        cl.now += dt
        why = sup.step(cl.now)
        if why:
            return why
    return None


def test_a_worker_that_keeps_dying_is_restarted_with_a_doubling_backoff_capped_at_10s():
    cl = _Cluster(grace=1000)
    sup = Supervisor(cl, out=io.StringIO(), now=0.0)
    gaps = []
    for n in range(7):
        cl.kill("ctx0")  # it dies again at once after each restart
        died = cl.now + 0.25  # seen at the next step
        while len(cl.restarts) == n:
            assert _run(sup, cl, cl.now + 0.25) is None
        gaps.append(round(cl.restarts[-1] - died, 2))
    assert gaps == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    _run(sup, cl, cl.now + 61)  # a healthy minute: the next death starts over at 0.5 s
    cl.kill("ctx0")
    died = cl.now + 0.25
    while len(cl.restarts) == 7:
        assert _run(sup, cl, cl.now + 0.25) is None
    assert cl.restarts[-1] - died == pytest.approx(0.5)


def test_stop_policy_ends_serve_at_the_first_death_naming_it():
    cl = _Cluster(policy="stop")
    cl.kill("gen0")
    why = Supervisor(cl, out=io.StringIO(), now=0.0).step(1.0)
    assert why == "gen gen0 exited with code -9" and cl.restarts == []


def test_a_role_with_no_live_worker_for_role_grace_s_ends_serve():
    cl = _Cluster(grace=5.0)
    sup = Supervisor(cl, out=io.StringIO(), now=0.0)
    cl.up = False  # restarted, but never healthy again
    cl.kill("ctx0")
    why = _run(sup, cl, 60)
    assert why == "no context worker has been live for role_grace_s=5s"
    assert 5.0 < cl.now <= 5.5 and len(cl.restarts) >= 1


def test_a_process_that_answers_nothing_for_hang_timeout_s_is_killed_then_restarted_and_others_are_left_alone():
    cl = _Cluster(hang=6.0)
    out = io.StringIO()
    sup = Supervisor(cl, out=out, now=0.0)
    _run(sup, cl, 10)
    assert {n for _, n in cl.probes} == {"ctx0", "gen0"} and not cl.restarts
    ts = [t for t, n in cl.probes if n == "gen0"]
    assert len(ts) >= 4 and max(b - a for a, b in zip(ts, ts[1:])) <= 2.0  # every 2 s (hang_timeout_s / 3)
    cl.silent.add("ctx0")  # hung from t=10: it still runs
    _run(sup, cl, 15.5)
    assert cl.children[0].proc.returncode is None, "killed before hang_timeout_s"
    while not cl.restarts:
        assert _run(sup, cl, cl.now + 0.25) is None and cl.now < 20
    assert "context worker ctx0 (http://127.0.0.1:1) answered no /health for 6s (hang_timeout_s=6); killing it" in \
        out.getvalue()
    assert cl.children[1].proc.returncode is None and cl.restarts[0] <= 10 + 6 + 2 + 0.5 + 0.5
    n = len(cl.probes)
    _run(sup, cl, cl.now + 10)  # the fresh ctx0 is probed once live, and answers
    assert any(name == "ctx0" for _, name in cl.probes[n:]) and len(cl.restarts) == 1


def test_a_worker_whose_ranks_are_silent_for_hang_timeout_s_is_killed_though_its_health_answers():
    cl = _Cluster(hang=6.0)
    out = io.StringIO()
    sup = Supervisor(cl, out=out, now=0.0)
    _run(sup, cl, 10)
    cl.stalled["gen0"] = 7.0  # its ranks last answered at t=7; /health says `stalled` once that is 3 s old
    _run(sup, cl, 12.75)
    assert cl.children[1].proc.returncode is None, "killed before its ranks were silent for hang_timeout_s"
    while not cl.restarts:
        assert _run(sup, cl, cl.now + 0.25) is None and cl.now < 16
    assert cl.restarts[0] <= 7 + 6 + 2 + 0.5 + 0.5  # counted from the ranks' last answer, not from the probe
    assert re.search(r"gen gen0 \(http://127.0.0.1:1\) answers /health, but its executor's ranks answered nothing "
                     r"for [67]s \(hang_timeout_s=6\); killing it", out.getvalue()), out.getvalue()
    assert cl.children[0].proc.returncode is None


def test_hang_timeout_s_0_never_probes():
    cl = _Cluster(hang=0)
    cl.silent.add("ctx0")
    _run(Supervisor(cl, out=io.StringIO(), now=0.0), cl, 300)
    assert cl.probes == [] and not cl.restarts


@pytest.mark.parametrize("key, value, message", [
    ("on_worker_exit", "ignore", "on_worker_exit: 'ignore' is not one of ('restart', 'stop')"),
    ("role_grace_s", 0, "role_grace_s: must be > 0 seconds"),
    ("hang_timeout_s", -1, "hang_timeout_s: must be >= 0 seconds"),
    ("insecure", "yes", "insecure: expected true or false"),
    ("internal_token", "short", "internal_token: must be at least 16 characters"),
])
def test_bad_supervision_and_security_keys_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ServeConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config({"model": "m", "context_servers": {}, "generation_servers": {}, key: value})
    with pytest.raises(ServeConfigError, match="router.api_keys: expected a list of non-empty strings"):
        parse_config({"model": "m", "context_servers": {}, "generation_servers": {},
                      "router": {"api_keys": [""]}})
