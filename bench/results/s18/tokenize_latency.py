"""What the router's one /tokenize call costs under kv_aware over vLLM: 200 texts of ~530 tokens (and as
chats) to one idle vLLM server (tiny-llama, pinned to core 0); the first 20 calls of each kind are not counted.

    .venv/bin/python bench/results/s18/tokenize_latency.py bench/results/s18/tokenize_latency.json
"""
import json
import random
import sys
import time

import httpx
from kvbridge.integrations.vllm.launch import VllmServer, VllmServerSpec, free_port
from kvbridge.integrations.vllm.tiny_model import tiny_llama

if __name__ == "__main__":
    spec = VllmServerSpec(model=str(tiny_llama()), port=free_port(), served_model_name="tiny-llama",
                          max_model_len=1024, cpus="0", api_key="k")
    s = VllmServer(spec, "/tmp/tok_lat_vllm.log").start()
    try:
        s.wait_healthy(300)
        rng = random.Random(3)
        words = ("river", "stone", "light", "paper", "north", "seven", "glass", "quiet", "amber", "field")
        texts = [" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(120))
                 for _ in range(200)]
        h = {"Authorization": "Bearer k"}
        out = {}
        with httpx.Client() as c:
            for kind in ("tokenize", "tokenize_chat"):
                ms, n = [], 0
                for i, t in enumerate(texts):
                    req = {"model": "tiny-llama", "prompt": t} if kind == "tokenize" else \
                        {"model": "tiny-llama", "messages": [{"role": "user", "content": t}]}
                    t0 = time.perf_counter()
                    r = c.post(f"http://127.0.0.1:{spec.port}/tokenize", json=req, headers=h, timeout=30)
                    dt = (time.perf_counter() - t0) * 1e3
                    r.raise_for_status()
                    n = len(r.json()["tokens"])
                    if i >= 20:
                        ms.append(dt)
                ms.sort()
                out[kind] = {"calls": len(ms), "prompt_tokens": n, "p50_ms": round(ms[len(ms) // 2], 2),
                             "p90_ms": round(ms[int(0.9 * len(ms))], 2)}
        print(json.dumps(out))
        json.dump({"rows": out, "note": "one vLLM server idle (pinned to core 0), client on this box"},
                  open(sys.argv[1], "w"), indent=1)
    finally:
        s.stop()
