"""The serving config: one YAML file for the model, the context and generation servers, the transceiver, the
router and executor options, in the spirit of `trtllm-serve disaggregated -c config.yaml`.

Owns parsing and validation (every error names the key path, e.g. `context_servers.tp`), merging the shared
sections with each server group's overrides, and turning one server into its ExecutorConfig. Never starts
anything and never touches the network.
The `router:` section is router_spec.py's (RouterSpec); the key-by-key checks every section is read with are
config_keys.py's.

    model: smollm2                      # a model spec (kvbridge generate --help lists them)
    on_transfer_failure: fail           # or recompute: the generation worker prefills the prompt itself
    executor: {num_blocks: 256, tokens_per_block: 16, device: cpu, threads_per_rank: 1}  # enable_block_reuse
                                        # kv_digests: true records positional KV digests (tests, debugging;
                                        # served by a worker's GET /internal/kv_digests?handle=H)
                                        # kv_events: true publishes its KV events under any policy
    transceiver: {agent: auto, transfer_timeout_s: 30}     # TransceiverConfig.from_dict
    router: {host: 127.0.0.1, port: 8000, policy: round_robin, api_keys: []}  # policy: or least_loaded,
                                        # prefix_aware, kv_aware (+ kv_aware: {...}: docs/routing.md;
                                        # local_prefill_tokens: 0, opt-in: docs/routing-cost.md)
                                        # insecure: true lets it listen beyond loopback with no api_keys
    internal_token: null       # workers on other hosts: the deployment's token (or KVBRIDGE_INTERNAL_TOKEN)
    insecure: false            # true: a worker without a token, or a vLLM server, may listen beyond loopback
    keys_dir: null             # where `kvbridge serve` keeps the CurveZMQ keys (default: a temp folder)
    on_worker_exit: restart    # or stop: `kvbridge serve` stops everything when a worker dies
    role_grace_s: 120          # serve exits 1 once a role had no live worker this long
    hang_timeout_s: 60         # serve kills (then restarts) a process that answers no /health, or whose
                               # executor's ranks answer nothing, this long; 0: never
    tls: {cert: host.crt, key: host.key, ca: ca.crt}  # HTTPS between router and workers (serving/tls.py)
    max_inflight_requests: 512          # per process (router, each worker): beyond it 503 + Retry-After
    max_inflight_body_bytes: 134217728  # request-body bytes held at once per process (same answer beyond)
    disagg_cluster: {cluster_uri: etcd://10.0.0.2:2379}  # workers join/leave through a registry (cluster_config.py)
    context_servers: {instances: 1, tp: 3, urls: ["127.0.0.1:8001"]}
    generation_servers: {instances: 1, tp: 1, urls: ["127.0.0.1:8002"], device: cuda:0}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import KvBridgeError, ServeConfigError
from ..netaddr import is_loopback
from ..transceiver.config import TransceiverConfig
from .config_keys import config_map as _map
from .config_keys import copy_tree as _copy
from .config_keys import device as _device
from .config_keys import get_key as _get
from .config_keys import host_port as _host_port
from .config_keys import known_keys as _known
from .router_spec import POLICIES, RouterSpec
from .router_spec import api_keys as _api_keys
from .router_spec import parse_router as _router
from .tls import parse_tls

__all__ = ["ServeConfig", "ServerSpec", "RouterSpec", "load_config", "parse_config", "ROLES", "POLICIES"]

ROLES = ("context", "generation")
FAILURE_MODES = ("fail", "recompute")
EXIT_POLICIES = ("restart", "stop")

_TOP = {"model", "model_name", "on_transfer_failure", "executor", "transceiver", "router", "context_servers",
        "generation_servers", "startup_timeout_s", "default_max_tokens", "internal_token", "insecure",
        "keys_dir", "on_worker_exit", "role_grace_s", "hang_timeout_s", "max_inflight_requests",
        "max_inflight_body_bytes", "vllm", "disagg_cluster", "tls"}
_EXECUTOR = {"num_blocks": int, "tokens_per_block": int, "device": str, "dtype": (str, type(None)),
             "max_batch_tokens": int, "max_batch_seqs": int, "timeout_s": float, "threads_per_rank": int,
             "enable_block_reuse": bool, "stream_layers": int, "kv_digests": bool, "kv_events": bool}
_GROUP = {"instances", "num_instances", "tp", "pp", "layers_per_stage", "urls", "bind_host", "device",
          "executor", "transceiver", "engine", "vllm"}
_GROUP_KEY = {"context": "context_servers", "generation": "generation_servers"}


@dataclass(frozen=True)
class ServerSpec:
    """One worker: an executor of `tp` x `pp` ranks behind an HTTP server.

    host/port: where the router reaches it (port 0: `kvbridge serve` picks a free one); bind_host: the
    address its HTTP server binds. executor / transceiver: the merged settings for its ExecutorConfig and
    TransceiverConfig.
    """

    role: str
    index: int
    host: str
    port: int
    bind_host: str
    tp: int
    pp: int
    layers_per_stage: tuple[int, ...] | None
    executor: dict[str, Any]
    transceiver: dict[str, Any]
    engine: str = "kvbridge"   # or vllm: vLLM's own OpenAI server with a KV connector (vllm_workers.py)
    vllm: dict[str, Any] = field(default_factory=dict)  # the merged `vllm:` section of an engine: vllm group
    worker_id: str = ""  # `kvbridge worker --name` (a cluster member's id); default ctx<index> / gen<index>
    scheme: str = "http"  # https with the config's `tls:` (serving/tls.py)

    @property
    def name(self) -> str:
        return self.worker_id or f"{'ctx' if self.role == 'context' else 'gen'}{self.index}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def executor_config(self, model: str, instance: str, run_dir: str):
        """The ExecutorConfig of this server, with the transceiver as its rank hook."""
        from ..executor.transceiver_hook import hooked_executor_config  # only where an executor starts

        executor = {"enable_block_reuse": True, **self.executor}  # block reuse is on by default in serving
        if self.role == "context" and "stream_layers" not in self.executor and (not self.transceiver.get(
                "staging_arena_bytes") or self.transceiver.get("staging_memory") == "host"):  # docs/overlap.md
            executor["stream_layers"] = DEFAULT_STREAM_LAYERS
        return hooked_executor_config(self.role, instance, run_dir, self.transceiver, model=model, tp=self.tp,
                                      pp=self.pp, layers_per_stage=self.layers_per_stage, **executor)


DEFAULT_STREAM_LAYERS = 4  # serving's context executors mark layers ready every 4 (0 in the config: off)


@dataclass(frozen=True)
class ServeConfig:
    """A validated serving config. `raw` is the mapping it was parsed from (written back by `resolved`)."""

    model: str
    model_name: str
    on_transfer_failure: str
    context: tuple[ServerSpec, ...]
    generation: tuple[ServerSpec, ...]
    router: RouterSpec
    startup_timeout_s: float
    default_max_tokens: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    internal_token: str | None = field(default=None, repr=False)
    insecure: bool = False
    keys_dir: str | None = None
    on_worker_exit: str = "restart"
    role_grace_s: float = 120.0
    hang_timeout_s: float = 60.0
    max_inflight_requests: int = 512
    max_inflight_body_bytes: int = 128 << 20
    cluster: Any = None  # cluster_config.ClusterSpec: workers join through a registry (None: static urls)
    tls: Any = None  # tls.TlsSpec: the router and the workers speak HTTPS (None: plain HTTP)

    def servers(self) -> tuple[ServerSpec, ...]:
        return self.context + self.generation

    @property
    def engine(self) -> str:
        """What serves the requests: kvbridge (its reference executor) or vllm (both groups agree)."""
        return self.context[0].engine

    def server(self, role: str, index: int) -> ServerSpec:
        """The server `index` of `role`; ServeConfigError naming what exists otherwise."""
        if role not in ROLES:
            raise ServeConfigError(f"role {role!r} is not one of {ROLES}")
        group = self.context if role == "context" else self.generation
        if not 0 <= index < len(group):
            raise ServeConfigError(f"{_GROUP_KEY[role]} has {len(group)} instance(s); there is no index "
                                   f"{index}")
        return group[index]

    def resolved(self, ports: dict[str, int], router_port: int | None = None) -> "ServeConfig":
        """A copy with the given ports ({server name: port}) written into its urls (and the router's port)."""
        raw = _copy(self.raw)
        for role, key in _GROUP_KEY.items():
            group = self.context if role == "context" else self.generation
            raw[key]["urls"] = [f"{s.host}:{ports.get(s.name, s.port)}" for s in group]
            raw[key].pop("num_instances", None)
            raw[key]["instances"] = len(group)
        if router_port is not None:
            raw.setdefault("router", {})["port"] = router_port
        return parse_config(raw)

    def with_transceiver(self, role: str, settings: dict[str, Any]) -> "ServeConfig":
        """A copy whose `role` servers get these transceiver settings on top of their own."""
        raw = _copy(self.raw)
        group = raw[_GROUP_KEY[role]]
        group["transceiver"] = {**(group.get("transceiver") or {}), **settings}
        return parse_config(raw)

    def with_api_keys(self, keys: tuple[str, ...]) -> "ServeConfig":
        """A copy whose router takes these API keys (besides its own)."""
        raw = _copy(self.raw)
        router = raw.setdefault("router", {})
        router["api_keys"] = list(dict.fromkeys([*_api_keys(router.get("api_keys", [])), *keys]))
        return parse_config(raw)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False)


