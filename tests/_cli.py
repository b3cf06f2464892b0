"""Helpers shared by the tests that run the command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def small_flags(*, n_layer: int = 1) -> list[str]:
    """`lowcomm train` flags for a run that finishes in seconds: 2 workers, a 1-layer (or
    ``n_layer``) GPT 64 wide, 32-token blocks, micro-batches of 4, a 2-batch validation every
    2 steps, no progress bar."""
    return [
        "--workers", "2", "--model.n-layer", str(n_layer), "--model.n-embd", "64",
        "--model.n-head", "2", "--model.block-size", "32", "--micro-batch-size", "4",
        "--eval-batches", "2", "--eval-every", "2", "--progress", "False",
    ]  # fmt: skip


SMALL = small_flags()

#: Smaller still, for runs that only need to exist (checkpoints, refusals, signals): a 1-layer GPT
#: 32 wide, 16-token blocks, micro-batches of 2, validation only at the end, and a declared 0.01 s
#: per micro-batch on the virtual clock.
TINY = (
    "--workers", "2", "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-every", "100",
    "--eval-batches", "2", "--progress", "False", "--seconds-per-microbatch", "0.01",
)  # fmt: skip


def lowcomm(
    *args: str, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lowcomm ARGS`` from this interpreter (in ``cwd``); output captured as
    text."""
    return subprocess.run(
        [sys.executable, "-m", "lowcomm", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ}, cwd=cwd,
    )  # fmt: skip
