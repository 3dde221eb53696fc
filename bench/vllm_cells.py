"""`kvbridge bench vllm-cells`: what vLLM's NixlConnector and KVBridgeConnector each do in issue 28's cells.

Owns one measurement run: for each cell (TP1 -> TP1, prefill TP2 -> decode TP1, TP1 -> TP2, block 32 -> 64,
block 64 -> 32, forged ids) and each connector, it starts a fresh prefill and decode vLLM server on the tiny
random Llama (integrations/vllm/tiny_model.py), sends a few greedy prompts of 16-700 tokens through vLLM's
disaggregated protocol (serving/vllm_backend.py: prefill with max_tokens 1 and do_remote_decode, then the
decode with the answer's kv_transfer_params, not streamed, logprobs on), classifies each answer against one
aggregated vLLM server's answer to the same prompt (bench/vllm_outcome.py: exact, wrong, refused, hang,
error), and kills and reaps both servers whatever happened. Rows go to bench/results/vllm_cells.json; the
table is rendered into docs/vllm.md between its `vllm-cells` markers, so the doc shows the run.

Placement: the aggregated reference runs alone first (TP1, block 32, core 0). In every cell the prefill
server's ranks run on core 0 and the decode server's on core 1 (`VLLM_CPU_OMP_THREADS_BIND`, one core for
both ranks of a TP2 server). NixlConnector (kv_buffer_device cpu, stock NIXL) is also pinned thread by thread
once healthy, as ../shared/vllm/ found it needs on this box; KVBridgeConnector's servers are not re-pinned.
Every server runs with its prefix cache off, so each prompt's KV really moves.

Forged ids: two live requests A and B are prefilled, and A's decode gets an edited kv_transfer_params.
NixlConnector: A's `remote_block_ids` shifted by one / reversed (in range). KVBridgeConnector has no block ids
to forge, so: A's object with B's handle (A's secret), and B's whole object under A's prompt.

Deadlines: a server's start `--startup-timeout` (300 s), each hop `--deadline` (120 s; an answer normally
takes well under a second). A cell stops sending after its first hang.

    kvbridge bench vllm-cells [--cells NAME ...] [--connectors nixl kvbridge] [--lens 16 300 700]
                              [--json PATH] [--doc PATH | --no-doc]     # a partial run: no files unless named
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..integrations.vllm.launch import VllmServer, VllmServerSpec, VllmStartError, health, vllm_missing
from ..netaddr import free_port
from ..serving.vllm_backend import decode_body, prefill_body, stream_error
from .common import machine, table, write_json
from .vllm_outcome import LOGPROB_TOL, Answer, Outcome, classify, combine, log_reason

__all__ = ["CELLS", "Cell", "main", "render", "run", "update_doc"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = str(ROOT / "bench" / "results" / "vllm_cells.json")
DEFAULT_DOC = str(ROOT / "docs" / "vllm.md")
BEGIN, END = "<!-- vllm-cells: begin (kvbridge bench vllm-cells writes this table) -->", "<!-- vllm-cells: end -->"
CONNECTORS = ("nixl", "kvbridge")
TITLES = {"nixl": "NixlConnector", "kvbridge": "KVBridgeConnector"}
FORGERIES = {"nixl": ("remote_block_ids shifted by 1", "remote_block_ids reversed"),
             "kvbridge": ("another live request's handle, this secret", "another request's object, this prompt")}


@dataclass(frozen=True)
class Cell:
    name: str
    title: str
    prefill: tuple[int, int]  # (TP, block size)
    decode: tuple[int, int]
    forged: bool = False


CELLS = (Cell("tp1-tp1", "TP1 -> TP1, block 32", (1, 32), (1, 32)),
         Cell("tp2-tp1", "prefill TP2 -> decode TP1", (2, 32), (1, 32)),
         Cell("tp1-tp2", "prefill TP1 -> decode TP2", (1, 32), (2, 32)),
         Cell("b32-b64", "block 32 -> 64", (1, 32), (1, 64)),
         Cell("b64-b32", "block 64 -> 32", (1, 64), (1, 32)),
         Cell("forged", "forged ids (TP1 -> TP1, block 32)", (1, 32), (1, 32), forged=True))


def prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids of the tiny Llama's vocabulary (3..511), fixed by (n, seed)."""
    r = random.Random(seed * 1_000_003 + n)
    return [r.randrange(3, 512) for _ in range(n)]


