# make demo: the main job on an embedded default.   make test: the whole suite.
# Both create (or reuse) .venv, install torch==2.13.0 first (the local CPU wheel),
# then the project; `make test` adds its test extras (Mooncake, transformers,
# hypothesis...) and the Debian libraries that Mooncake's `mooncake_master` (run by the
# storage tests) needs, when they are missing. The demo needs none of those.
# --no-compile: pip does not byte-compile every installed module (torch and its
# dependencies are thousands); Python compiles, and caches, only what is imported.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORE   := $(VENV)/.installed-core
STAMP  := $(VENV)/.installed
DEBS   := libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200

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
	$(BIN)/hicache demo

test: $(STAMP) debs
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
