"""Shared fixtures: a private data cache and a tiny model for fast tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests never share the user's cache, and never train the tokenizer twice per session.
_CACHE = Path(os.environ.get("LOWCOMM_TEST_CACHE", "/tmp/lowcomm-test-cache"))
os.environ["LOWCOMM_CACHE_DIR"] = str(_CACHE)
torch.set_num_threads(1)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


#: The slowest test files, slowest first (each takes one to four minutes of a 4-process
#: `make test` on a 2-core machine). pytest-xdist hands whole files to its processes in
#: collection order; starting the longest ones first keeps one of them from running alone at
#: the end (about a minute of a 12-minute suite).
SLOWEST_FIRST = (
    "test_sharding.py", "test_model_export.py", "test_resume.py", "test_cli.py",
    "test_inprocess.py", "test_regression.py", "test_elastic.py", "test_hygiene_data.py",
    "test_hf_models.py", "test_compare.py", "test_init_from.py", "test_selftest.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect the slowest files first (:data:`SLOWEST_FIRST`), the rest in their order."""
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