def prompts_of(cell: Cell, lens: list[int]) -> list[tuple[str, list[int], list[int] | None, int | None]]:
    """(label, prompt, the other live request's prompt, forgery variant) of every request a cell sends."""
    if not cell.forged:
        return [(f"{n} tokens", prompt_ids(n, 1), None, None) for n in lens]
    lens = [n for n in lens if n > 64] or [300]  # at least 3 blocks: a reversed id list differs
    return [(f"{n} tokens, forgery {v}", prompt_ids(n, 10 + v), prompt_ids(n, 20 + v), v)
            for v in (0, 1) for n in lens]


def forge(connector: str, variant: int, mine: dict, other: dict) -> dict:
    """The edited kv_transfer_params sent with request A (mine: A's, other: live request B's)."""
    out = copy.deepcopy(mine)
    if connector == "kvbridge":
        if variant == 0:
            out["kvbridge"]["ctx_request_id"] = other["kvbridge"]["ctx_request_id"]
            return out
        return copy.deepcopy(other)
    ids = out.get("remote_block_ids") or []
    f = (lambda g: [i + 1 for i in g]) if variant == 0 else (lambda g: list(reversed(g)))
    out["remote_block_ids"] = [f(g) for g in ids] if ids and isinstance(ids[0], list) else f(ids)
    return out


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1, "stream": False}


def _parse(r: httpx.Response) -> tuple[list[int] | None, list[float] | None, str]:
    """(token ids, logprobs, error message) of a non-streamed completion answer."""
    try:
        data = r.json()
    except ValueError:
        return None, None, f"HTTP {r.status_code}: {r.text[:200]!r}"
    err = stream_error(data)
    if r.status_code >= 400 or err:
        return None, None, f"HTTP {r.status_code}: {err or str(data)[:200]}"
    ch = (data.get("choices") or [{}])[0]
    if ch.get("finish_reason") == "error" or not ch.get("token_ids"):
        return None, None, f"HTTP {r.status_code}: finish_reason {ch.get('finish_reason')!r}, no tokens"
    return list(ch["token_ids"]), list((ch.get("logprobs") or {}).get("token_logprobs") or []), ""


