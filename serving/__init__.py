"""kvbridge.serving: disaggregated serving over HTTP — workers, an OpenAI-compatible router, a launcher.

Modules:
    config      the YAML serving config (model, context/generation servers, transceiver, router, executor)
    protocol    OpenAI request parsing, response / stream chunk / error objects, `disaggregated_params`
    api_error   ApiError, the error object every endpoint returns (protocol re-exports it)
    validate    generic checks of a client's JSON (strict, bounded depth, int64, text parts)
    text        tokenization, chat templates, incremental detokenization
    backend     a worker's Executor seen from asyncio (bounded waits, aborts when the caller goes)
    worker_app  a worker's FastAPI routes; worker: `kvbridge worker` (one executor + HTTP server)
    router      `kvbridge router`: OpenAI endpoints, context hop then generation hop, retries, deadlines
    balancer    worker pools: health, round-robin and least-loaded picks
    launcher    `kvbridge serve CONFIG`: every worker and the router as process groups, health, shutdown
    supervisor  what serve does when a child dies or hangs: restart with back-off, or stop; role_grace_s
    vllm_member `kvbridge worker` of an engine: vllm group: one vLLM server, registered in a disagg_cluster
    auth        the internal token between a deployment's processes, the router's API keys
    listen      a process binds its own port and announces it (--port-file)
    metrics     Prometheus metrics (workers in multiprocess mode so rank processes' metrics are merged)
Imports the executor and transceiver; nothing below imports this package. Importing it is cheap (the CLI
imports worker/router/launcher modules to run them; they import FastAPI and torch only in main).
"""
