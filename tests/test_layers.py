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


def _first_part(parts: list[str]) -> str:
    """The layer-level name of a kvbridge module path; a name of the root package itself (`from . import
    __version__`) is its __init__."""
    head = parts[0]
    return head if (ROOT / head).is_dir() or (ROOT / f"{head}.py").exists() else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(first part of each kvbridge module it imports, line), relative and absolute, lazy ones too."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                mod = [*base, *node.module.split(".")] if node.module else base
            else:
                dotted = (node.module or "").split(".")
                mod = dotted[1:] if dotted[0] == "kvbridge" else None
            if mod:
                targets = [mod]
            elif mod is not None:  # `from . import a, b` at the root, or `from kvbridge import a, b`
                targets = [[a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("kvbridge.")]
        out += [(_first_part(t), node.lineno) for t in targets]
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
