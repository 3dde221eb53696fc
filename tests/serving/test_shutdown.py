"""Clean shutdown (issue 14): SIGTERM to a worker or to `kvbridge serve` exits 0 and leaves no kvbridge-*
folder in the temporary directory (each process runs with its own TMPDIR here, so only its own leftovers
count), and no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .cluster import MODEL, PATIENT, config, start_process, wait_healthy, wait_log
from .test_serve_lifecycle import _finish, _gone

CFG = {
    "model": MODEL,
    "executor": {"num_blocks": 32, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", **PATIENT},
    "router": {"port": 0, "request_timeout_s": 60},
    "context_servers": {"tp": 2},
    "generation_servers": {"tp": 1},
}


def _tmpdir(tmp_path) -> str:
    d = tmp_path / "tmp"
    d.mkdir()
    return str(d)


def test_sigterm_to_a_worker_exits_0_and_removes_its_temporary_folders(tmp_path, monkeypatch):
    tmp = _tmpdir(tmp_path)
    monkeypatch.setenv("TMPDIR", tmp)  # start_process passes the environment on
    port_file = tmp_path / "ctx.port"
    p = start_process(["worker", "--config", config(tmp_path, "c", CFG), "--role", "context", "--port-file",
                       str(port_file)], str(tmp_path / "ctx.log"))
    try:
        from kvbridge.serving.listen import wait_port_file

        health = wait_healthy(f"http://127.0.0.1:{wait_port_file(str(port_file), 120, p)}", p)
        assert sorted(os.listdir(tmp)), "the worker made no temporary folder: nothing is tested"
        p.send_signal(signal.SIGTERM)
        assert _finish(p, 60) == 0, (tmp_path / "ctx.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert _gone(health["pid"])
    assert os.listdir(tmp) == [], "left behind after SIGTERM"


def test_sigterm_to_serve_exits_0_and_leaves_no_temporary_folder(tmp_path):
    tmp = _tmpdir(tmp_path)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "serve", config(tmp_path, "c", CFG)],
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(os.environ, TMPDIR=tmp))
    try:
        wait_log(log, r"OpenAI API at \S+/v1", p)
        assert os.listdir(tmp), "serve made no temporary folder: nothing is tested"
        p.send_signal(signal.SIGTERM)
        assert _finish(p, 60) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert _gone(p.pid)
    assert os.listdir(tmp) == [], "left behind after SIGTERM"