class _Logs:
    """New lines of the servers' logs since the last mark()."""

    def __init__(self, *servers: VllmServer) -> None:
        self.servers, self.at = servers, [0] * len(servers)

    def mark(self) -> None:
        self.at = [_size(s.log_path) for s in self.servers]

    def reason(self, wait_s: float = 5.0) -> str:
        """log_reason() of the newest lines, decode server first; waits (bounded) for a line to appear."""
        deadline = time.monotonic() + wait_s
        while True:
            for s, at in zip(reversed(self.servers), reversed(self.at)):
                try:
                    with open(s.log_path, "rb") as f:
                        f.seek(at)
                        why = log_reason(f.read(2_000_000).decode("utf-8", "replace"))
                except OSError:
                    why = ""
                if why:
                    return why
            if time.monotonic() > deadline:
                return ""
            time.sleep(0.25)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _digests(folder: str, side: str, handle: int, wait_s: float) -> dict[str, str]:
    deadline = time.monotonic() + wait_s
    while not (files := glob.glob(os.path.join(folder, f"{side}-{handle}-r*.json"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    out: dict[str, str] = {}
    for path in files:
        with open(path) as f:
            out.update(json.load(f)["digest"])
    return out


def kv_check(dirs: tuple[str, str], params: dict) -> tuple[bool, str]:
    """KVBridgeConnector's positional check of one request: every (layer, head, K|V, block) digest the
    prefill side wrote equals the decode side's."""
    handle = params["kvbridge"]["ctx_request_id"]
    ctx, gen = _digests(dirs[0], "ctx", handle, 10.0), _digests(dirs[1], "gen", handle, 10.0)
    if not ctx or not gen:
        return False, f"no positional digest ({len(ctx)} prefill-side, {len(gen)} decode-side keys)"
    bad = sorted(k for k in ctx.keys() | gen.keys() if ctx.get(k) != gen.get(k))
    return not bad, (f"{len(bad)} of {len(ctx)} keys differ, e.g. {bad[:3]}" if bad else f"{len(ctx)} keys equal")


def request(client: httpx.Client, P: VllmServer, D: VllmServer, logs: _Logs, prompt: list[int], a,
            other: list[int] | None = None, forgery: tuple[str, int] | None = None,
            digest_dirs: tuple[str, str] | None = None) -> tuple[Answer, dict | None]:
    """One prefill -> decode request (the other live request prefilled first when forging); what came back."""
    body, stage = _body(prompt, a.max_tokens), "prefill"
    logs.mark()
    try:
        bparams = None
        if other is not None:
            r = client.post(P.url + "/v1/completions", json=prefill_body(_body(other, a.max_tokens)),
                            timeout=a.deadline)
            bparams = r.json().get("kv_transfer_params") if r.status_code == 200 else None
            if not isinstance(bparams, dict):
                return _failed(P, D, Answer(status=r.status_code, stage="prefill", log_reason=logs.reason(),
                                            message=f"the other request: {r.text[:200]}")), None
        r = client.post(P.url + "/v1/completions", json=prefill_body(body), timeout=a.deadline)
        params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        if not isinstance(params, dict):
            return _failed(P, D, Answer(status=r.status_code, stage="prefill", message=r.text[:200],
                                        log_reason=logs.reason())), None
        sent = forge(forgery[0], forgery[1], params, bparams) if forgery else params
        stage = "decode"
        r = client.post(D.url + "/v1/completions", json=decode_body(body, sent), timeout=a.deadline)
    except httpx.TimeoutException:
        return Answer(timed_out=True, stage=stage, log_reason=logs.reason(1.0)), None
    except (httpx.HTTPError, ValueError) as e:
        dead = [s.url for s in (P, D) if not s.alive()]
        why = f"{type(e).__name__}: {e}" + (f" (server {', '.join(dead)} exited)" if dead else "")
        return Answer(failure=why, stage=stage, log_reason=logs.reason(1.0)), None
    tokens, logprobs, err = _parse(r)
    if err:
        return _failed(P, D, Answer(status=r.status_code, message=err, log_reason=logs.reason())), sent
    kv_equal, kv_detail = kv_check(digest_dirs, sent) if digest_dirs else (None, "")
    return Answer(tokens, logprobs, r.status_code, kv_equal=kv_equal, kv_detail=kv_detail), sent


def _port() -> int:
    """A free port whose neighbour is free too (NIXL's TP2 side channel uses port + 1), below the ephemeral range."""
    return free_port(span=2)


def _failed(P: VllmServer, D: VllmServer, a: Answer) -> Answer:
    """An error answer as it stands (refused), or an error when it left a server dead or unhealthy."""
    down = [role for role, s in (("prefill", P), ("decode", D)) if not (s.alive() and health(s.url, 5.0))]
    if not down:
        return a
    return dataclasses.replace(a, failure=f"the {' and '.join(down)} server died with it ({a.message[:100]})")


def _spec(model: str, connector: str | None, tp: int, block: int, cpus: str, a, digest_dir: str = ""):
    if connector == "nixl":
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    elif connector == "kvbridge":
        kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "kvbridge.integrations.vllm.connector",
              "kv_connector_extra_config": {"transceiver": {"handshake_timeout_s": 10.0, "pickup_timeout_s": 60.0,
                                                         "publish_wait_s": 10.0},
                                            "kv_digest_dir": digest_dir}}
    else:
        kv = None
    return VllmServerSpec(model, _port(), python=a.python, kv_transfer_config=kv, served_model_name="tiny",
                          block_size=block, tensor_parallel_size=tp, max_num_seqs=4,
                          cpus="|".join([cpus] * tp), pin=connector != "kvbridge",
                          side_channel_port=_port() if connector == "nixl" else None,
                          extra_args=("--no-enable-prefix-caching",))


def _start(servers: list[VllmServer], a) -> None:
    """Start the servers together (the one with more ranks first), then wait for each to be healthy: a start
    is mostly one core's imports, so two at once take the time of one on two cores.

    A port can be taken between _port()'s check and the server's bind (this range lies inside the kernel's
    ephemeral one, where any outgoing connection may take it): such a start is retried on other ports.
    """
    pending = sorted(servers, key=lambda s: -s.spec.tensor_parallel_size)
    for attempt in range(5):
        marks = [_size(s.log_path) for s in pending]
        for s in pending:
            s.start()
        retry = []
        for s, at in zip(pending, marks):
            try:
                s.wait_healthy(a.startup_timeout)
            except VllmStartError:
                with open(s.log_path, "rb") as f:
                    f.seek(at)
                    taken = b"Address already in use" in f.read()
                if attempt == 4 or not taken:
                    raise
                retry.append(s)
        for s in retry:
            s.stop()
            side = _port() if s.spec.side_channel_port is not None else None
            s.spec = dataclasses.replace(s.spec, port=_port(), side_channel_port=side)
            print(f"  a port was taken during start-up; again on {s.spec.port}", flush=True)
        pending = retry
        if not pending:
            return


def reference(model: str, cells: list[Cell], a) -> dict[str, tuple[list[int], list[float]]]:
    """The aggregated server's (tokens, logprobs) for every prompt the cells send, keyed by prompt."""
    agg = VllmServer(_spec(model, None, 1, 32, "0", a), os.path.join(a.log_dir, "aggregated.log"))
    out = {}
    try:
        _start([agg], a)
        with httpx.Client() as c:
            for cell in cells:
                for _, p, _, _ in prompts_of(cell, a.lens):
                    if str(p) not in out:
                        tokens, lps, err = _parse(c.post(agg.url + "/v1/completions", json=_body(p, a.max_tokens),
                                                         timeout=a.deadline))
                        if err:
                            raise RuntimeError(f"the aggregated server failed a {len(p)}-token prompt: {err}")
                        out[str(p)] = (tokens, lps)
    finally:
        agg.stop()
    return out


def run_cell(model: str, cell: Cell, connector: str, ref: dict, a) -> dict:
    """One row: start the cell's two servers, send its prompts, classify, stop both servers (always)."""
    tag = f"{cell.name}-{connector}"
    dirs = (os.path.join(a.log_dir, f"{tag}-digests-p"), os.path.join(a.log_dir, f"{tag}-digests-d"))
    for d in dirs:  # the connector writes its digests there and needs the folder
        os.makedirs(d, exist_ok=True)
    P = VllmServer(_spec(model, connector, *cell.prefill, "0", a, dirs[0]), os.path.join(a.log_dir, f"{tag}-p.log"))
    D = VllmServer(_spec(model, connector, *cell.decode, "1", a, dirs[1]), os.path.join(a.log_dir, f"{tag}-d.log"))
    outcomes, per_prompt, t0, started = [], [], time.monotonic(), None
    try:
        _start([P, D], a)
        started = time.monotonic()
        logs = _Logs(P, D)
        with httpx.Client() as client:
            for label, p, other, variant in prompts_of(cell, a.lens):
                forgery = (connector, variant) if variant is not None else None
                answer, _sent = request(client, P, D, logs, p, a, other, forgery,
                                       dirs if connector == "kvbridge" else None)
                o = classify(*ref[str(p)], answer)
                outcomes.append(o)
                per_prompt.append({"prompt": label, "kind": o.kind, "detail": o.detail,
                                   "max_abs_dlogprob": o.max_dlogprob})
                print(f"  {tag} {label}: {o.kind}: {o.detail}", flush=True)
                if o.kind == "hang":  # the rest would wait out the same deadline
                    break
    except VllmStartError as e:
        role, who = ("prefill", P) if str(e).startswith(f"vLLM server {P.url} ") else ("decode", D)
        why = _Logs(who).reason(0) or str(e).splitlines()[0]
        outcomes.append(Outcome("error", f"the {role} server did not start: {why}"))
    except Exception as e:  # noqa: BLE001 - any failure of the bench is this row's error, not the run's end
        outcomes.append(Outcome("error", f"{type(e).__name__}: {e}"[:300]))
    finally:
        for s in (D, P):
            s.stop()
    outcome, detail = combine(outcomes)
    if cell.forged:
        detail = " / ".join(FORGERIES[connector]) + ": " + detail
    return {"cell": cell.title, "connector": connector, "outcome": outcome, "detail": detail,
            "prompts": len(per_prompt), "seconds": round(time.monotonic() - (started or t0), 1),
            "startup_seconds": round((started or time.monotonic()) - t0, 1), "per_prompt": per_prompt}


def run(a) -> list[dict]:
    from ..integrations.vllm.tiny_model import tiny_llama

    model = str(tiny_llama())
    cells = [c for c in CELLS if c.name in a.cells]
    ref = reference(model, cells, a)
    rows = []
    for cell in cells:
        for connector in a.connectors:
            print(f"cell {cell.title}, {TITLES[connector]}", flush=True)
            rows.append(run_cell(model, cell, connector, ref, a))
            print(f"  -> {rows[-1]['outcome']}", flush=True)
    return rows


def render(rows: list[dict], note: str) -> str:
    """The markdown table (one line per cell, a column per connector) and its note."""
    def cell_text(r: dict | None) -> str:
        if r is None:
            return "(not run)"
        kind, _, why = r["outcome"].partition(": ")
        text = f"**{kind}**" + (f": {why}" if why else "") + (f" ({r['detail']})" if r["detail"] else "")
        return text.replace("|", "\\|").replace("\n", " ")

    connectors = [c for c in ("kvbridge", "nixl") if any(r["connector"] == c for r in rows)]
    lines = ["| cell | " + " | ".join(TITLES[c] for c in connectors) + " |",
             "| --- | " + " | ".join("---" for _ in connectors) + " |"]
    for title in dict.fromkeys(r["cell"] for r in rows):
        by = {r["connector"]: r for r in rows if r["cell"] == title}
        lines.append(f"| {title} | " + " | ".join(cell_text(by.get(c)) for c in connectors) + " |")
    return "\n".join(lines) + "\n\n" + note + "\n"


def update_doc(path: str, text: str) -> bool:
    """Put text between the doc's vllm-cells markers; False (and the doc untouched) if it has none."""
    doc = Path(path).read_text()
    i, j = doc.find(BEGIN), doc.find(END)
    if i < 0 or j < i:
        return False
    Path(path).write_text(doc[: i + len(BEGIN)] + "\n" + text + doc[j:])
    return True


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench vllm-cells", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=[c.name for c in CELLS], choices=[c.name for c in CELLS])
    ap.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    ap.add_argument("--lens", type=int, nargs="+", default=[16, 300, 700], help="prompt lengths (tokens)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds each hop may take (else: hang)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None, help=f"where the rows go (default, on a full sweep: {DEFAULT_JSON})")
    ap.add_argument("--doc", default=None, help="the markdown file whose vllm-cells markers get the table "
                                                f"(default, on a full sweep: {DEFAULT_DOC})")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--python", default=None, help="vLLM's interpreter (default $KVBRIDGE_VLLM_PYTHON or .venv-vllm)")
    ap.add_argument("--log-dir", default=None, help="the servers' logs (default: a temporary folder)")
    a = ap.parse_args(argv)
    from ..integrations.vllm.launch import vllm_python

    a.python = a.python or vllm_python()
    why = vllm_missing(a.python)
    if why:
        print(f"kvbridge bench vllm-cells: {why}", file=sys.stderr)
        return 2
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvbridge-bench-vllm-cells-")
    full = len(a.cells) == len(CELLS) and len(set(a.connectors)) == len(CONNECTORS)  # the run of record's files
    a.json = a.json or (DEFAULT_JSON if full else None)
    a.doc = a.doc or (DEFAULT_DOC if full else None)
    t0 = time.time()
    rows = run(a)
    print(table(rows, ["cell", "connector", "outcome", "prompts", "seconds"]))
    write_json(a.json, rows)
    note = (f"Measured by `kvbridge bench vllm-cells` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, "
            f"{machine()}, vllm-cpu 0.32.0, tiny random Llama, greedy, {a.max_tokens} tokens, prompts of "
            f"{'/'.join(map(str, a.lens))} tokens; the forged cell: its prompts over 64 tokens, two forgeries "
            f"each). Each answer is compared with one aggregated vLLM server's (TP1, block 32) answer to the "
            f"same prompt: exact = tokens equal and every logprob within {LOGPROB_TOL:g} (KVBridgeConnector: "
            f"and every block's KV equal, its positional digests); hang = no answer within {a.deadline:g} s; "
            f"refused quotes the decode (or prefill) server's log. Every server has its prefix cache off; the "
            f"prefill's ranks run on core 0, the decode's on core 1; NixlConnector's servers (stock NIXL, "
            f"kv_buffer_device cpu) are also pinned thread by thread once up, as it needs on this 2-core box; "
            f"KVBridgeConnector's are not. Rows: `bench/results/vllm_cells.json`.")
    if not a.no_doc and a.doc and not update_doc(a.doc, render(rows, note)):
        print(f"{a.doc} has no {BEGIN} ... {END} markers: the table was not written there", file=sys.stderr)
    return 0
