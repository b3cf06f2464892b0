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
