"""A `trtllm-serve disaggregated -c` config, translated into kvbridge's serving config (serving/config.py).

Owns recognising such a config by its keys and mapping each of its fields onto kvbridge's, or refusing it
by name (ServeConfigError "context_servers.enable_attention_dp: ..."). Returns a plain mapping for
`serving.config.parse_config`; never validates kvbridge's own keys (parse_config does) and never starts
anything.

    hostname / port                        router.host / router.port
    model                                  model, as a kvbridge model spec (seeded:..., smollm2, gguf:FILE, or
                                           a checkpoint directory with config.json + *.safetensors)
    backend                                pytorch only (kvbridge's executor is PyTorch)
    router.type                            round_robin -> round_robin, load_balancing -> least_loaded,
                                           kv_cache_aware -> kv_aware (docs/routing.md)
    <servers>.num_instances / urls         the same
    <servers>.tensor_parallel_size         tp;  pipeline_parallel_size: pp
    kv_cache_config.max_tokens             executor.num_blocks (max_tokens / tokens_per_block)
    kv_cache_config.tokens_per_block       executor.tokens_per_block
    kv_cache_config.dtype                  executor.dtype (auto: kvbridge's default for the device)
    cache_transceiver_config               transceiver (transceiver/upstream.py)
    max_batch_size / max_num_tokens        executor.max_batch_seqs / executor.max_batch_tokens
    disagg_cluster                         disagg_cluster: cluster_uri, cluster_name, minimal_instances,
                                           heartbeat_interval_sec, inactive_interval_sec as they are (others
                                           refused by name)
    kvbridge: {...}                        kvbridge's own keys (executor.device, on_transfer_failure, ...)

Top-level engine fields apply to both server groups; a group's own fields override them (mappings such as
kv_cache_config key by key). Fields listed in
NO_EFFECT are accepted and do nothing here (the reason is in the table); anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

from ..errors import KvBridgeError, ServeConfigError
from ..transceiver.upstream import CacheTransceiverConfig

__all__ = ["NO_EFFECT", "is_trtllm_serve_config", "maybe_translate", "translate"]

_GROUPS = ("context_servers", "generation_servers")
_ENGINE = {"tensor_parallel_size", "pipeline_parallel_size", "kv_cache_config", "cache_transceiver_config",
           "max_batch_size", "max_num_tokens", "backend"}
NO_EFFECT = {
    "free_gpu_memory_fraction": "kvbridge sizes pools in tokens (kv_cache_config.max_tokens)",
    "max_seq_len": "a request's length is bounded by its pool, not a compiled engine",
    "max_input_len": "as max_seq_len",
    "disable_overlap_scheduler": "kvbridge's executor has no overlap scheduler",
    "print_iter_log": "kvbridge logs per request; /metrics has the counters",
    "enable_chunked_prefill": "kvbridge's executor schedules prefills by max_num_tokens",
    "cuda_graph_config": "kvbridge's executor runs eagerly",
    "trust_remote_code": "kvbridge loads only the model specs it knows",
    "enable_iter_perf_stats": "see /metrics",
    "perf_metrics_max_requests": "see /metrics",
    "enable_block_reuse": "prefix reuse is a KV connector's job in kvbridge",
}
_KV_CACHE = {"max_tokens", "tokens_per_block", "dtype", "free_gpu_memory_fraction", "enable_block_reuse",
             "enable_partial_reuse", "copy_on_partial_reuse", "onboard_blocks"}
_ROUTER_TYPES = {"round_robin": "round_robin", "load_balancing": "least_loaded", "kv_cache_aware": "kv_aware"}
_WHAT = ("mapped: num_instances, urls and " + ", ".join(sorted(_ENGINE)) + "; accepted without effect: "
         + ", ".join(sorted(NO_EFFECT)) + "; kvbridge's own keys go under `kvbridge:`")
_MARKERS = {"hostname", "backend", "cache_transceiver_config", "kv_cache_config", "free_gpu_memory_fraction"}


def is_trtllm_serve_config(d: Any) -> bool:
    """Whether a config mapping is in trtllm-serve's shape (its keys, not kvbridge's)."""
    if not isinstance(d, dict):
        return False
    if _MARKERS & set(d):
        return True
    groups = [d.get(g) for g in _GROUPS]
    return any(isinstance(g, dict) and ({"tensor_parallel_size", "pipeline_parallel_size"} | _ENGINE) & set(g)
               for g in groups)


def maybe_translate(d: Any) -> Any:
    """`d` translated when it is a trtllm-serve config, else `d` itself (serving/config.py's one hook)."""
    return translate(d) if is_trtllm_serve_config(d) else d


def translate(d: dict[str, Any]) -> dict[str, Any]:
    """kvbridge's serving config mapping for a trtllm-serve one (see the module docstring)."""
    top = dict(d)
    ext = top.pop("kvbridge", None) or {}
    if not isinstance(ext, dict):
        raise ServeConfigError("kvbridge: expected a mapping of kvbridge serving keys")
    out: dict[str, Any] = {k: _copy(v) for k, v in ext.items() if k not in _GROUPS}
    model = top.pop("model", None)
    if not isinstance(model, str) or not model:
        raise ServeConfigError("model: missing (a kvbridge model spec: seeded:<preset>, smollm2, gguf:FILE "
                               "or a checkpoint directory)")
    out["model"] = model
    router = dict(out.get("router") or {})
    if "hostname" in top:
        router["host"] = _str(top.pop("hostname"), "hostname")
    if "port" in top:
        router["port"] = top.pop("port")
    _router(top.pop("router", None), router)
    out["router"] = router
    if "disagg_cluster" in top:  # the same keys in kvbridge (serving/cluster_config.py validates them)
        out["disagg_cluster"] = {**_disagg_cluster(top.pop("disagg_cluster")), **(out.get("disagg_cluster") or {})}
    shared = {k: top.pop(k) for k in list(top) if k not in _GROUPS}
    for k in list(shared):
        if k in NO_EFFECT:
            shared.pop(k)
        elif k not in _ENGINE:
            raise ServeConfigError(f"{k}: not supported by kvbridge in a trtllm-serve config ({_WHAT})")
    for key in _GROUPS:
        if key not in top:
            raise ServeConfigError(f"{key}: missing (a disaggregated config names its context and generation "
                                   f"servers)")
        g = top[key]
        if not isinstance(g, dict):
            raise ServeConfigError(f"{key}: expected a mapping, got {type(g).__name__}")
        merged = {k: {**shared[k], **v} if isinstance(v, dict) and isinstance(shared.get(k), dict) else v
                  for k, v in g.items()}
        out[key] = _group(key, {**shared, **merged}, ext.get(key) or {})
    return out


_CLUSTER = {"cluster_uri", "cluster_name", "minimal_instances", "heartbeat_interval_sec", "inactive_interval_sec"}


def _disagg_cluster(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ServeConfigError("disagg_cluster: expected a mapping")
    bad = sorted(str(k) for k in v if k not in _CLUSTER)
    if bad:
        raise ServeConfigError(f"disagg_cluster.{bad[0]}: not supported by kvbridge (it maps "
                               f"{sorted(_CLUSTER)}; drain_timeout_sec goes under kvbridge.disagg_cluster)")
    return _copy(v)


def _router(r: Any, into: dict) -> None:
    if r is None:
        return
    if not isinstance(r, dict):
        raise ServeConfigError("router: expected a mapping")
    for k, v in r.items():
        if k != "type":
            raise ServeConfigError(f"router.{k}: unknown key (kvbridge maps router.type only)")
        if v not in _ROUTER_TYPES:
            raise ServeConfigError(f"router.type: {v!r} is not supported; kvbridge has "
                                   f"{sorted(_ROUTER_TYPES)}")
        into["policy"] = _ROUTER_TYPES[v]


def _group(path: str, g: dict, ext: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    executor: dict[str, Any] = {}
    for k, v in g.items():
        where = f"{path}.{k}"
        if k in ("num_instances", "urls"):
            out[k] = v
        elif k == "tensor_parallel_size":
            out["tp"] = v
        elif k == "pipeline_parallel_size":
            out["pp"] = v
        elif k == "backend":
            if v not in (None, "pytorch"):
                raise ServeConfigError(f"{where}: {v!r} is not supported; kvbridge's executor is the pytorch "
                                       f"backend")
        elif k == "max_batch_size":
            executor["max_batch_seqs"] = v
        elif k == "max_num_tokens":
            executor["max_batch_tokens"] = v
        elif k == "kv_cache_config":
            executor.update(_kv_cache(v, where))
        elif k == "cache_transceiver_config":
            out["transceiver"] = _transceiver(v, where)
        elif k not in NO_EFFECT:
            raise ServeConfigError(f"{where}: not supported by kvbridge ({_WHAT})")
    if executor:
        out["executor"] = executor
    for k, v in ext.items():  # kvbridge's own group keys (device, bind_host, ...) win
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _kv_cache(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ServeConfigError(f"{where}: expected a mapping")
    bad = sorted(set(v) - _KV_CACHE)
    if bad:
        raise ServeConfigError(f"{where}.{bad[0]}: unknown key (kvbridge maps {sorted(_KV_CACHE)})")
    out: dict[str, Any] = {}
    tpb = v.get("tokens_per_block", 16)
    if "tokens_per_block" in v:
        out["tokens_per_block"] = tpb
    if v.get("max_tokens") is not None:
        if type(v["max_tokens"]) is not int or type(tpb) is not int or v["max_tokens"] < 1 or tpb < 1:
            raise ServeConfigError(f"{where}.max_tokens: expected a positive integer, got "
                                   f"{v['max_tokens']!r}")
        out["num_blocks"] = -(-v["max_tokens"] // tpb)
    if v.get("dtype", "auto") != "auto":
        out["dtype"] = v["dtype"]
    return out


def _transceiver(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ServeConfigError(f"{where}: expected a mapping")
    try:
        return CacheTransceiverConfig.from_dict(v).settings()
    except KvBridgeError as e:
        raise ServeConfigError(f"{where}: {e}") from None


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise ServeConfigError(f"{where}: expected a host name, got {v!r}")
    return v


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    return list(v) if isinstance(v, list) else v
