"""`lowcomm bench clock`'s own machinery (the benchmark itself is run by hand: its numbers are
measurements, never thresholds in tests)."""

from __future__ import annotations

import contextlib
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
    assert (config.method, config.comm.compute_model, config.placement.workers) == (
        "co2",
        "cpu-time",
        2,
    )
    assert config.run.steps == 5 and config.comm.network == "wan" and config.comm.clock == "virtual"
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
        order.append((config.method, config.comm.compute_model, load))
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


def test_agreement_splits_the_ratio_into_compute_and_communication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each method runs once on the real clock and once per virtual compute model; the row's
    ratio is virtual/real time per step, its parts the compute and exposed-communication
    ratios of the headline (first) model, and the report prints them side by side."""
    import lowcomm.bench.clock as clock_bench

    seen: list[tuple[str, str, str]] = []
    # (clock, compute model) -> (compute_s, exposed_comm_s) over 10 steps
    times = {
        ("real", "calibrated"): (8.0, 2.0),
        ("virtual", "calibrated"): (7.0, 1.5),
        ("virtual", "cpu-time"): (8.5, 2.5),
    }

    def fake_summary(config: TrainConfig) -> dict[str, object]:
        seen.append((config.method, config.comm.clock, config.comm.compute_model))
        compute, comm = times[(config.comm.clock, config.comm.compute_model)]
        model = (
            {
                "model": "wall", "on_core": 0.9, "compute_s": compute, "waiting_s": 0.1 * compute,
                "microbatch_wall_s": {"count": 10, "min": 0.25, "median": 0.3, "mean": 0.32},
            }
            if config.comm.clock == "real"
            else {"model": "x", "seconds_per_microbatch": 0.24}
        )  # fmt: skip
        return {
            "modeled_time_s": compute + comm, "steps": config.run.steps, "compute_s": compute,
            "exposed_comm_s": comm, "utilization": compute / 10, "compute_model": model,
        }  # fmt: skip

    monkeypatch.setattr(clock_bench, "_summary", fake_summary)
    bench = ClockBench(agreement_methods="ddp,co2", agreement_steps=10)
    rows = clock_bench._agreement(bench, Path("/nonexistent"))
    assert seen[:3] == [
        ("ddp", "real", "calibrated"),
        ("ddp", "virtual", "calibrated"),
        ("ddp", "virtual", "cpu-time"),
    ]
    row = rows["ddp"]
    assert row["real_s_per_step"] == pytest.approx(1.0)
    assert row["virtual_s_per_step"] == pytest.approx(0.85)
    assert row["ratio"] == pytest.approx(0.85)
    assert row["compute_ratio"] == pytest.approx(7 / 8)
    assert row["exposed_comm_ratio"] == pytest.approx(0.75)
    assert row["ratios_by_model"] == {"calibrated": pytest.approx(0.85), "cpu-time": 1.1}
    report = clock_bench._report(bench, {}, rows)
    assert row["real_on_core"] == 0.9
    # 0.8 s of the real run's 8 s of compute waited for a core: 8.5 / (10 - 0.8)
    assert row["ratio_on_core"] == pytest.approx(8.5 / 9.2)
    assert (
        "| ddp | 1.000 | 0.850 | 0.850 | 0.875 | 0.750 | 1.100 | 90.0% | 0.924 | 80.0% | 70.0% |"
        in report
    )
    assert "cpu-time virtual/real" in report
    assert "| ddp | 240.0 ms | 250.0 ms | 300.0 ms | 320.0 ms | 0.800 |" in report


def test_agreement_rounds_alternate_and_keep_the_median_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With --agreement-repeats N every round runs every method once (so a drift of the
    host falls on all methods alike); the row is the median round's, with every round's
    virtual/real beside it."""
    import lowcomm.bench.clock as clock_bench

    seen: list[tuple[str, str, str]] = []
    real_seconds = iter([10.0, 10.0, 8.0, 8.0, 12.5, 12.5])  # per (round, method) real run

    def fake_summary(config: TrainConfig) -> dict[str, object]:
        seen.append((config.method, config.comm.clock, Path(config.run.out).name))
        seconds = next(real_seconds) if config.comm.clock == "real" else 9.0
        return {
            "modeled_time_s": seconds, "steps": config.run.steps, "compute_s": seconds,
            "exposed_comm_s": 0.0, "utilization": 1.0, "compute_model": {"model": "x"},
        }  # fmt: skip

    monkeypatch.setattr(clock_bench, "_summary", fake_summary)
    bench = ClockBench(
        agreement_methods="ddp,co2", agreement_models="calibrated", agreement_repeats=3,
        agreement_steps=10,
    )  # fmt: skip
    rows = clock_bench._agreement(bench, Path("/nonexistent"))
    assert [(method, clock) for method, clock, _ in seen[:4]] == [
        ("ddp", "real"), ("ddp", "virtual"), ("co2", "real"), ("co2", "virtual"),
    ]  # fmt: skip
    assert seen[4][2] == "agree-ddp-real-1"  # the second round, in its own directory
    for method in ("ddp", "co2"):
        assert rows[method]["ratio_rounds"] == pytest.approx([0.9, 9 / 8, 0.72])
        assert rows[method]["ratio"] == pytest.approx(0.9)  # the median round
        assert rows[method]["real_s_per_step"] == pytest.approx(1.0)
    report = clock_bench._report(bench, {}, rows)
    assert "3 rounds (the median round's row)" in report
    assert "| 0.900, 1.125, 0.720 |" in report
    with pytest.raises(ValueError, match="--agreement-repeats: 0 must be >= 1"):
        ClockBench(agreement_repeats=0)


