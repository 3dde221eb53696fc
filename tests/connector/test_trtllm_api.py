"""TensorRT-LLM-style connectors (built from llm_args) on kvbridge's executor: the persistent example connector
saves a prompt's blocks and a fresh executor loads them, decoding the same tokens; metadata crosses processes
without pickle."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from kvbridge.errors import ExecutorError, ProtocolError
from kvbridge.executor.connector.base import RequestData, SchedulerOutput
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.connector.trtllm_api import decode_meta, encode_meta, kv_connector_config
from kvbridge.executor.connector.trtllm_example import PersistentKvCacheConnectorMetadata

PROMPT = list(range(30, 67))  # 37 tokens: 4 full blocks of 8 before the last token
EXAMPLE = "kvbridge.executor.connector.trtllm_example"
MODULES = frozenset({EXAMPLE})


@dataclasses.dataclass
class Foreign:
    x: int = 1


def _pool_full(ex: Executor, timeout: float = 60) -> list[int]:
    """The rank's free blocks once back to 32 (the save ends after the request), or at the deadline."""
    deadline = time.monotonic() + timeout
    while (got := ex.free_blocks(timeout=30)) != [32] and time.monotonic() < deadline:
        time.sleep(0.2)  # a poll interval, not synchronisation: the loop waits for the state itself
    return got


def _config(root) -> ExecutorConfig:
    conn = kv_connector_config(EXAMPLE, "PersistentKvCacheConnectorLeader",
                               "PersistentKvCacheConnectorWorker", root=str(root))
    return ExecutorConfig(model="seeded:tiny3", num_blocks=32, tokens_per_block=8, kv_connector_config=conn)


@pytest.mark.slow
def test_the_persistent_example_saves_blocks_and_a_fresh_executor_loads_them(tmp_path):
    with Executor.start(_config(tmp_path)) as ex:  # the first run computes everything: the aggregated tokens
        rid = ex.submit(PROMPT, max_tokens=5, stop_ids=())
        first = ex.wait(rid, 120)
        assert first.loaded_tokens == 0
        assert _pool_full(ex) == [32]  # freed once the rank reported the save
    want = first.tokens
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 5 and all(f.endswith(".r0.safetensors") for f in files)  # 41 tokens with KV
    with Executor.start(_config(tmp_path)) as ex:
        rid = ex.submit(PROMPT, max_tokens=5, stop_ids=())
        again = ex.wait(rid, 120)
    assert again.loaded_tokens == 32 and again.tokens == want


def test_metadata_is_plain_data_or_dataclasses_of_allowed_modules():
    meta = PersistentKvCacheConnectorMetadata(load=[(1, 2, "ab")], save=[])
    wire = encode_meta({"m": meta, "b": b"\x00\x01", "t": (1, 2.5, None)})
    back = decode_meta(wire, MODULES)
    assert back["m"] == PersistentKvCacheConnectorMetadata(load=[[1, 2, "ab"]], save=[])  # tuples become lists
    assert back["b"] == b"\x00\x01" and back["t"] == [1, 2.5, None]
    with pytest.raises(ExecutorError, match="a builtins.object cannot cross processes without pickle"):
        encode_meta({"x": object()})
    with pytest.raises(ProtocolError, match="is not a dataclass of"):
        decode_meta(encode_meta(Foreign()), MODULES)  # a class outside the connector's modules is not built
    with pytest.raises(ProtocolError, match="is not a dataclass with fields"):
        decode_meta({"__kvbridge_dataclass__": f"{EXAMPLE}:block_keys", "fields": {}}, MODULES)


def test_the_adapter_gives_new_requests_their_tokens_from_the_start_as_upstream_does(tmp_path):
    from kvbridge.executor.connector.base import ConnectorContext, ConnectorRequest
    from kvbridge.executor.connector.trtllm_api import TrtllmSchedulerAdapter

    spec = kv_connector_config(EXAMPLE, "PersistentKvCacheConnectorLeader",
                               "PersistentKvCacheConnectorWorker", root=str(tmp_path))
    import torch

    sched = TrtllmSchedulerAdapter(ConnectorContext(0, 1, 4, "ns", "m", torch.device("cpu"), 8, spec.args))
    seen = []
    sched.inner.build_connector_meta = lambda out: seen.append(out)
    sched.get_num_new_matched_tokens(ConnectorRequest(5, tuple(range(10)), 10, 0), 0)
    sched.build_connector_meta(SchedulerOutput(new_requests=[RequestData(5, list(range(8, 10)), [3], 8, 2)]))
    (out,) = seen
    assert out.new_requests == [RequestData(5, list(range(10)), [3], 0, 2)]  # the loaded prefix included
