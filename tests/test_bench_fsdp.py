"""``lowcomm bench fsdp``'s pieces: the shapes it tries, the command of an attempt, the memory
cap that stops an attempt past its budget, and the tables (the bench itself runs for minutes:
it was checked end to end at small sizes, see docs/results/fsdp.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowcomm.bench.fsdp import (
    Attempt,
    FsdpBench,
    MemoryCap,
    attempt_command,
    attempts_table,
    largest_table,
    model_flags,
    shape_of,
)


def test_shapes_are_llama_shaped_and_bad_ones_are_refused() -> None:
    assert shape_of("8x1024") == (8, 1024)
    flags = model_flags("8x1024", 64)
    assert flags[flags.index("--model.n-head") + 1] == "16"  # heads of 64 dimensions
    assert flags[flags.index("--model.n-kv-head") + 1] == "4"  # a quarter: grouped queries
    for bad in ("8", "8x1000", "0x512", "ax512"):
        with pytest.raises(ValueError, match="--ladder/--speed-shape"):
            shape_of(bad)


def test_an_attempt_is_the_real_command_on_2_workers_of_2_ranks(tmp_path: Path) -> None:
    attempt = Attempt("diloco", "fsdp", "bf16-mixed", "2x256", status="?")
    command = attempt_command(FsdpBench(), attempt, tmp_path)
    assert command[1:4] == ["-m", "lowcomm", "train"]
    line = " ".join(command)
    for part in ("--workers 2", "--ranks-per-worker 2", "--worker-sharding fsdp",
                 "--precision bf16-mixed", "--steps 3", "--network none", "--clock real",
                 "--diloco.sync-every 2", "--model.family hf-llama"):  # fmt: skip
        assert part in line, part


def test_an_attempt_past_its_budget_is_stopped() -> None:
    """A process tree (a parent and a child holding 400 MB) under a 250 MB cap: killed."""
    hog = "import time; b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(60)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {hog!r}])"
    process = subprocess.Popen([sys.executable, "-c", parent])
    begin = time.perf_counter()
    with MemoryCap(process.pid, 250e6, period_s=0.05) as cap:
        process.wait(timeout=30)
    assert cap.stopped == "over budget" and cap.peak_bytes > 250e6
    assert time.perf_counter() - begin < 20  # (not the child's 60 s)


def test_the_tables_say_what_fitted_and_what_stopped() -> None:
    fitted = Attempt("ddp", "fsdp", "fp32", "2x256", "ok", params=2_000_000, seconds=10,
                     tree_peak_bytes=int(2e9), rank_peak_bytes=int(4.4e8),
                     rank_state_bytes=int(1.6e7), planned_rank_bytes=4e8)  # fmt: skip
    stopped = Attempt("ddp", "fsdp", "fp32", "4x512", "over budget", tree_peak_bytes=int(8e9))
    largest = largest_table([fitted, stopped])
    assert "| ddp | fsdp | fp32 | 2x256 | 2.0 M |" in largest
    assert "| 1.100 | 4x512: over budget |" in largest
    every = attempts_table([fitted, stopped])
    assert "over budget" in every and every.count("\n") == 3
