# make demo: the main job on an embedded default.   make test: the whole suite.
# Both create (or reuse) .venv, install torch==2.13.0 first (the local CPU wheel),
# then the project; `make test` adds its test extras (Mooncake, transformers,
# hypothesis...) and the Debian libraries that Mooncake's `mooncake_master` (run by the
# storage tests) needs, when they are missing. The demo needs none of those.
# --no-compile: pip does not byte-compile every installed module (torch and its
# dependencies are thousands); Python compiles, and caches, only what is imported.
# The demo and the tests cache that bytecode under .venv/pycache even where the
# environment sets PYTHONDONTWRITEBYTECODE: without a cache every Python process
# compiles torch's modules again on import (2-4 s each on a 2-vCPU machine), and the
# suite starts about fourteen (CLI, determinism, tensor-parallel ranks).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORE   := $(VENV)/.installed-core
STAMP  := $(VENV)/.installed
DEBS   := libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200
CACHED := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache

.PHONY: demo test install debs clean

$(CORE): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -e .
	touch $(CORE)

$(STAMP): $(CORE)
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	touch $(STAMP)

# Only the missing ones, so a machine that has them needs neither apt nor root.
debs:
	@command -v dpkg >/dev/null || { echo "no dpkg: install $(DEBS) or their equivalents by hand"; exit 0; }; \
	missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages for mooncake_master:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

install: $(STAMP) debs

demo: $(CORE)
	$(CACHED) $(BIN)/hicache demo

test: $(STAMP) debs
	$(CACHED) $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
