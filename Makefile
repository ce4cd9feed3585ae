# The README's commands. `make demo` and `make test` each install first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DISTS := sdk cli plugins/dummy plugins/offload plugins/mooncake
EXISTING := $(wildcard $(addsuffix /pyproject.toml,$(DISTS)))
PACKAGES := $(notdir $(patsubst %/__init__.py,%,$(wildcard sdk/src/*/__init__.py cli/src/*/__init__.py plugins/*/src/*/__init__.py)))
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck pytest bench clean

install: $(STAMP)

$(STAMP): pyproject.toml $(EXISTING) scripts/install-system-deps.sh
	scripts/install-system-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pinned: the CPU build from local disk; plain `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --group dev $(foreach d,$(dir $(EXISTING)),-e $(d))
	touch $(STAMP)

demo: install
	$(PY) -m kvconn.demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy $(addprefix -p ,$(PACKAGES))

pytest: install
	$(PY) -m pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
