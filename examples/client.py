"""An OpenAI-style client of a kvbridge deployment (httpx): one completion, streamed or not.

    python examples/client.py "What is the capital of France?"            # chat, whole answer
    python examples/client.py --stream "Write a haiku about the sea."     # chat, printed as it arrives
    python examples/client.py --completion --max-tokens 16 "Once upon a time"
    python examples/client.py --url http://router-host:8000/v1 ...
    python examples/client.py --url https://router-host:8000/v1 --cacert ca.crt ...   # a router with tls:

Prints the answer, then what kvbridge adds to each response (the `kvbridge` field): which workers served it
and the KV transfer's bytes, fragments and milliseconds. Errors arrive as OpenAI error objects and are
printed with their type and code; the exit status is 1 then.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys

import httpx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1",
                    help="the router's OpenAI base URL (default http://127.0.0.1:8000/v1)")
    ap.add_argument("--stream", action="store_true", help="stream the answer (server-sent events)")
    ap.add_argument("--completion", action="store_true", help="/v1/completions instead of chat")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer (default 300)")
    ap.add_argument("--cacert", default=None,
                    help="the CA bundle an https:// router's certificate must chain to (the deployment's tls.ca)")
    a = ap.parse_args(argv)
    if a.completion:
        path, body = "/completions", {"prompt": a.prompt}
    else:
        path, body = "/chat/completions", {"messages": [{"role": "user", "content": a.prompt}]}
    body.update(max_tokens=a.max_tokens, temperature=a.temperature, stream=a.stream)
    verify = ssl.create_default_context(cafile=a.cacert) if a.cacert else True
    with httpx.Client(base_url=a.url, timeout=a.timeout, verify=verify) as client:
        try:
            return _stream(client, path, body) if a.stream else _whole(client, path, body)
        except httpx.HTTPError as e:
            print(f"\nclient: {type(e).__name__}: {e}", file=sys.stderr)
            return 1


def _whole(client: httpx.Client, path: str, body: dict) -> int:
    r = client.post(path, json=body)
    out = r.json()
    if r.status_code != 200:
        return _error(out, r.status_code)
    choice = out["choices"][0]
    print(choice["message"]["content"] if "message" in choice else choice["text"])
    _stats(out.get("kvbridge", {}), choice["finish_reason"], out.get("usage"))
    return 0


def _stream(client: httpx.Client, path: str, body: dict) -> int:
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return _error(json.loads(r.read()), r.status_code)
        last = None
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                print()
                return _error(ev, 200)
            if ev.get("choices"):
                c = ev["choices"][0]
                print(c["delta"].get("content", "") if "delta" in c else c["text"], end="", flush=True)
                last = ev
        print()
    if last is None:
        print("client: the stream ended without an answer", file=sys.stderr)
        return 1
    _stats(last.get("kvbridge", {}), last["choices"][0]["finish_reason"], None)
    return 0


def _stats(kb: dict, finish: str, usage: dict | None) -> None:
    t = kb.get("transfer") or {}
    line = f"[{kb.get('context_worker', '?')} -> {kb.get('generation_worker', '?')}, finish: {finish}"
    if t:
        line += f"; KV: {t['bytes']:,} bytes in {t['fragments']} fragments over {'+'.join(t['agents'])}, " \
                f"{t['ms']['total']:.1f} ms"
    if kb.get("recomputed"):
        line += f"; transfer failed ({kb.get('transfer_error')}), prompt recomputed"
    if usage:
        line += f"; {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens"
    print(line + "]", file=sys.stderr)


def _error(body: dict, status: int) -> int:
    err = body.get("error", {}) if isinstance(body, dict) else {}
    print(f"error (HTTP {status}, {err.get('type')}/{err.get('code')}): {err.get('message', body)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
