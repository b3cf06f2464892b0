"""`lowcomm bench compare` end to end: runs, report, JSON schema, resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.config import RunConfig

pytestmark = pytest.mark.slow

SMALL_TRAIN = [
    "--train.model.n-layer", "1", "--train.model.n-embd", "64", "--train.model.n-head", "2",
    "--train.model.block-size", "32", "--micro-batch-size", "4",
    "--train.eval-batches", "2", "--train.eval-every", "2",
    # (each run's workers in its own process: the study, not the process machinery, is tested)
    "--train.workers-per-process", "2",
]  # fmt: skip


def _compare(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lowcomm", "bench", "compare", "--methods", "ddp,zero1",
         "ddp+lr:optim.lr=0.003", "--network", "wan", "--seeds", "1", "--steps", "4", "--workers", "2",
         "--out", str(out), *SMALL_TRAIN],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_compare_two_methods_writes_report_and_results(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    result = _compare(out)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {"network", "clock", "steps", "workers", "seeds", "target_val_loss", "methods"} <= set(
        results
    )
    assert set(results["methods"]) == {"ddp", "zero1", "ddp+lr"}
    for row in results["methods"].values():
        assert {
            "final_val_loss_mean", "final_val_loss_sd", "tokens", "time_to_target_s",
            "utilization", "bytes_per_worker_per_step", "state_bytes_per_worker",
        } <= set(row)  # fmt: skip
        assert row["seeds"] == 1 and row["tokens"] == 4 * 2 * 4 * 32
        assert row["final_val_loss_sd"] is None  # undefined for one seed, and valid JSON
        assert 0 < row["utilization"] <= 1
    # Same data order and start: DDP and ZeRO-1 reach the same loss.
    ddp, zero = results["methods"]["ddp"], results["methods"]["zero1"]
    assert ddp["final_val_loss_mean"] == pytest.approx(zero["final_val_loss_mean"], abs=1e-3)
    # One calibration, measured before the first run, charged by every run of the study.
    calibration = json.loads((out / "calibration.json").read_text())
    assert results["calibration"]["path"] == str((out / "calibration.json").resolve())
    charged = set()
    for run in ("ddp-s0", "zero1-s0", "ddp+lr-s0"):
        summary = json.loads((out / "runs" / run / "summary.json").read_text())
        run_config = json.loads((out / "runs" / run / "config.json").read_text())
        assert run_config["comm"]["calibration"] == str((out / "calibration.json").resolve())
        charged.add(summary["compute_model"]["seconds_per_microbatch"])
    assert charged == {calibration["seconds_per_microbatch"]}
    assert (
        "every run on the calibrated model charges one calibration"
        in (out / "report.md").read_text()
    )
    # The variant is ddp at another learning rate, in its own run directory, under its label.
    variant = results["methods"]["ddp+lr"]
    assert (variant["method"], variant["options"]) == ("ddp", {"optim.lr": "0.003"})
    config = json.loads((out / "runs" / "ddp+lr-s0" / "config.json").read_text())
    assert (config["method"], config["optim"]["lr"]) == ("ddp", 0.003)
    assert variant["final_val_loss_mean"] != ddp["final_val_loss_mean"]
    # At M = 2 ZeRO-1 holds 8 + (12 + 4) / 2 = 16 bytes per parameter, as much as DDP.
    assert zero["state_bytes_per_worker"] <= ddp["state_bytes_per_worker"]
    report = (out / "report.md").read_text()
    assert report.startswith("# Method comparison on `wan`")
    assert "| ddp |" in report and "| zero1 |" in report and "| ddp+lr |" in report
    assert "- `ddp+lr`: ddp with `optim.lr=0.003`" in report
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png", "utilization.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # A finished run's checkpoints are dropped (--checkpoints drop); its model stays.
    for run in ("ddp-s0", "zero1-s0", "ddp+lr-s0"):
        assert not (out / "runs" / run / "checkpoints").exists()
        assert (out / "runs" / run / "model").is_dir()

    # Re-running skips finished runs (their summaries are left untouched).
    summary = out / "runs" / "ddp-s0" / "summary.json"
    before = summary.stat().st_mtime_ns
    again = _compare(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done before, skipped" in again.stderr
    assert summary.stat().st_mtime_ns == before


def test_compare_with_ranks_per_worker_reports_the_right_worker_count(tmp_path: Path) -> None:
    # 2 workers of 2 ranks each: 4 processes, and every report says 2 workers.
    out = tmp_path / "cmp"
    result = subprocess.run(
        [sys.executable, "-m", "lowcomm", "bench", "compare", "--methods", "ddp",
         "--train.steps", "2", "--workers", "2", "--train.ranks-per-worker", "2",
         "--checkpoints", "keep", "--out", str(out), *SMALL_TRAIN],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (results["workers"], results["ranks_per_worker"], results["steps"]) == (2, 2, 2)
    summary = json.loads((out / "runs" / "ddp-s0" / "summary.json").read_text())
    assert (summary["workers"], summary["ranks_per_worker"]) == (2, 2)
    # Each of the 4 ranks takes a micro-batch of 4 rows per step.
    assert summary["tokens"] == 2 * 2 * 2 * 4 * 32
    assert "2 workers of 2 ranks each" in (out / "report.md").read_text()
    assert (out / "runs" / "ddp-s0" / "checkpoints" / "latest").exists()  # --checkpoints keep


@pytest.mark.parametrize("option", ["steps", "workers", "network", "clock"])
def test_an_option_given_at_the_top_level_and_under_train_is_refused(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowcomm import cli

    value = {
        "steps": ("3", "4"),
        "workers": ("2", "3"),
        "network": ("wan", "none"),
        "clock": ("real", "virtual"),
    }
    top, under = value[option]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "bench",
                "compare",
                "--out",
                str(tmp_path),
                f"--{option}",
                top,
                f"--train.{option}",
                under,
            ]
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"lowcomm: error: --{option}: given both") and "\n" not in error
    assert not (tmp_path / "runs").exists()


def test_top_level_and_train_options_are_one_option() -> None:
    from lowcomm.bench.compare import CompareBench
    from lowcomm.config import TrainConfig

    assert CompareBench().run_config("ddp", 0).run.steps == 60  # the bench's own default
    assert CompareBench(steps=5).run_config("ddp", 0).run.steps == 5
    assert (
        CompareBench(train=TrainConfig(run=RunConfig(steps=7))).run_config("ddp", 0).run.steps == 7
    )
    with pytest.raises(ValueError, match="--steps: given both"):
        CompareBench(steps=5, train=TrainConfig(run=RunConfig(steps=7)))
