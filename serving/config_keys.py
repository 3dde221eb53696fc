"""Reading a serving config's YAML mapping key by key: typed values, unknown keys, addresses, devices.

Owns the small checks every section parser (config.py, router_spec.py) is built from; each error is a
ServeConfigError naming the key path (e.g. `context_servers.tp`) and what was wrong. Never knows which keys a
section has: the section parsers say.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ServeConfigError

__all__ = ["config_map", "copy_tree", "device", "get_key", "host_port", "known_keys"]


def config_map(v: Any, path: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ServeConfigError(f"{path}: expected a mapping, got {type(v).__name__}")
    return v


def known_keys(d: dict, known: set, path: str) -> None:
    bad = sorted(str(k) for k in d if k not in known)
    if bad:
        where = f"{path}." if path else ""
        raise ServeConfigError(f"{where}{bad[0]}: unknown key" + (f" (also {bad[1:]})" if bad[1:] else "") +
                               f"; known keys{' of ' + path if path else ''}: {sorted(known)}")


def get_key(d: dict, key: str, t, path: str, default: Any = None, required: bool = False) -> Any:
    where = f"{path}.{key}" if path else key
    if key not in d:
        if required:
            raise ServeConfigError(f"{where}: missing")
        return default
    v = d[key]
    if t is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    types = t if isinstance(t, tuple) else (t,)
    if (isinstance(v, bool) and bool not in types) or not isinstance(v, types) or \
            (isinstance(v, float) and not math.isfinite(v)):
        names = " or ".join("null" if x is type(None) else x.__name__ for x in types)
        raise ServeConfigError(f"{where}: expected {names}, got {v!r}")
    return v


def host_port(u: Any, path: str) -> tuple[str, int]:
    if not isinstance(u, str):
        raise ServeConfigError(f"{path}: expected 'host:port', got {u!r}")
    s = u.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ServeConfigError(f"{path}: {u!r} is not 'host:port' (port 0: pick a free one)")
    return host, int(port)


def copy_tree(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: copy_tree(v) for k, v in d.items()}
    if isinstance(d, list):
        return [copy_tree(v) for v in d]
    return d


def device(dev: Any, where: str) -> str:
    ok = isinstance(dev, str) and (dev in ("cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()))
    if not ok:
        raise ServeConfigError(f"{where}: {dev!r} is not cpu, cuda or cuda:N (rank r on GPU N + r)")
    return dev