def test_agreement_gives_no_ratio_of_milliseconds() -> None:
    """Communication the real clock hides (under 1% of its time) gets no ratio: "hidden", or
    the virtual clock's seconds where that clock exposed some."""
    from lowcomm.bench.clock import _exposed, agreement_row

    def summary(compute: float, comm: float) -> dict[str, float]:
        return {"modeled_time_s": compute + comm, "steps": 10, "compute_s": compute,
                "exposed_comm_s": comm, "utilization": 1.0}  # fmt: skip

    real = summary(10.0, 0.0006)
    hidden = agreement_row(real, {"calibrated": summary(9.0, 0.0)})
    assert hidden["exposed_comm_ratio"] is None and _exposed(hidden) == "hidden"
    assert hidden["compute_ratio"] == pytest.approx(0.9)
    exposed = agreement_row(real, {"calibrated": summary(9.0, 0.5)})
    assert _exposed(exposed) == "hidden on real, 0.50 s virtual"


def test_agreement_models_are_checked() -> None:
    with pytest.raises(ValueError, match="--agreement-models: 'calibrated,cpu_time' must name"):
        ClockBench(agreement_models="calibrated,cpu_time")
    with pytest.raises(ValueError, match="--agreement-models"):
        ClockBench(agreement_models=" , ")
    assert ClockBench(agreement_models="", agreement_methods="").agreement_model_list() == []
    only = ClockBench(agreement_models="cpu-time,cpu-time")
    assert only.agreement_model_list() == ["cpu-time"]


def test_the_load_comparison_can_run_the_calibrated_model_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lowcomm.bench.clock as clock_bench

    models: list[str] = []

    def fake_summary(config: TrainConfig) -> dict[str, object]:
        models.append(config.comm.compute_model)
        time = 1.02 if config.run.out and "loaded" in str(config.run.out) else 1.0
        return {"modeled_time_s": time, "utilization": 0.5, "compute_model": {"model": "x"}}

    monkeypatch.setattr(clock_bench, "busy_processes", lambda count: contextlib.nullcontext())
    monkeypatch.setattr(clock_bench, "_summary", fake_summary)
    bench = ClockBench(methods="ddp", repeats=1, models="calibrated")
    cells = clock_bench._load_runs(bench, Path("/nonexistent"))
    assert models == ["calibrated", "calibrated"] and set(cells) == {
        "ddp/calibrated/quiet",
        "ddp/calibrated/loaded",
    }
    report = clock_bench._report(bench, cells, {})
    assert "loaded/quiet modeled time over 1 repetitions: ddp 1.020" in report
    assert "largest gap 2.0% (goal: within 3%, met)" in report
    with pytest.raises(ValueError, match="--models"):
        ClockBench(models="calibrate")
