"""Issue 27: `kvbridge serve --check` resolves every transfer agent a config names, as a user runs it (a
subprocess in a working directory of its own): an unregistered name is refused (exit 2) with how to register
one; a `module:Class` importable from the working directory, a built-in, and `auto` are accepted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve_check(tmp_path, agent: str) -> subprocess.CompletedProcess:
    with open(os.path.join(ROOT, "examples", "serve_cpu.yaml"), encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg["model"] = "seeded:tiny"
    cfg["context_servers"]["tp"] = 1
    cfg["transceiver"]["agent"] = agent
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", "--check", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_an_unregistered_agent_is_refused_naming_how_to_register_it(tmp_path):
    p = serve_check(tmp_path, "procmem")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no transfer agent named 'procmem' is registered" in p.stderr, p.stderr
    assert 'entry-points."kvbridge.agents"' in p.stderr and "MODULE:CLASS" in p.stderr, p.stderr
    assert "context_servers.transceiver.agent" in p.stderr, p.stderr


def test_a_module_class_in_the_working_directory_a_builtin_and_auto_are_accepted(tmp_path):
    shutil.copy(os.path.join(ROOT, "examples", "custom_agent.py"), tmp_path / "myagent.py")
    for agent in ("myagent:CmaAgent", "tcp", "auto"):
        p = serve_check(tmp_path, agent)
        assert p.returncode == 0, (agent, p.stdout + p.stderr)
        assert "valid" in p.stdout
    p = serve_check(tmp_path, "myagent:NoSuchClass")
    assert p.returncode == 2 and "is not a TransferAgent subclass" in p.stderr, p.stderr
