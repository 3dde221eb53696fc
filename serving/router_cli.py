"""`kvbridge router --config CONFIG`: the router's process (arguments, the listening socket, uvicorn).

Parses the command line, loads the config, binds the router's port (router.port, or a free one announced in
--port-file: serving/listen.py), builds the application (router.py's `build_router`) and serves it until
stopped. Bad arguments or config: exit 2 naming what was wrong; a port that cannot be bound: exit 1.
"""

from __future__ import annotations

import argparse
import sys

from .router import build_router

__all__ = ["main"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge router",
                                 description="the OpenAI-compatible front door of a disaggregated deployment")
    ap.add_argument("--config", required=True, help="the serving config (YAML)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    ap.add_argument("--port-file", default=None,
                    help="with router.port 0 in the config: bind a free port and write it here (JSON)")
    ap.add_argument("--api-key", action="append", default=[], help="an API key /v1/* accepts (repeatable)")
    a = ap.parse_args(argv)
    import uvicorn

    from .launcher import die_with_parent

    die_with_parent()
    from ..errors import KvBridgeError
    from ..gcheap import freeze_startup_heap
    from .auth import api_keys, check_router_bind
    from .config import load_config
    from .tls import server_kwargs

    try:
        cfg = load_config(a.config).with_api_keys(tuple(a.api_key))
        check_router_bind(cfg.router.bind_host, api_keys(cfg), cfg.router.insecure)  # before its port is bound
    except KvBridgeError as e:
        print(f"kvbridge router: {e}", file=sys.stderr)
        return 2
    if cfg.router.port == 0 and not a.port_file:
        print(f"kvbridge router: router.port is 0 in {a.config}; give it a port, or --port-file to bind a "
              f"free one and write it there", file=sys.stderr)
        return 2
    from .listen import announce, bind

    try:
        sock = bind(cfg.router.bind_host, cfg.router.port)
    except KvBridgeError as e:
        print(f"kvbridge router: {e}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    announce(a.port_file, port)
    try:
        app = build_router(cfg)
    except KvBridgeError as e:
        print(f"kvbridge router: {e}", file=sys.stderr)
        sock.close()
        return 2
    url = f"{cfg.router.scheme}://{cfg.router.host}:{port}"
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.router.bind_host, port=port, log_level=a.log_level,
                                           timeout_graceful_shutdown=5,
                                           **server_kwargs(cfg.tls)))
    where = cfg.cluster and (url if cfg.cluster.router_registry else cfg.cluster.uri)
    members = (f"workers join through {where} (cluster {cfg.cluster.name})" if cfg.cluster else
               f"context {[s.url for s in cfg.context]}, generation {[s.url for s in cfg.generation]}")
    freeze_startup_heap()  # app and server built: later collections skip them (gcheap.py)
    print(f"[router] starting at {url} ({cfg.router.policy}): {members}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
