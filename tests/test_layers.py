"""Imports go one way (docs/architecture.md): every module of the package is read (its source, not run) and
each import, lazy ones inside functions included, must name a lower layer or its own. Engine adapters
(integrations, trtllm) sit beside the reference executor and never import it or serving."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the `kvbridge` package
BASE = {"errors": 0, "codec": 1, "netaddr": 0, "gcheap": 0, "__init__": 0}  # __init__: __version__ alone
LAYER = {"agents": 2, "formatter": 3, "kvcache": 4, "transceiver": 4, "executor": 5, "integrations": 5,
         "trtllm": 5, "serving": 6, "bench": 7, "cli": 7, "demo": 7, "__main__": 7}
# The one arrow between neighbours of a layer: the executor's host for connectors written against
# TensorRT-LLM (executor/connector/trtllm_api.py) hands them TensorRT-LLM's KvCacheConfig from kvbridge.trtllm.
SIDEWAYS = {("executor", "trtllm")}


def _part(dotted: str) -> str:
    return dotted.split(".", 1)[0]


def _rank(part: str) -> int:
    return BASE.get(part, LAYER.get(part, 99))


def _imports(path: Path) -> list[tuple[str, int]]:
    """(first part of each kvbridge module it imports, line)."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                names = ([*base, *node.module.split(".")] if node.module else
                         [*base, node.names[0].name])
                if names:  # a name of the root package itself (`from . import __version__`) is its __init__
                    first = names[0] if (ROOT / names[0]).is_dir() or (ROOT / f"{names[0]}.py").exists() \
                        else "__init__"
                    out.append((first, node.lineno))
            elif node.module and node.module.split(".")[0] == "kvbridge" and "." in node.module:
                out.append((node.module.split(".")[1], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvbridge."):
                    out.append((a.name.split(".")[1], node.lineno))
    return out


def _modules() -> list[Path]:
    skip = {"tests", "docs", "examples", ".venv", ".venv-vllm", "kvbridge.egg-info", ".whl", ".whl-serving"}
    return [p for p in ROOT.rglob("*.py")
            if not (set(p.relative_to(ROOT).parts) & skip) and not p.relative_to(ROOT).parts[0].startswith(".")
            and "results" not in p.relative_to(ROOT).parts]


def test_every_import_names_a_lower_layer_or_its_own():
    wrong = []
    mods = _modules()
    assert len(mods) > 200, "the package's modules were not found"
    for path in mods:
        mine = _part(str(path.relative_to(ROOT).with_suffix("")).replace("/", "."))
        assert mine in BASE or mine in LAYER, f"{path.relative_to(ROOT)}: no layer for {mine!r}; add it here"
        for other, line in _imports(path):
            if other == mine or (mine, other) in SIDEWAYS:
                continue
            if _rank(other) >= _rank(mine):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {other}")
    assert not wrong, "imports that run the wrong way:\n" + "\n".join(wrong)


def test_engine_adapters_never_import_the_reference_executor_or_serving():
    for adapter in ("integrations", "trtllm"):
        for path in (ROOT / adapter).rglob("*.py"):
            bad = [f"{path.relative_to(ROOT)}:{line}" for other, line in _imports(path)
                   if other in ("executor", "serving")]
            assert not bad, f"an engine adapter imports the reference executor or serving: {bad}"
