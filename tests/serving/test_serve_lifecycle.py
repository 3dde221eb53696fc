"""`kvbridge serve` as a user runs it: a bad config, a worker failing at start-up, a generation worker killed
mid-stream under on_worker_exit: stop (the client gets an error, serve exits 1 naming it), Ctrl-C; no process
is left behind. Restarts (the default) are tested in test_supervision.py. Every process binds port 0
itself and serve prints the addresses it got (cluster.Serve reads them): no free-port-then-bind race."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from .cluster import MODEL, PATIENT, PROMPTS, TOKEN, Serve, config


def _cfg(**ctx) -> dict:
    return {"model": MODEL,
            "executor": {"num_blocks": 256, "tokens_per_block": 16, "threads_per_rank": 1, "timeout_s": 120},
            "transceiver": {"agent": "tcp", **PATIENT},
            "router": {"port": 0, "request_timeout_s": 120},
            "context_servers": {"instances": 1, **ctx},
            "generation_servers": {"instances": 1}}


def _serve(path: str, log: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "serve", path], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, KVBRIDGE_INTERNAL_TOKEN=TOKEN))


def _gone(pgid: int, timeout: float = 10.0) -> bool:
    """True once no process is left in the group (killed ones may take a moment to be reaped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _finish(p: subprocess.Popen, timeout: float = 90) -> int:
    try:
        return p.wait(timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def test_a_bad_config_exits_2_naming_the_key(tmp_path):
    cfg = _cfg()
    cfg["context_servers"]["tpp"] = 2
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", config(tmp_path, "bad", cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "context_servers.tpp: unknown key" in r.stderr and "'tp'" in r.stderr


def test_a_worker_failing_at_start_up_stops_serve_with_its_reason(tmp_path):
    path = config(tmp_path, "pp2", _cfg(pp=2, layers_per_stage=[1, 1]))  # the model has 4 layers
    p = _serve(path, str(tmp_path / "serve.log"))
    assert _finish(p) == 1
    log = (tmp_path / "serve.log").read_text()
    assert "context worker ctx0" in log and "during start-up" in log
    assert "layers_per_stage (1, 1) sums to 2, the model has 4 layers" in log


def test_killing_the_generation_worker_mid_stream_errors_the_client_and_stops_serve(tmp_path):
    s = Serve(tmp_path, {**_cfg(), "on_worker_exit": "stop"})
    p = s.proc
    try:
        ctx_pid, gen_pid = s.pid("ctx0"), s.pid("gen0")
        body = {"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "stream": True}
        events = []
        t0 = time.monotonic()
        with httpx.stream("POST", s.router + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 1:
                        os.kill(gen_pid, signal.SIGKILL)
        assert time.monotonic() - t0 < 60
        assert '"error"' in events[-1] and "generation worker gen0" in events[-1], events[-3:]
        assert "[DONE]" not in events[-1]
        assert _finish(p) == 1
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = s.log.read_text()
    assert f"generation worker gen0 ({s.urls['gen0']}, pid {gen_pid}) was killed by signal 9" in log
    assert _gone(gen_pid) and _gone(ctx_pid), "a worker's process group (its rank processes) outlived serve"


def test_ctrl_c_stops_every_process_and_exits_0(tmp_path):
    s = Serve(tmp_path, _cfg())
    p = s.proc
    try:
        pids = [s.pid("ctx0"), s.pid("gen0")]
        p.send_signal(signal.SIGINT)
        assert _finish(p, 60) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert all(_gone(pid) for pid in pids)
    assert "stopping" in s.log.read_text()
