"""Helpers shared by the tests that run the command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


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


def lowcomm(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lowcomm ARGS`` from this interpreter; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "lowcomm", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ},
    )  # fmt: skip
