"""The TensorRT-LLM adapter: imports without TensorRT-LLM, explains itself on use, matches the hook signatures.

TensorRT-LLM cannot run here, so the last test stands its two base classes up as stubs (the only part faked)
to drive the adapter's translation over the real persistent connector on CPU memory.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types

import numpy as np
import pytest
import torch

from kvbridge.executor.connector import KvConnectorScheduler, KvConnectorWorker, trtllm

# TensorRT-LLM's hooks (tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py), parameter names in order
TRT_SCHEDULER = {
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "block_ids"],
    "build_connector_meta": ["scheduler_output"],
    "request_finished": ["request", "cache_block_ids"],
}
TRT_WORKER = {
    "register_kv_caches": ["kv_cache_tensor"],
    "start_load_kv": ["stream"],
    "wait_for_layer_load": ["layer_idx", "stream"],
    "save_kv_layer": ["layer_idx", "stream"],
    "wait_for_save": ["stream"],
    "get_finished": ["finished_gen_req_ids", "started_loading_req_ids"],
    "bind_connector_meta": ["metadata"],
}


def _params(cls, name):
    return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]


def test_the_module_imports_without_tensorrt_llm_and_refuses_use_with_the_reason():
    if trtllm.TRTLLM_IMPORT_ERROR is None:
        pytest.skip("TensorRT-LLM is importable here")
    for cls in (trtllm.KvBridgeStoreScheduler, trtllm.KvBridgeStoreWorker):
        with pytest.raises(ImportError, match="needs TensorRT-LLM .* cannot be imported here"):
            cls(types.SimpleNamespace())


@pytest.mark.parametrize("ours,adapter,trt", [
    (KvConnectorScheduler, trtllm.KvBridgeStoreScheduler, TRT_SCHEDULER),
    (KvConnectorWorker, trtllm.KvBridgeStoreWorker, TRT_WORKER),
])
def test_hook_names_and_parameters_match_tensorrt_llm_and_our_base_classes(ours, adapter, trt):
    for name, params in trt.items():
        assert _params(ours, name) == params, f"our {ours.__name__}.{name}"
        assert _params(adapter, name) == params, f"adapter {adapter.__name__}.{name}"
    ours_hooks = {n for n, f in vars(ours).items() if inspect.isfunction(f) and not n.startswith("_")}
    extra = {"close", "get_connector_meta", "get_load_errors"}  # ours only (TensorRT-LLM has no such hooks)
    assert ours_hooks - extra == set(trt)


@pytest.fixture
def stub_trtllm(monkeypatch):
    """Just TensorRT-LLM's two base classes and mpi_rank, then the adapter re-imported over them."""
    mod = types.ModuleType("tensorrt_llm._torch.pyexecutor.kv_cache_connector")

    class Sched:
        def __init__(self, llm_args):
            self._llm_args = llm_args

    class Work:
        def __init__(self, llm_args):
            self._llm_args = llm_args
            self._metadata = None

        def bind_connector_meta(self, metadata):
            self._metadata = metadata

    mod.KvCacheConnectorScheduler, mod.KvCacheConnectorWorker = Sched, Work
    utils = types.ModuleType("tensorrt_llm._utils")
    utils.mpi_rank = lambda: 0
    for name in ("tensorrt_llm", "tensorrt_llm._torch", "tensorrt_llm._torch.pyexecutor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    yield importlib.reload(trtllm)
    monkeypatch.undo()
    importlib.reload(trtllm)


def test_the_adapter_saves_and_loads_through_the_persistent_store(stub_trtllm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_KV_STORE", str(tmp_path))
    args = types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(tokens_per_block=4, dtype="auto"),
                                 tensor_parallel_size=1, pipeline_parallel_size=1, model="some/model")
    sched, work = stub_trtllm.KvBridgeStoreScheduler(args), stub_trtllm.KvBridgeStoreWorker(args)
    pool = torch.arange(8 * 2 * 64, dtype=torch.float32).reshape(8, 2, 64)  # 8 blocks, position-dependent
    work.register_kv_caches(pool)
    req = types.SimpleNamespace(request_id=1, prompt_len=13, get_tokens=lambda beam: list(range(100, 113)))

    def step(expect_saved=(), expect_loaded=()):
        meta = sched.build_connector_meta(None)
        assert meta is None or isinstance(meta, bytes)  # TensorRT-LLM broadcasts bytes, never our objects
        work.bind_connector_meta(meta)
        work.start_load_kv(None)
        for _ in range(2000):
            saved, loaded = work.get_finished(list(expect_saved), list(expect_loaded))
            if saved or loaded or not (expect_saved or expect_loaded):
                return saved, loaded
            import time

            time.sleep(0.005)
        raise AssertionError("the store did not finish")

    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.request_finished(req, [5, 2, 7, 1]) is True  # 12 computed tokens: blocks 0..2 are full
    assert step(expect_saved=[1]) == ([1], [])
    want = pool[[5, 2, 7]].clone()
    pool.zero_()
    req2 = types.SimpleNamespace(request_id=2, prompt_len=13, get_tokens=lambda beam: list(range(100, 113)))
    assert sched.get_num_new_matched_tokens(req2, 0) == (12, True)
    sched.update_state_after_alloc(req2, [3, 4, 6, 0])
    assert step(expect_loaded=[2]) == ([], [2])
    assert torch.equal(pool[[3, 4, 6]], want) and not pool[[0, 1, 2, 5, 7]].any()
    work._inner.close()
    assert np.isfinite(pool.numpy()).all()
