"""The relay's replay request against a real vLLM server: vLLM (--kv-events-config with a replay_endpoint, as
`kvbridge worker` starts it) answers serving/vllm_kv_relay.py's request with its buffered batches, and a
relayed cache rebuilt from those alone equals the one the relay built from the live feed. (The relay's gap
handling itself, with batches dropped on purpose, is in tests/serving/test_vllm_kv_relay.py.)"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import httpx
import pytest

from kvbridge import codec
from kvbridge.executor.kv_events import derive_secret
from kvbridge.integrations.vllm.launch import VllmServer, VllmServerSpec, free_port
from kvbridge.serving.vllm_kv_relay import VllmKvMirror, VllmKvRelay, fingerprint, kv_events_config

from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(600)]
BS = 32  # vLLM's CPU attention takes multiples of 32


def test_vllms_replay_answers_the_relay_and_rebuilds_the_same_cache(tiny_model, tmp_path):
    folder = tempfile.mkdtemp(prefix="kvb-t-")
    source, replay = f"ipc://{folder}/ev", f"ipc://{folder}/replay"
    settings = {"secret": derive_secret("t").hex(), "incarnation": "v-1", "host": "127.0.0.1",
                "endpoint_file": os.path.join(folder, "kv-events.json")}
    relay = VllmKvRelay(settings, source, "tiny", BS, replay)
    spec = VllmServerSpec(tiny_model, free_port(), served_model_name="tiny", cpus="0", max_model_len=1024,
                          block_size=BS, extra_args=("--kv-events-config",
                                                     json.dumps(kv_events_config(source, replay))))
    srv = VllmServer(spec, tmp_path / "vllm.log").start()
    try:
        srv.wait_healthy(300)
        for first in (10, 200):  # two prompts of 96 tokens: 6 full blocks stored
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": list(range(first, first + 96)), "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while len(relay.mirror) < 6:
            assert time.monotonic() < deadline, f"the relay mirrors {len(relay.mirror)} blocks, not 6"
            time.sleep(0.1)
        got = relay._replay(0)  # what a gap after batch 0 would ask for (the relay's thread is idle: no gap)
        assert got, "vLLM's replay socket did not answer"
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        rebuilt = VllmKvMirror(fingerprint("tiny", BS), BS)
        for _s, payload in got:
            for i, ev in enumerate(codec.unpack(payload, max_bytes=1 << 24, what="replayed batch")[1]):
                rebuilt.apply(ev, i)
        assert sorted(rebuilt.snapshot()) == sorted(relay.mirror.snapshot())
        assert relay.stats["gaps"] == relay.stats["rejected"] == 0
    finally:
        srv.stop()
        relay.close()
        shutil.rmtree(folder, ignore_errors=True)
