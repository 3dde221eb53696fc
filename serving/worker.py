"""`kvbridge worker --config CONFIG --role context|generation [--index i]`: one worker process.

Starts the Executor of one server of the config (its rank processes spawn, rank 0 leads, every rank runs
the transceiver as its rank hook), waits until the context ranks published their control endpoints, then
serves HTTP (worker_app.py) on the server's bind_host:port until SIGINT/SIGTERM or until its executor fails
(then it exits 1, so `kvbridge serve` notices). `kvbridge serve` starts these; on other hosts start them by
hand with the same config. A server of an `engine: vllm` group is a vLLM server instead, run (and, with
`disagg_cluster`, registered) by vllm_member.py.

Owns the order of start-up and shut-down: metrics in multiprocess mode before anything imports
prometheus_client, the executor closed (its ranks reaped) after the HTTP server stopped, temporary folders
removed, also on SIGTERM/SIGINT (uvicorn re-raises the signal it caught once it stopped serving; our handler
turns it into an exception that unwinds through every `finally`, and the worker exits 0). Refuses to listen
on a non-loopback address without the deployment's internal token unless the config says `insecure: true`.
This module imports nothing heavy at import time (the `kvbridge` CLI imports it to run it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid

__all__ = ["main"]


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived: unwind (every cleanup runs) and exit 0."""


def _on_stop_signal(_sig, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the cleanup short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stopped


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the serving config (YAML)")
    ap.add_argument("--role", required=True, choices=("context", "generation"))
    ap.add_argument("--index", type=int, default=0, help="which server of its role (default 0)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    ap.add_argument("--port-file", default=None,
                    help="with port 0 in the config: bind a free port and write it here (JSON)")
    ap.add_argument("--name", default=None,
                    help="with disagg_cluster: this worker's id in the cluster (default ctx<index> / gen<index>)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from .launcher import die_with_parent
    from .metrics import remove_dir, use_multiprocess_dir

    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    prom_dir = None
    try:
        die_with_parent()
        prom_dir = use_multiprocess_dir()  # before prometheus_client is imported, so the ranks inherit it
        return _run(a)
    except _Stopped:
        return 0
    finally:
        remove_dir(prom_dir)


def _run(a) -> int:
    from ..errors import KvBridgeError
    from .auth import check_worker_bind, internal_token
    from .config import load_config

    try:
        cfg = load_config(a.config)
        spec = cfg.server(a.role, a.index)
        if a.name:
            spec = dataclasses.replace(spec, worker_id=_worker_id(a.name))
        check_worker_bind(f"kvbridge worker {spec.name}", spec.bind_host, internal_token(cfg), cfg.insecure)
        if cfg.cluster is not None and not internal_token(cfg):
            from ..errors import ServeConfigError

            raise ServeConfigError(f"disagg_cluster: {spec.name} needs the deployment's internal token "
                                   f"(KVBRIDGE_INTERNAL_TOKEN or internal_token): registrations are signed with a "
                                   f"key derived from it")
    except KvBridgeError as e:
        print(f"kvbridge worker: {e}", file=sys.stderr)
        return 2
    if spec.engine == "vllm":  # a vLLM server, and its cluster membership (vllm_member.py)
        from .vllm_member import run_member

        return run_member(cfg, spec, a.port_file, internal_token(cfg))
    if spec.port == 0 and not a.port_file and cfg.cluster is None:  # a cluster member registers its port
        print(f"kvbridge worker: {spec.name} has port 0 in {a.config}; give it a port, or --port-file to "
              f"bind a free one and write it there", file=sys.stderr)
        return 2
    from .listen import announce, bind

    try:
        sock = bind(spec.bind_host, spec.port)
    except KvBridgeError as e:
        print(f"kvbridge worker {spec.name}: {e}", file=sys.stderr)
        return 1
    spec = dataclasses.replace(spec, port=sock.getsockname()[1])
    announce(a.port_file, spec.port)
    run_dir = tempfile.mkdtemp(prefix=f"kvbridge-{spec.name}-")
    try:
        return _serve(cfg, spec, run_dir, a.log_level, sock)
    except KvBridgeError as e:  # the first line says why (a rank's traceback follows in the message)
        print(f"kvbridge worker {spec.name}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _worker_id(name: str) -> str:
    from ..errors import ServeConfigError

    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
        raise ServeConfigError(f"--name {name!r}: use 1-64 letters, digits, '-', '_' or '.'")
    return name


def _serve(cfg, spec, run_dir: str, log_level: str, sock) -> int:
    import uvicorn

    from ..executor.runtime import Executor
    from ..executor.transceiver_hook import context_endpoints
    from ..gcheap import freeze_startup_heap
    from .backend import Backend
    from .kv_worker import advertised, kv_events_settings
    from .text import TextCodec
    from .tls import server_kwargs
    from .worker_app import WorkerState, build_app

    instance = f"{spec.name}-{uuid.uuid4().hex[:12]}"  # changes whenever the worker restarts
    t0 = time.monotonic()
    codec = TextCodec(cfg.model)
    kv_events = kv_events_settings(cfg, spec, instance, run_dir)  # policy kv_aware: publish KV events
    ex = Executor.start(dataclasses.replace(spec.executor_config(cfg.model, instance, run_dir), kv_events=kv_events))
    be = None
    try:
        world = spec.tp * spec.pp
        eps = context_endpoints(run_dir, world, timeout=ex.cfg.timeout_s) if spec.role == "context" else ()
        be = Backend(ex)
        st = WorkerState(cfg, spec, be, codec, instance, eps)
        st.kv_events = advertised(kv_events, spec.host, ex.cfg.timeout_s) if kv_events else None
        server = None
        app = build_app(st, on_fatal=lambda: setattr(server, "should_exit", True))
        ucfg = uvicorn.Config(app, host=spec.bind_host, port=spec.port, log_level=log_level,
                              timeout_graceful_shutdown=5, lifespan="on",
                              **server_kwargs(cfg.tls))  # HTTPS with tls (tls.py)
        if cfg.cluster is None:
            server = uvicorn.Server(ucfg)
        else:  # registers once it serves, heartbeats, drains on SIGTERM (worker_cluster.py)
            from .worker_cluster import ClusterServer, registrar_for

            server = ClusterServer(ucfg, registrar_for(cfg, spec, st, spec.name), st, cfg.cluster.drain_s)

        freeze_startup_heap()  # executor, app and server built: later collections skip them (gcheap.py)
        print(f"[{spec.name}] {spec.role} worker ready at {spec.url}: {cfg.model} TP{spec.tp}xPP{spec.pp} "
              f"on {ex.cfg.device}, pid {os.getpid()}, started in {time.monotonic() - t0:.1f}s"
              + (f"; transceiver {', '.join(eps)}" if eps else ""), flush=True)
        server.run(sockets=[sock])
        if getattr(server, "fatal", None):
            print(f"[{spec.name}] stopped: {server.fatal}", file=sys.stderr, flush=True)
            return 2
        if st.failed:
            print(f"[{spec.name}] stopped: its executor failed: {st.failed.splitlines()[0]}", file=sys.stderr,
                  flush=True)
            return 1
        if not server.started:
            print(f"[{spec.name}] could not serve on {spec.bind_host}:{spec.port}", file=sys.stderr,
                  flush=True)
            return 1
        return 0
    finally:
        if be is not None:
            be.close()
        ex.close()