def load_config(path: str) -> ServeConfig:
    """Read and validate a YAML serving config.

    Raises:
        ServeConfigError: the file cannot be read, is not YAML, or a key is unknown or has a bad value.
    """
    try:
        with open(path, encoding="utf-8") as f:
            d = yaml.safe_load(f)
    except OSError as e:
        raise ServeConfigError(f"{path}: cannot read the serving config ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ServeConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return parse_config(d)
    except ServeConfigError as e:
        raise ServeConfigError(f"{path}: {e}") from None


def parse_config(d: Any) -> ServeConfig:
    """Validate a serving config mapping (see the module docstring), or a trtllm-serve one (kvbridge.trtllm)."""
    from ..trtllm.serve_config import maybe_translate

    top = _map(maybe_translate(d), "the config")
    _known(top, _TOP, "")
    model = _get(top, "model", str, "", required=True)
    if not model:
        raise ServeConfigError("model: must name a model (e.g. smollm2 or seeded:tiny)")
    mode = _get(top, "on_transfer_failure", str, "", "fail")
    if mode not in FAILURE_MODES:
        raise ServeConfigError(f"on_transfer_failure: {mode!r} is not one of {FAILURE_MODES}")
    executor = _executor(_map(top.get("executor", {}), "executor"), "executor")
    transceiver = _map(top.get("transceiver", {}), "transceiver")
    _transceiver(transceiver, "transceiver")
    groups = {}
    for role, key in _GROUP_KEY.items():
        if key not in top:
            raise ServeConfigError(f"{key}: missing (each config names its context and generation servers)")
        groups[role] = _group(role, _map(top[key], key), key, executor, transceiver, top.get("vllm"))
    if groups["context"][0].engine != groups["generation"][0].engine:
        raise ServeConfigError(f"generation_servers.engine: {groups['generation'][0].engine!r} differs from "
                               f"context_servers.engine {groups['context'][0].engine!r} (KV moves only "
                               f"between servers of one engine)")
    router = _router(_map(top.get("router", {}), "router"))
    tls = parse_tls(top.get("tls"))
    if tls is not None:
        if groups["context"][0].engine == "vllm" and top.get("disagg_cluster") is None:
            raise ServeConfigError("tls: with engine: vllm needs disagg_cluster (`disagg_cluster: {}`: the router "
                                   "is the registry): each vLLM server then runs under a `kvbridge worker` whose "
                                   "guard serves HTTPS in front of it (vLLM itself stays on loopback)")
        groups = {r: tuple(dataclasses.replace(s, scheme="https") for s in g) for r, g in groups.items()}
        router = dataclasses.replace(router, scheme="https")
    startup = _get(top, "startup_timeout_s", float, "", 300.0)
    max_tokens = _get(top, "default_max_tokens", int, "", 256)
    if startup <= 0 or max_tokens < 1:
        raise ServeConfigError("startup_timeout_s must be > 0 and default_max_tokens >= 1")
    inflight = {k: _get(top, k, int, "", ServeConfig.__dataclass_fields__[k].default)
                for k in ("max_inflight_requests", "max_inflight_body_bytes")}
    bad = next((k for k, v in inflight.items() if v < 1), None)
    if bad:
        raise ServeConfigError(f"{bad}: must be >= 1, got {inflight[bad]}")
    cluster = None
    if top.get("disagg_cluster") is not None:
        from .cluster_config import parse_cluster

        cluster = parse_cluster(top["disagg_cluster"], router.host, router.port, tls is not None)
    if router.policy == "kv_aware" and groups["context"][0].engine == "vllm" and cluster is None:
        raise ServeConfigError("router.policy: kv_aware over vLLM servers (engine: vllm) needs "
                               "disagg_cluster: each server then runs under a `kvbridge worker` that relays "
                               "vLLM's KV events, signed, and registers where they are "
                               "(`disagg_cluster: {}`: the router is the registry)")
    ops = _operations(top)
    if groups["context"][0].engine == "vllm" and not ops["insecure"] and cluster is None:
        _vllm_on_loopback([*groups["context"], *groups["generation"]])  # members guard theirs (vllm_guard.py)
    raw = _copy(top)
    if tls is not None:  # absolute: a worker `kvbridge serve` starts elsewhere reads the same files
        raw["tls"] = {"cert": tls.cert, "key": tls.key, "ca": tls.ca}
    return ServeConfig(model, _get(top, "model_name", str, "", model), mode, groups["context"],
                       groups["generation"], router, startup, max_tokens, raw, **ops, **inflight,
                       cluster=cluster, tls=tls)


def _vllm_on_loopback(servers) -> None:
    """vLLM's --api-key (the deployment's token) guards /v1/* only: its /invocations runs completions, and
    /tokenize, /metrics, /scale_elastic_ep answer, for anyone. So without disagg_cluster (whose members put a
    guard that checks the token on every route in front of a server reached from other hosts) kvbridge starts
    vLLM servers on loopback only, unless the config accepts that with `insecure: true`."""
    for s in servers:
        if not is_loopback(s.bind_host or s.host):
            raise ServeConfigError(
                f"{s.name}: a vLLM server would listen on {s.bind_host or s.host}, where its routes outside /v1/* "
                f"take no key (vLLM's /invocations runs completions for anyone; /tokenize, /metrics and "
                f"/scale_elastic_ep answer too). Bind it to 127.0.0.1 (bind_host) with the router on its host, run "
                f"it as a disagg_cluster member (a guard then checks the deployment's token on every route), or "
                f"set insecure: true to accept that (a firewall or a private network in front of it)")


def _operations(top: dict) -> dict[str, Any]:
    """The security and supervision keys of the top level."""
    on_exit = _get(top, "on_worker_exit", str, "", "restart")
    if on_exit not in EXIT_POLICIES:
        raise ServeConfigError(f"on_worker_exit: {on_exit!r} is not one of {EXIT_POLICIES}")
    grace = _get(top, "role_grace_s", float, "", 120.0)
    if grace <= 0:
        raise ServeConfigError(f"role_grace_s: must be > 0 seconds, got {grace}")
    hang = _get(top, "hang_timeout_s", float, "", 60.0)
    if hang < 0:
        raise ServeConfigError(f"hang_timeout_s: must be >= 0 seconds (0: never), got {hang}")
    insecure = top.get("insecure", False)
    if type(insecure) is not bool:
        raise ServeConfigError(f"insecure: expected true or false, got {insecure!r}")
    token = _get(top, "internal_token", (str, type(None)), "", None)
    if token is not None and len(token) < 16:
        raise ServeConfigError("internal_token: must be at least 16 characters (`kvbridge serve` makes one "
                               "of 43 with secrets.token_urlsafe(32))")
    keys_dir = _get(top, "keys_dir", (str, type(None)), "", None)
    return {"internal_token": token, "insecure": insecure, "keys_dir": keys_dir, "on_worker_exit": on_exit,
            "role_grace_s": grace, "hang_timeout_s": hang}


# --- sections -------------------------------------------------------------------------------------------
def _executor(d: dict, path: str, base: dict | None = None) -> dict[str, Any]:
    _known(d, set(_EXECUTOR), path)
    out = dict(base or {})
    for k, t in _EXECUTOR.items():
        if k in d:
            out[k] = _get(d, k, t, path)
    for k in ("num_blocks", "tokens_per_block", "max_batch_tokens", "max_batch_seqs", "threads_per_rank"):
        if k in d and out[k] < 1:
            raise ServeConfigError(f"{path}.{k}: must be >= 1, got {out[k]}")
    if "stream_layers" in d and out["stream_layers"] < 0:  # 0: off; N: layers ready every N (streaming.py)
        raise ServeConfigError(f"{path}.stream_layers: must be >= 0, got {out['stream_layers']}")
    if "timeout_s" in d and out["timeout_s"] <= 0:
        raise ServeConfigError(f"{path}.timeout_s: must be > 0, got {out['timeout_s']}")
    if "device" in d:
        _device(out["device"], f"{path}.device")
    return out


def _transceiver(d: dict, path: str) -> None:
    try:
        TransceiverConfig.from_dict(d)
    except (KvBridgeError, TypeError, ValueError) as e:
        raise ServeConfigError(f"{path}: {e}") from None


def _group(role: str, d: dict, path: str, executor: dict, transceiver: dict,
           vllm: Any = None) -> tuple[ServerSpec, ...]:
    _known(d, _GROUP, path)
    if "instances" in d and "num_instances" in d:
        raise ServeConfigError(f"{path}: give instances or num_instances, not both")
    n = _get(d, "instances" if "instances" in d else "num_instances", int, path, 1)
    if n < 1:
        raise ServeConfigError(f"{path}.instances: must be >= 1, got {n}")
    tp, pp = _get(d, "tp", int, path, 1), _get(d, "pp", int, path, 1)
    if tp < 1 or pp < 1:
        raise ServeConfigError(f"{path}: tp and pp must be >= 1, got tp={tp} pp={pp}")
    lps = d.get("layers_per_stage")
    if lps is not None:
        if not isinstance(lps, list) or len(lps) != pp or not all(type(x) is int and x > 0 for x in lps):
            raise ServeConfigError(f"{path}.layers_per_stage: must be a list of {pp} positive integers (one "
                                   f"per pipeline stage), got {lps!r}")
        lps = tuple(lps)
    urls = d.get("urls", ["127.0.0.1:0"] * n)
    if not isinstance(urls, list) or len(urls) != n:
        raise ServeConfigError(f"{path}.urls: must list one 'host:port' per instance ({n}), got {urls!r}")
    devices = d.get("device")
    if isinstance(devices, list):
        if len(devices) != n:
            raise ServeConfigError(f"{path}.device: a list must give one device per instance ({n})")
        devices = [_device(v, f"{path}.device[{i}]") for i, v in enumerate(devices)]
    elif devices is not None:
        devices = [_device(devices, f"{path}.device")] * n
    ex = _executor(_map(d.get("executor", {}), f"{path}.executor"), f"{path}.executor", executor)
    tr = {**transceiver, **_map(d.get("transceiver", {}), f"{path}.transceiver")}
    _transceiver(tr, f"{path}.transceiver")
    from .vllm_workers import group_engine  # engine: vllm (its `vllm:` section lives there)

    engine, vl = group_engine(d, path, vllm, n)
    out = []
    for i, u in enumerate(urls):
        host, port = _host_port(u, f"{path}.urls[{i}]")
        exi = ex if devices is None else {**ex, "device": devices[i]}
        bind = _get(d, "bind_host", str, path, host)
        tri = tr
        if tr.get("bind_host") in ("0.0.0.0", "::") and not tr.get("advertise_host"):
            tri = {**tr, "advertise_host": host}  # reachable where the router reaches the worker
        out.append(ServerSpec(role, i, host, port, bind, tp, pp, lps, exi, tri, engine, vl))
    return tuple(out)
