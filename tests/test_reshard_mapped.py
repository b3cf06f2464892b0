"""An elastic resume maps the old ranks' checkpoint files instead of reading each into every
resumed rank's memory: the node's page cache holds one copy, shared by its ranks. Checked on a
real checkpoint of 3 workers resumed on 2."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from lowcomm.train.checkpoint import committed, read_rank_state
from lowcomm.train.reshard import read_resharded
from test_resume import tiny_config, train_threads

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")


def _mapped_files() -> set[str]:
    with contextlib.suppress(OSError):
        return {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
    return set()


def test_resharding_maps_the_old_files_and_keeps_their_values(tmp_path: Path) -> None:
    config = tiny_config("ddp", tmp_path / "run", stop_after=2, checkpoint_every=2)
    config.placement.workers = 3
    train_threads(config)
    directory = committed(tmp_path / "run")[-1]
    old_files = {str(directory / f"rank{r}.pt") for r in range(3)}
    assert not old_files & _mapped_files()

    config.placement.workers = 2
    state = read_resharded(directory, config, 0, torch.device("cpu"))
    # Replicated parameters are kept exactly, and still backed by the old files' pages.
    assert old_files & _mapped_files(), "the old rank files were read, not mapped"
    saved = read_rank_state(directory, 0)
    for key, value in saved["model"].items():
        assert torch.equal(state["model"][key], value), key
    # The files were not written through the mapping.
    again = read_rank_state(directory, 1)
    for key, value in saved["model"].items():
        assert torch.equal(again["model"][key], value), key
