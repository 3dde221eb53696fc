"""Every built-in agent reads only state it (or the base class) defines: the base class keeps its own under
`_kvb_` names, so an agent that leaned on the base's old `self._lock` would fail only on the machine that runs
it (a GPU for cuda_ipc). Checked from the source, so CPU-only CI catches it."""

from __future__ import annotations

import ast
import pathlib

import pytest

AGENTS = pathlib.Path(__file__).resolve().parents[2] / "agents"


def _attrs(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(self.<name> read, self.<name> assigned or defined) in a class body."""
    read, defined = set(), {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read, defined


def _classes():
    base_read, base_defined = None, set()
    out = []
    for path in sorted(AGENTS.glob("*.py")):
        for cls in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
            if cls.name == "TransferAgent":
                base_read, base_defined = _attrs(cls)
            elif any(isinstance(b, ast.Name) and b.id == "TransferAgent" for b in cls.bases):
                out.append((path.name, cls))
    return base_defined, out


BASE_DEFINED, SUBCLASSES = _classes()


@pytest.mark.parametrize("where,cls", SUBCLASSES, ids=[c.name for _, c in SUBCLASSES])
def test_an_agent_reads_only_state_it_or_the_base_class_defines(where, cls):
    read, defined = _attrs(cls)
    missing = {a for a in read - defined - BASE_DEFINED if a.startswith("_") and not a.startswith("__")}
    assert not missing, f"{where}: {cls.name} reads self.{sorted(missing)} but nothing defines them"
