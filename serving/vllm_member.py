"""`kvbridge worker` when its group's engine is vllm: one vLLM OpenAI server, and (with `disagg_cluster`) its
membership in the running deployment.

    kvbridge worker --config deploy.yaml --role context --name p-a      # any host, any time

Starts the vLLM server of its ServerSpec (serving/vllm_workers.py: the same command line, KV connector and
CPU binding `kvbridge serve` gives it), then, with `disagg_cluster`, registers it — the record's URL is the
vLLM server's own, so the router sends its hops straight there — once its /health answers 200, heartbeats,
and re-registers after an outage (registration.py, as a kvbridge worker does). The router learns a
KVBridgeConnector engine from its answers, so the record carries no endpoints or layout.
On SIGTERM or SIGINT it leaves first (the router stops picking it), then drains: waits until vLLM reports
no request running or waiting and no KV block in use (`vllm:num_requests_running` / `_waiting`,
`vllm:kv_cache_usage_perc` on its /metrics: a prefill's blocks stay in use until its decode has pulled them)
for QUIET_S, at most drain_timeout_sec, then stops the server (SIGTERM, then SIGKILL to its process group) and
exits 0 (the drain: worker_cluster.wait_quiet, as a kvbridge worker's). A vLLM server that dies is
unregistered at once and the member exits 1 (`kvbridge serve` restarts it).
Under `router.policy: kv_aware` it also relays the server's KV events (vllm_kv_relay.py): vLLM publishes them
on an ipc socket in a private folder, the relay republishes them signed, and the record says where
(`kv_events`), so the router follows this server's prefix cache as it follows a kvbridge worker's.
Without `disagg_cluster` it only runs the server. Never sends a request of its own but /health and /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from typing import Any, NamedTuple

import httpx

logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /health or /metrics call

__all__ = ["run_member", "guarded"]

_TICK_S = 0.25
_BUSY = re.compile(r"^vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc)(?:\{[^}]*\})? (\S+)$",
                   re.MULTILINE)


def run_member(cfg, spec, port_file: str | None, token: str | None) -> int:
    """Run the vLLM server of `spec` (and its cluster membership) until a stop signal or its death."""
    from ..integrations.vllm.launch import VllmServer, free_port
    from .listen import announce, bind
    from .vllm_workers import server_spec

    guard_sock, inner = None, spec
    if guarded(cfg, spec):  # reached from other hosts: the guard listens there, vLLM on loopback behind it
        if not token:
            print(f"[{spec.name}] a vLLM server reached from other hosts needs the deployment's internal "
                  f"token (KVBRIDGE_INTERNAL_TOKEN): its guard lets in only calls that carry it", flush=True)
            return 2
        guard_sock = bind(spec.bind_host or spec.host, spec.port)
        spec = dataclasses.replace(spec, port=guard_sock.getsockname()[1])
        loop = "127.0.0.1"
        inner = dataclasses.replace(spec, host=loop, bind_host=loop, port=free_port(loop), scheme="http")
    elif spec.port == 0:  # vLLM binds the number it is given: pick one now
        spec = inner = dataclasses.replace(spec, port=free_port(spec.bind_host or "127.0.0.1"))
    announce(port_file, spec.port)
    log_path = os.path.join(tempfile.gettempdir(), f"vllm-{spec.name}-{inner.port}.log")
    instance = f"{spec.name}-{uuid.uuid4().hex[:12]}"
    vspec, relay = server_spec(cfg, inner, token), None
    if cfg.cluster is not None and cfg.router.policy == "kv_aware":
        vspec, relay = _relay(cfg, spec, vspec, instance)
    server = VllmServer(vspec, log_path)
    print(f"[{spec.name}] starting a {spec.role} vLLM server at {inner.url}"
          + (f", behind a guard at {spec.url} that checks the deployment's token" if guard_sock else "")
          + f" (its output: {log_path})", flush=True)
    try:
        server.start()
        return asyncio.run(_member(cfg, spec, server, instance, relay, inner.url, guard_sock, token))
    finally:
        if guard_sock is not None:
            guard_sock.close()
        server.stop()
        if relay is not None:
            relay.relay.close()
            shutil.rmtree(relay.folder, ignore_errors=True)
            st = relay.relay.stats
            print(f"[{spec.name}] its KV events relayed: {st['batches']} batches ({st['replayed']} replayed "
                  f"after a gap), {st['gaps']} gaps that started over, {st['rejected']} refused, "
                  f"{relay.relay.mirror.skipped} blocks not indexed", flush=True)


class _Relay(NamedTuple):
    relay: Any      # vllm_kv_relay.VllmKvRelay
    folder: str     # its private folder (vLLM's ipc socket, the endpoint file)
    info: dict      # what the record advertises: {pub, replay, incarnation[, curve_server_key]}


def _relay(cfg, spec, vspec, instance: str):
    """The KV-event relay of a server (started before it, so no batch is missed): (its VllmServerSpec with
    --kv-events-config and an explicit --block-size, a _Relay)."""
    from ..integrations.vllm.launch import socket_folder
    from .kv_worker import advertised, kv_events_settings
    from .vllm_kv_relay import DEFAULT_BLOCK_SIZE, VllmKvRelay, kv_events_config

    folder = socket_folder("kvb-ev-", 80)  # 0700: only this user reaches vLLM's unauthenticated PUB
    source, replay = f"ipc://{folder}/vllm-kv-events", f"ipc://{folder}/vllm-kv-replay"
    block_size = vspec.block_size or DEFAULT_BLOCK_SIZE
    settings = kv_events_settings(cfg, spec, instance, folder)
    try:
        relay = VllmKvRelay(settings, source, cfg.model_name, block_size, replay)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    info = advertised(settings, spec.host, 10.0)
    vspec = dataclasses.replace(vspec, block_size=block_size, extra_args=(
        *vspec.extra_args, "--kv-events-config", json.dumps(kv_events_config(source, replay))))
    return vspec, _Relay(relay, folder, info)


def guarded(cfg, spec) -> bool:
    """Whether the member's server is reached through a guard (vllm_guard.py): in a disagg_cluster, at a
    non-loopback address, or anywhere with `tls` (the guard serves HTTPS; vLLM stays plain on loopback behind
    it). `insecure: true` does not take the guard away: it accepts plain HTTP across hosts (no TLS), not a
    vLLM that answers strangers (a member always has the token)."""
    from ..netaddr import is_loopback

    return cfg.cluster is not None and (cfg.tls is not None or not is_loopback(spec.bind_host or spec.host))


async def _guard(sock, upstream: str, token: str, tls=None):
    """The guard's uvicorn serving on `sock` in this loop (HTTPS with `tls`): (server, its task)."""
    from .vllm_guard import guard_server

    guard = guard_server(upstream, token, tls)
    return guard, asyncio.create_task(guard.serve(sockets=[sock]))


