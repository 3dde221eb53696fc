"""The agent author's kit: everything a custom agent needs comes from `kvbridge.agents`, and docs/agents.md's
"Write your own TransferAgent" names only what is there."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import kvbridge.agents as kit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kvbridge_imports(path: str) -> set[str]:
    """Modules under kvbridge that the file imports from (at any depth of the file)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {m for m in mods if m.split(".")[0] == "kvbridge"}


def test_the_example_agents_import_only_from_kvbridge_agents():
    for example in ("custom_agent.py", "custom_connection.py"):
        assert _kvbridge_imports(os.path.join(ROOT, "examples", example)) == {"kvbridge.agents"}, example


def test_every_exported_name_resolves():
    missing = [n for n in kit.__all__ if not hasattr(kit, n)]
    assert not missing, missing


def test_the_agents_guide_names_only_what_kvbridge_agents_exports():
    with open(os.path.join(ROOT, "docs", "agents.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("# Write your own TransferAgent", 1)[1].split("\n## ", 1)[0]
    listed = section.split("Everything\nyou need is importable from `kvbridge.agents` (", 1)[1].split(")", 1)[0]
    names = set(re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", listed))
    assert {"TransferAgent", "FutureTransfer", "PeerError", "XferState", "seal", "register_agent"} <= names
    assert sorted(n for n in names if n not in kit.__all__) == []


def test_importing_the_kit_loads_no_transport():
    code = ("import sys, kvbridge.agents; "
            "print(sorted(m for m in ('nixl', 'torch', 'zmq', 'cuda', 'kvbridge.agents.cuda_driver') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
