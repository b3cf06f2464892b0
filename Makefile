# lowcomm: `make demo` compares DDP with DiLoCo over a WAN link (lowcomm demo), `make test` runs
# lint, types and tests.
# Both create .venv if missing and install what they need into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# PyTorch, installed before lowcomm. TORCH_SPEC pins the version; it comes from pip's index
# (PyPI unless pip is configured otherwise), where on Linux x86-64 `torch` is the CUDA build:
# the torch wheel plus NVIDIA's CUDA libraries (nvidia-* packages), several GB. lowcomm on CPU
# needs none of that: TORCH_INDEX_URL installs torch from another index, e.g. the CPU build:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
# pytest processes (pytest-xdist; whole test files per process, so a file's module fixtures are
# built once). The tests are mostly multi-process runs that wait on each other: with 2 processes
# on 2 cores the suite kept about one core busy on average (2026-11-26: 15 min of CPU in 13.7
# min), so 3 processes; with 4 (2026-11-28, a fresh clone's .ci/run) pytest took 9m53s and about
# 1.6 cores, against 10m30s with 3. 0: no xdist, one process.
PYTEST_JOBS ?= 4
PYTEST := $(BIN)/python -m pytest -q --durations=25 $(if $(filter-out 0,$(PYTEST_JOBS)),-n $(PYTEST_JOBS) --dist loadfile)

.PHONY: demo test test-fast test-benchmarks test-long test-regression regen-regression lint typecheck pytest install install-dev bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH_SPEC)"
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
	$(BIN)/lowcomm demo

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

pytest: $(VENV)/.installed-dev
	$(PYTEST) -m "not benchmark and not long"

test: lint typecheck pytest

# The edit loop: unit, equation, small multi-process and regression tests (tests marked
# `slow`, the CLI end-to-end runs and large multi-process runs, are left to `make test`).
test-fast: $(VENV)/.installed-dev
	$(PYTEST) -m "not slow and not benchmark and not long"

# Tests that assert a speed or timing claim on this machine (a real shaped link, say): left out
# of make test, whose time budget they would spend on what `lowcomm bench` measures anyway.
test-benchmarks: $(VENV)/.installed-dev
	$(PYTEST) -m benchmark

# The other variants of slow multi-process tests (a second dtype, method or clock of a kill
# and restart already run in one variant by make test), left out of make test's time budget.
test-long: $(VENV)/.installed-dev
	$(PYTEST) -m long

# Every method's pinned trajectory (tests/regression/*.json) against a fresh run.
test-regression: $(VENV)/.installed-dev
	$(PYTEST) -m regression

# Rewrite tests/regression/*.json from a fresh run; commit them saying why the numbers moved.
regen-regression: $(VENV)/.installed-dev
	LOWCOMM_REGEN=1 $(BIN)/python -m pytest -q tests/test_regression.py tests/test_regression_precision.py

bench: $(VENV)/.installed
	$(BIN)/lowcomm bench overhead

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
