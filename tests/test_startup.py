"""Start-up is visible: the phases are printed as they happen, too many
processes for the cores are warned about, and `lowcomm bench startup` reports the phases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.bench.startup import PHASES, phase_costs
from lowcomm.config import CommConfig, TrainConfig
from lowcomm.launch.run import warn_if_oversubscribed

SMALL = [
    "--workers", "2", "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-batches", "1",
    "--progress", "False", "--plot", "False", "--steps", "2",
]  # fmt: skip


def test_phase_costs_split_the_time_before_the_first_step() -> None:
    lines = [
        (0.2, "noise"),
        (1.0, "lowcomm: preparing corpus from the bundled corpus"),
        (1.2, "lowcomm: training a 2048-token BPE tokenizer on 6 documents (first use)"),
        (1.5, "lowcomm: corpus: 6 files, ..."),
        (3.0, "lowcomm: workers connected: 2 processes"),
        (3.25, "lowcomm: training: 0.1 M parameters"),
    ]
    costs = phase_costs(lines, first_step_s=3.5)
    assert list(costs) == [name for name, _ in PHASES] + ["first step"]
    assert list(costs.values()) == pytest.approx([1.0, 0.5, 1.5, 0.25, 0.25])
    # A command that prints no phase (an older lowcomm) has no breakdown.
    assert phase_costs([(0.1, "hello")], first_step_s=2.0) == {}


def test_more_processes_than_cores_is_warned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    warn_if_oversubscribed(2)
    assert capsys.readouterr().err == ""
    warn_if_oversubscribed(16)
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("lowcomm: warning: 16 worker processes on 2 CPU cores")
    # What it says of the clock follows the run's compute model (calibrated by default).
    assert "calibrate in turn" in line and "own CPU time" not in line
    warn_if_oversubscribed(16, TrainConfig(comm=CommConfig(compute_model="cpu-time")))
    assert "each worker's own CPU time" in capsys.readouterr().err
    warn_if_oversubscribed(16, TrainConfig(comm=CommConfig(clock="real")))
    said = capsys.readouterr().err
    assert "the real clock's modeled time grows" in said
    assert "--workers-per-process" not in said  # (a torchrun or P x K run: no such fix)
    # Workers the local spawner would start as processes: the threads of one are named.
    warn_if_oversubscribed(16, TrainConfig(), workers=16)
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith("; --workers-per-process 16 runs them as threads of one process")
    )


@pytest.mark.slow
def test_train_prints_its_phases_in_order(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lowcomm", "train", "--out", str(tmp_path / "run"), *SMALL],
        capture_output=True, text=True, timeout=240, env={**os.environ},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    found = [next(i for i, line in enumerate(lines) if line.startswith(p)) for _, p in PHASES]
    assert found == sorted(found)
    corpus = lines[found[1]]
    assert "6 files" in corpus and "6 documents" in corpus and "tokens" in corpus


@pytest.mark.slow
def test_bench_startup_reports_every_phase(tmp_path: Path) -> None:
    report = tmp_path / "startup.json"
    result = subprocess.run(
        [sys.executable, "-m", "lowcomm", "bench", "startup", "--workers", "2", "--steps", "1",
         "--json-out", str(report)],
        capture_output=True, text=True, timeout=240, env={**os.environ},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    [row] = json.loads(report.read_text())["table"]
    assert row["workers"] == 2 and 0 < row["first_step_s"] <= row["exit_s"]
    assert set(row["phases"]) == {name for name, _ in PHASES} | {"first step"}
