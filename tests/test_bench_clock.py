"""`lowcomm bench clock`'s own machinery (the benchmark itself is run by hand: its numbers are
measurements, never thresholds in tests)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lowcomm.bench.clock import ClockBench, busy_processes
from lowcomm.config import TrainConfig


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


def test_quiet_and_loaded_blocks_alternate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drift of the host over the benchmark must not pose as the load's effect: every
    repeat runs a quiet block then a loaded one, and the cells gather their runs in order."""
    import lowcomm.bench.clock as clock_bench

    order: list[tuple[str, str, str]] = []
    busy_now: list[int] = [0]

    @contextmanager
    def fake_busy(count: int) -> Iterator[None]:
        busy_now[0] = count
        yield
        busy_now[0] = 0

    def fake_summary(config: TrainConfig) -> dict[str, object]:
        load = "loaded" if busy_now[0] else "quiet"
        order.append((config.method, config.compute_model, load))
        time = float(len(order))  # the n-th run "takes" n seconds
        return {"modeled_time_s": time, "utilization": 0.5, "compute_model": {"model": "x"}}

    monkeypatch.setattr(clock_bench, "busy_processes", fake_busy)
    monkeypatch.setattr(clock_bench, "_summary", fake_summary)
    bench = ClockBench(methods="ddp", repeats=2, busy=3)
    cells = clock_bench._load_runs(bench, Path("/nonexistent"))
    loads = [load for _, _, load in order]
    assert loads == ["quiet"] * 2 + ["loaded"] * 2 + ["quiet"] * 2 + ["loaded"] * 2
    assert cells["ddp/cpu-time/quiet"]["times"] == [1.0, 5.0]
    assert cells["ddp/calibrated/loaded"]["times"] == [4.0, 8.0]
    assert cells["ddp/calibrated/loaded"]["seconds_per_microbatch"] == [None, None]
