"""Issue 27: `nixl-cu13` is optional (`kvbridge[nixl]`). A TCP-only user, on a machine where it cannot be
imported, imports every layer, serves host memory over tcp, and gets an error saying what to install when
asking for the nixl agent. Run in a subprocess whose import system refuses `nixl_cu13` and `nixl`."""

from __future__ import annotations

import subprocess
import sys

CODE = r'''
import importlib.abc, sys

class NoNixl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("nixl_cu13", "nixl"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoNixl())
import kvbridge, kvbridge.cli, kvbridge.agents, kvbridge.formatter, kvbridge.transceiver
import kvbridge.executor.runtime, kvbridge.serving.launcher, kvbridge.serving.router, kvbridge.serving.worker
import kvbridge.demo, kvbridge.trtllm
import numpy as np
from kvbridge.agents import AgentError, MemoryRegion, create_agent
a = create_agent("tcp", "tcp-only")
reg = a.register_memory(MemoryRegion.of(np.zeros(4096, dtype=np.uint8)))
reg.release()
a.close()
try:
    create_agent("nixl", "n")
except AgentError as e:
    print("NIXL-ERROR:", e)
assert not [m for m in sys.modules if m.split(".")[0] in ("nixl_cu13", "nixl")]
print("OK")
'''


def test_serve_check_says_what_to_install_when_auto_needs_nixl(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: seeded:tiny\ncontext_servers: {tp: 1}\ngeneration_servers: {tp: 1}\n")
    check = CODE.split("import kvbridge,", 1)[0] + (
        "from kvbridge.cli import main\n"
        f"code = main(['serve', '--check', {str(cfg)!r}])\n"
        "sys.exit(code)\n")
    p = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "pip install 'kvbridge[nixl]'" in p.stderr and "agent: tcp" in p.stderr, p.stderr
    cfg.write_text(cfg.read_text() + "transceiver: {agent: tcp}\n")
    p = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_kvbridge_works_without_nixl_and_says_what_to_install():
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK" in p.stdout
    assert "pip install 'kvbridge[nixl]'" in p.stdout, p.stdout
