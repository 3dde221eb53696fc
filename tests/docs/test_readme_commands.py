"""Issue 27: every command README.md and docs/*.md show runs as printed, in a fresh shell with the venv
activated the way the README says (`source .venv/bin/activate`), from a fresh folder that holds the
checkout's files (links), so files a command writes land there. A failing command fails the test with its
output. Blocks marked `skip` (a GPU, several hosts, an install) are reported with their reason; a server
block (`kvbridge serve ...`) is started, waited for until its URL answers, and stopped with Ctrl-C after the
file's later blocks ran (they are its clients), and it must exit 0. Markers: tests/docs/readme_blocks.py.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from .readme_blocks import Block, blocks, file_skip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCK_TIMEOUT_S = 240
SERVER_START_S = 300
KNOWN = {"cd", "export", "source", "set", "echo", "true", "test", "[", "for", "do", "done", "if", "then",
         "fi"}


def workspace(tmp_path) -> str:
    """A fresh folder with a link to every top-level entry of the checkout (the venv included)."""
    for name in os.listdir(ROOT):
        if name != ".git":
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    return str(tmp_path)


def shell(script: str) -> list[str]:
    return ["bash", "-c", "set -e -o pipefail\nsource .venv/bin/activate\n" + script]


def missing_program(b: Block, cwd: str) -> str | None:
    """The first program a block's lines start with that the activated venv's PATH lacks (vllm, etcd...)."""
    for line in b.script.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        while words and "=" in words[0] and not words[0].startswith("="):  # VAR=value cmd
            words = words[1:]
        if not words or words[0] in KNOWN:
            continue
        p = subprocess.run(shell(f"command -v {shlex.quote(words[0])}"), cwd=cwd, capture_output=True)
        if p.returncode != 0:
            return words[0]
    return None


def gpu_reason(b: Block) -> str | None:
    code = " ".join(" ".join(shlex.split(ln, comments=True)) for ln in b.script.splitlines())
    if any(s in code for s in ("--device cuda", "--memory vram", "serve_2gpu")):
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def busy(url: str) -> bool:
    """Something already answers at the server's address (another process on a shared machine)."""
    u = urllib.parse.urlsplit(url)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((u.hostname, u.port or 80)) == 0


def wait_ready(proc: subprocess.Popen, url: str, b: Block) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"{b.where}: the server exited with {proc.returncode} before {url} answered:\n{out}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{b.where}: {url} did not answer 200 within {SERVER_START_S} s")


def stop(proc: subprocess.Popen, b: Block) -> None:
    """Ctrl-C to the server's process group, as a user would; SIGKILL if it is still there after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            pytest.fail(f"{b.where}: the server did not stop within 60 s of Ctrl-C")
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, f"{b.where}: the server exited with {proc.returncode} after Ctrl-C:\n{out}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_every_command_shown_runs_as_printed(doc, tmp_path, capsys):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    reason = file_skip(text)
    if reason:
        pytest.skip(f"{doc}: {reason}")
    todo = blocks(doc, text)
    cwd = workspace(tmp_path)
    skipped: list[str] = []
    servers: list[tuple[subprocess.Popen, Block]] = []
    try:
        for b in todo:
            why = b.arg if b.mode == "skip" else gpu_reason(b)
            prog = None if why else missing_program(b, cwd)
            if prog:
                why = f"needs `{prog}`, not installed here"
            if why:
                skipped.append(f"{b.where}: {why}")
                continue
            if b.mode == "server":
                if busy(b.arg):
                    pytest.skip(f"{b.where}: another process already listens at {b.arg}; this server and "
                                f"the blocks after it cannot run as printed here")
                proc = subprocess.Popen(shell(b.script), cwd=cwd, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
                servers.append((proc, b))
                wait_ready(proc, b.arg, b)
                continue
            p = subprocess.run(shell(b.script), cwd=cwd, capture_output=True, text=True,
                               timeout=BLOCK_TIMEOUT_S)
            assert p.returncode == 0, (f"{b.where}: exit {p.returncode} from\n{b.script}\n--- stdout\n"
                                       f"{p.stdout}\n--- stderr\n{p.stderr}")
        while servers:
            stop(*servers.pop())
    finally:
        for proc, _ in servers:  # a failure above: leave nothing running
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    with capsys.disabled():
        for s in skipped:
            print(f"\n  skipped {s}", end="")
    if todo and len(skipped) == len(todo):
        pytest.skip(f"{doc}: every block skipped: " + "; ".join(skipped))


def test_blocks_and_markers_are_found():
    text = ("x\n<!-- readme-test: skip needs a GPU -->\n\n```sh\nkvbridge bench transfer --device cuda\n```\n"
            "```text\n$ kvbridge --version\nkvbridge 0.1.0\n```\n```python\nprint(1)\n```\n"
            "<!-- readme-test: server http://h/health -->\n```bash\nkvbridge serve c.yaml\n```\n")
    got = blocks("X.md", text)
    assert [(b.mode, b.arg, b.script) for b in got] == [
        ("skip", "needs a GPU", "kvbridge bench transfer --device cuda"), ("run", "", "kvbridge --version"),
        ("server", "http://h/health", "kvbridge serve c.yaml")]
    assert file_skip("<!-- readme-test: skip-file needs vLLM -->") == "needs vLLM" and file_skip(text) is None
    assert file_skip("markers: `<!-- readme-test: skip-file REASON -->` in running text") is None
    assert shutil.which("bash")
