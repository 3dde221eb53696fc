"""`kvbridge serve --check CONFIG`: validate a serving config (kvbridge's or trtllm-serve's) and print the
deployment `kvbridge serve` would start: workers, their ranks and devices, the transfer agents.

Exit 0: valid. Exit 2: invalid, with the reason (naming the key) on stderr. Starts nothing, opens no socket;
reads the model spec only as far as its config (a seeded preset's head and layer counts check TP/PP).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from ..errors import KvBridgeError, ServeConfigError
from ..transceiver.upstream import ENV_SWITCHES
from ..trtllm.serve_config import is_trtllm_serve_config
from .agent_check import check_agents
from .auth import api_keys, check_router_bind
from .config import ServeConfig, ServerSpec, load_config

__all__ = ["main", "describe"]


def _check_model(cfg: ServeConfig) -> None:
    spec = cfg.model
    if cfg.engine == "vllm":  # vLLM resolves its own model (serving/vllm_workers.py: tiny-llama or a folder)
        return
    if spec.startswith("seeded:"):
        from ..executor.config import parse_seeded_spec
        from ..formatter.layout import ParallelSplit

        mcfg, _ = parse_seeded_spec(spec)
        for s in cfg.servers():
            try:
                mcfg.check_split(ParallelSplit(s.tp, s.pp, s.layers_per_stage))
            except (KvBridgeError, ValueError) as e:
                key = "context_servers" if s.role == "context" else "generation_servers"
                raise ServeConfigError(f"{key}: {e} (model {spec})") from None
    elif spec.startswith("gguf:"):
        if not os.path.isfile(spec[5:]):
            raise ServeConfigError(f"model: {spec[5:]!r} is not a file")
    elif spec != "smollm2" and not os.path.isdir(spec):
        raise ServeConfigError(f"model: {spec!r} is not a kvbridge model spec (seeded:<preset>, smollm2, "
                               f"gguf:FILE, or a checkpoint directory with config.json + *.safetensors); a "
                               f"Hugging Face id is not downloaded")


def _devices(s: ServerSpec) -> list[str]:
    dev = s.executor.get("device", "cpu")
    n = s.tp * s.pp
    if dev == "cpu":
        return ["cpu"] * n
    base = int(dev.split(":", 1)[1]) if ":" in dev else 0
    return [f"cuda:{base + r} (mod the GPU count)" if dev == "cuda" else f"cuda:{base + r}" for r in range(n)]


def describe(cfg: ServeConfig) -> str:
    """The deployment, one line per worker and rank."""
    lines = [f"model: {cfg.model}", f"router: {cfg.router.url} (policy {cfg.router.policy})"]
    if cfg.tls is not None:
        lines.append(f"tls: HTTPS with {cfg.tls.cert} (key {cfg.tls.key}); peers checked against {cfg.tls.ca}")
    cl = cfg.cluster
    if cl is not None:
        lines.append(f"disagg_cluster: workers join through {cl.uri} (cluster {cl.name}), heartbeat "
                     f"{cl.heartbeat_s:g}s, lease {cl.ttl_s:g}s, minimal instances "
                     f"{', '.join(f'{r} {n}' for r, n in cl.minimal)}; the workers below start with serve")
    for s in cfg.servers():
        if s.engine == "vllm":
            v = s.vllm
            cpus = v["cpus"] if isinstance(v["cpus"], str) else v["cpus"][s.index]
            lines.append(f"{s.name}: {s.role} vLLM server at {s.url}, tp={s.tp} pp={s.pp}, "
                         f"{v['kv_connector']}, cpus {cpus}")
            continue
        ex = s.executor
        agents = s.transceiver.get("agents", s.transceiver.get("agent", ["auto"]))
        agents = [agents] if isinstance(agents, str) else list(agents)
        pool = f"{ex.get('num_blocks', 256)} blocks x {ex.get('tokens_per_block', 16)} tokens per rank"
        lines.append(f"{s.name}: {s.role} worker at {s.url}, tp={s.tp} pp={s.pp}, {pool}, "
                     f"agents {','.join(agents)}")
        for r, dev in enumerate(_devices(s)):
            lines.append(f"  rank {r} (tp {r % s.tp}, pp {r // s.tp}): {dev}")
    for name, meaning in ENV_SWITCHES.items():  # TensorRT-LLM's switches set in this environment
        if os.environ.get(name):
            lines.append(f"env {name}={os.environ[name]}: {meaning}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge serve --check",
                                 description="validate a serving config and print its deployment")
    ap.add_argument("config", help="a kvbridge or trtllm-serve disaggregated config (YAML)")
    ap.add_argument("--api-key", action="append", default=[], help="an API key the router would take (repeatable)")
    ap.add_argument("--log-dir", default=None, help=argparse.SUPPRESS)  # serve's, accepted and unused here
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config)
        _check_model(cfg)
        check_agents(cfg)
        check_router_bind(cfg.router.bind_host, api_keys(cfg, tuple(a.api_key)), cfg.router.insecure)
    except KvBridgeError as e:
        print(f"kvbridge serve --check: invalid: {e}", file=sys.stderr)
        return 2
    with open(a.config, encoding="utf-8") as f:
        upstream = is_trtllm_serve_config(yaml.safe_load(f))
    print(f"{a.config}: valid ({'trtllm-serve disaggregated format' if upstream else 'kvbridge format'})")
    print(describe(cfg))
    return 0
