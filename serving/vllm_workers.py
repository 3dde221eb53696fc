"""Server groups with `engine: vllm`: the `vllm:` config section, and each server as a vLLM OpenAI server.

Owns validating the `vllm:` section (top level, overridden per group, like `executor:`), and turning one
ServerSpec into the command line, environment and CPU binding of vLLM's own OpenAI server with a KV
connector configured (integrations/vllm/launch.py builds the process; it imports no vllm, so neither does
this). Never sends a request (the router's hops are vllm_backend.py) and never imports the connector: vLLM
loads it by module path inside its own interpreter.

    engine: vllm                           # in context_servers and generation_servers (both, or neither)
    vllm:
      python: null                         # vLLM's interpreter (default $KVBRIDGE_VLLM_PYTHON or .venv-vllm)
      kv_connector: KVBridgeConnector      # or NixlConnector (vLLM's own, for comparison)
      kv_connector_extra_config: {}        # passed to the connector as is
      kv_buffer_device: cpu                # NixlConnector only: where its KV buffer lives (cpu here)
      block_size: null                     # --block-size (the CPU backend wants multiples of 32)
      max_model_len: 2048
      max_num_seqs: 8
      gpu_memory_utilization: 0.1          # on CPU: a share of host memory
      dtype: float32
      enforce_eager: true
      cpus: auto                           # auto: a core of its own per TP rank, round robin over this
                                           # process's cores; none: vLLM's binding; or one
                                           # VLLM_CPU_OMP_THREADS_BIND value per instance ("0", "1|2")
      pin: true                            # once healthy, pin every thread of the server to its cores
      extra_args: []                       # more `vllm serve` arguments
      env: {}                              # more environment for the server
`model: tiny-llama` serves integrations/vllm/tiny_model.py's random Llama (written on first use); any
other model is a folder (or a name vLLM resolves offline). vLLM's /v1/* is closed with the deployment's
internal token as its API key (VLLM_API_KEY, in the environment); the router sends it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

from ..errors import ServeConfigError
from ..integrations.vllm.launch import VllmServerSpec, free_port, health, parse_cpus, pin_group, vllm_python

__all__ = ["ENGINES", "CONNECTORS", "vllm_section", "group_engine", "server_spec", "with_ports", "spawn_args",
           "resolve_model",
           "TINY_MODEL", "CONNECTOR_MODULE"]

ENGINES = ("kvbridge", "vllm")
CONNECTORS = ("KVBridgeConnector", "NixlConnector")
CONNECTOR_MODULE = "kvbridge.integrations.vllm.connector"
TINY_MODEL = "tiny-llama"

_DEFAULTS: dict[str, Any] = {"python": None, "kv_connector": "KVBridgeConnector",
                             "kv_connector_extra_config": {},
                             "kv_buffer_device": "cpu", "block_size": None, "max_model_len": 2048,
                             "max_num_seqs": 8, "gpu_memory_utilization": 0.1, "dtype": "float32",
                             "enforce_eager": True, "cpus": "auto", "pin": True, "extra_args": [], "env": {}}
_TYPES: dict[str, Any] = {"python": (str, type(None)), "kv_connector": str, "kv_connector_extra_config": dict,
                          "kv_buffer_device": str, "block_size": (int, type(None)), "max_model_len": int,
                          "max_num_seqs": int, "gpu_memory_utilization": float, "dtype": str,
                          "enforce_eager": bool, "cpus": (str, list), "pin": bool, "extra_args": list,
                          "env": dict}


def vllm_section(d: Any, path: str, base: dict | None, instances: int) -> dict[str, Any]:
    """The merged, validated `vllm:` settings of a group (`base`: the top level's); ServeConfigError naming
    the key otherwise."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ServeConfigError(f"{path}: expected a mapping, got {type(d).__name__}")
    bad = sorted(str(k) for k in d if k not in _DEFAULTS)
    if bad:
        raise ServeConfigError(f"{path}.{bad[0]}: unknown key; known keys of {path}: {sorted(_DEFAULTS)}")
    out = {**_DEFAULTS, **(base or {})}
    for k, v in d.items():
        t = _TYPES[k]
        if t is float and type(v) is int:
            v = float(v)
        types = t if isinstance(t, tuple) else (t,)
        if type(v) is bool and bool not in types or not isinstance(v, types):
            names = " or ".join(x.__name__ for x in types)
            raise ServeConfigError(f"{path}.{k}: expected {names}, got {v!r}")
        out[k] = v
    if out["kv_connector"] not in CONNECTORS:
        raise ServeConfigError(f"{path}.kv_connector: {out['kv_connector']!r} is not one of {CONNECTORS}")
    for k in ("max_model_len", "max_num_seqs"):
        if out[k] < 1:
            raise ServeConfigError(f"{path}.{k}: must be >= 1, got {out[k]}")
    if out["block_size"] is not None and out["block_size"] < 1:
        raise ServeConfigError(f"{path}.block_size: must be >= 1, got {out['block_size']}")
    if not 0 < out["gpu_memory_utilization"] <= 1:
        raise ServeConfigError(f"{path}.gpu_memory_utilization: must be in (0, 1], got "
                               f"{out['gpu_memory_utilization']}")
    if not all(isinstance(a, str) for a in out["extra_args"]):
        raise ServeConfigError(f"{path}.extra_args: expected a list of strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in out["env"].items()):
        raise ServeConfigError(f"{path}.env: expected a mapping of strings to strings")
    cpus = out["cpus"]
    if isinstance(cpus, str) and cpus not in ("auto", "none"):
        cpus = [cpus] * instances
    if isinstance(cpus, list):
        if len(cpus) != instances or not all(isinstance(c, str) for c in cpus):
            raise ServeConfigError(f"{path}.cpus: give auto, none, or one core list per instance "
                                   f"({instances}), "
                                   f"e.g. ['0', '1'] or ['0|1'] for TP2; got {out['cpus']!r}")
        for c in cpus:
            try:
                parse_cpus(c)
            except ValueError as e:
                raise ServeConfigError(f"{path}.{e}") from None
    out["cpus"] = cpus
    return out


def group_engine(d: dict, path: str, top: Any, n: int) -> tuple[str, dict[str, Any]]:
    """A server group's engine and, for engine: vllm, its merged `vllm:` section (`top`: the top level's)."""
    engine = d.get("engine", "kvbridge")
    if engine not in ENGINES:
        raise ServeConfigError(f"{path}.engine: {engine!r} is not one of {ENGINES}")
    if engine != "vllm":
        if "vllm" in d:
            raise ServeConfigError(f"{path}.vllm: only for engine: vllm (this group's engine is {engine})")
        return engine, {}
    return engine, vllm_section(d.get("vllm"), f"{path}.vllm", vllm_section(top, "vllm", None, n), n)


def resolve_model(model: str) -> str:
    """The folder (or name) vLLM serves for the config's `model`: `tiny-llama` is written on first use."""
    if model == TINY_MODEL:
        from ..integrations.vllm.tiny_model import tiny_llama

        return str(tiny_llama())
    return os.path.expanduser(model)


def with_ports(cfg):
    """`cfg` with each port 0 of a vLLM server replaced by a free port (vLLM binds the number it is given)."""
    ports = {s.name: free_port(s.bind_host if s.bind_host not in ("", "0.0.0.0") else "127.0.0.1")
             for s in cfg.servers() if s.port == 0}
    return cfg.resolved(ports) if ports else cfg


def _auto_cpus(cfg) -> dict[str, str]:
    """cpus: auto: each TP rank of each vLLM server a core of its own, round robin over our cores."""
    cores = sorted(os.sched_getaffinity(0))
    out, k = {}, 0
    for s in cfg.servers():
        ranks = []
        for _ in range(s.tp * s.pp):
            ranks.append(str(cores[k % len(cores)]))
            k += 1
        out[s.name] = "|".join(ranks)
    return out


def kv_transfer_config(s) -> dict[str, Any]:
    """The `--kv-transfer-config` of server `s`: context servers produce KV, generation servers consume it;
    KVBridgeConnector gets the group's `transceiver:` settings (serve's CurveZMQ keys included)."""
    v = s.vllm
    out: dict[str, Any] = {"kv_connector": v["kv_connector"],
                           "kv_role": "kv_producer" if s.role == "context" else "kv_consumer",
                           "kv_connector_extra_config": dict(v["kv_connector_extra_config"])}
    if v["kv_connector"] == "KVBridgeConnector":
        out["kv_connector_module_path"] = CONNECTOR_MODULE
        out["kv_connector_extra_config"] = {"transceiver": dict(s.transceiver),
                                            **out["kv_connector_extra_config"]}
    else:
        out["kv_buffer_device"] = v["kv_buffer_device"]
    return out


def server_spec(cfg, s, token: str | None) -> VllmServerSpec:
    """The vLLM server of ServerSpec `s` (its port already known: see with_ports)."""
    v = s.vllm
    cpus = v["cpus"]
    # auto: by its place in the config (a cluster member named by hand takes its --index's cores)
    bind = (_auto_cpus(cfg)[dataclasses.replace(s, worker_id="").name] if cpus == "auto" else
            None if cpus == "none" else cpus[s.index])
    extra = list(v["extra_args"])
    if s.pp > 1:
        extra += ["--pipeline-parallel-size", str(s.pp)]
    return VllmServerSpec(model=resolve_model(cfg.model), port=s.port, host=s.bind_host or s.host,
                          python=v["python"] or vllm_python(), kv_transfer_config=kv_transfer_config(s),
                          served_model_name=cfg.model_name, block_size=v["block_size"],
                          tensor_parallel_size=s.tp,
                          max_model_len=v["max_model_len"], max_num_seqs=v["max_num_seqs"],
                          gpu_memory_utilization=v["gpu_memory_utilization"], dtype=v["dtype"],
                          enforce_eager=v["enforce_eager"], cpus=bind, pin=v["pin"], api_key=token,
                          side_channel_port=free_port(span=s.tp), extra_args=tuple(extra),
                          env=tuple(sorted(v["env"].items())))


def spawn_args(cfg, role: str, index: int, env: dict[str, str], token: str | None):
    """argv, environment and an after-start hook (pins the server once healthy) for Cluster._spawn."""
    spec = server_spec(cfg, cfg.server(role, index), token)
    argv, env = spec.popen_args(env)

    def after_start(proc, timeout: float = cfg.startup_timeout_s) -> None:
        if spec.cpus is None or not spec.pin:
            return
        threading.Thread(target=_pin_when_healthy, args=(spec, proc, timeout), daemon=True,
                         name=f"kvbridge-pin-{role}{index}").start()

    return argv, env, after_start


def _pin_when_healthy(spec: VllmServerSpec, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if health(spec.url, timeout=1.0):
            pin_group(proc.pid, parse_cpus(spec.cpus))
            return
        time.sleep(0.5)