async def _member(cfg, spec, server, instance: str, relay: _Relay | None, inner_url: str, guard_sock=None,
                  token: str | None = None) -> int:
    """`inner_url`: the vLLM server itself (for this process's own /health and /metrics calls); spec.url is
    where the router reaches it (the guard's address, with `guard_sock`)."""
    from ..integrations.vllm.launch import health
    from .worker_cluster import wait_quiet

    guard, guard_task = (await _guard(guard_sock, inner_url, token, cfg.tls) if guard_sock is not None
                         else (None, None))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registrar = (_registrar(cfg, spec, instance, relay.info if relay else None) if cfg.cluster is not None
                 else None)
    task = asyncio.create_task(registrar.run()) if registrar is not None else None
    ready = False
    try:
        while not stop.is_set():
            if not server.alive():
                print(f"[{spec.name}] its vLLM server exited (code {server.proc.returncode}){server.tail(5)}",
                      flush=True)
                return 1
            if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                print(f"[{spec.name}] stopped: {task.exception()}", flush=True)
                return 2
            # registered: its /health answered 200 first (registration.py waits for it)
            if not ready and (registrar.registrations if registrar is not None else
                              await asyncio.to_thread(health, inner_url, 1.0)):
                ready = True
                await asyncio.to_thread(_pin, server)
                print(f"[{spec.name}] {spec.role} vLLM server ready at {spec.url}"
                      + (" (registered)" if registrar is not None else ""), flush=True)
            try:
                await asyncio.wait_for(stop.wait(), _TICK_S)
            except asyncio.TimeoutError:
                pass
        if registrar is None:
            print(f"[{spec.name}] stopping its vLLM server", flush=True)
            return 0
        await registrar.leave()
        if not registrar.registrations:  # stopped before it ever served: nothing to drain
            return 0
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as http:
            left = await wait_quiet(lambda: _busy(http, inner_url), t0, cfg.cluster.drain_s)
        print(f"[{spec.name}] drained in {time.monotonic() - t0:.1f}s" + (
            ", requests or KV still held at the bound" if left else "") + "; stopping its vLLM server", flush=True)
        return 0
    finally:
        if registrar is not None and not registrar.left:
            await registrar.leave()  # a dead or fatal server: out of the membership at once
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if registrar is not None:
            await registrar.store.close()
        if guard is not None:  # after the drain: answers in flight went through it
            guard.should_exit = True
            await asyncio.gather(guard_task, return_exceptions=True)


def _registrar(cfg, spec, instance: str, kv_events: dict | None):
    """The vLLM server's registration: its URL, role and parallelism, and where its KV events are relayed
    (under kv_aware); no endpoints, capacity or layout."""
    from .registry.records import WorkerRecord
    from .worker_cluster import cluster_registrar

    return cluster_registrar(cfg, WorkerRecord(cfg.cluster.name, spec.name, spec.role, spec.url, cfg.model_name,
                                               instance, time.time_ns(), tp=spec.tp, pp=spec.pp,
                                               kv_events=kv_events))


def _pin(server) -> None:
    """Pin every thread of the server to its cores, as `kvbridge serve` does (vllm.cpus, vllm.pin)."""
    from ..integrations.vllm.launch import parse_cpus, pin_group

    if server.spec.pin and server.spec.cpus is not None:
        pin_group(server.pgid, parse_cpus(server.spec.cpus))


async def _busy(http: httpx.AsyncClient, url: str) -> float:
    """Requests vLLM reports running or waiting now plus the share of its KV blocks in use (0: idle, nothing
    held for a decode's pull); inf when its /metrics cannot be read (busy, until the drain's bound)."""
    try:
        r = await http.get(url + "/metrics")
    except httpx.HTTPError:
        return math.inf
    found = _BUSY.findall(r.text) if r.status_code == 200 else []
    return sum(float(x) for x in found) if found else math.inf
