# lowcomm: `make demo` trains on the bundled corpus, `make test` runs lint, types and tests.
# Both create .venv if missing and install what they need into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch (a bare `torch` from PyPI pulls a multi-GB CUDA build on Linux).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint typecheck pytest install install-dev bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/lowcomm train

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests examples benchmarks

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

pytest: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

bench: $(VENV)/.installed
	$(BIN)/lowcomm bench overhead

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
