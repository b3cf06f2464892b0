"""`lowcomm bench clock`'s own machinery (the benchmark itself is run by hand: its numbers are
measurements, never thresholds in tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lowcomm.bench.clock import ClockBench, busy_processes


def test_busy_processes_start_and_stop() -> None:
    before = set(_children())  # (other tests may have left helper processes)
    with busy_processes(2):
        spinners = set(_children()) - before
        assert len(spinners) == 2
    for pid in spinners:
        assert not _alive(pid)


def _children() -> list[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    with open(path) as handle:
        return [int(pid) for pid in handle.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_clock_bench_configs_and_command() -> None:
    bench = ClockBench(repeats=2, steps=5)
    config = bench.config("co2", "cpu-time", Path("/tmp/x"), workers=2)
    assert (config.method, config.compute_model, config.workers) == ("co2", "cpu-time", 2)
    assert config.steps == 5 and config.network == "wan" and config.clock == "virtual"
    assert bench.command() == "lowcomm bench clock --repeats 2 --steps 5"
    with pytest.raises(ValueError, match="--repeats"):
        ClockBench(repeats=0)
