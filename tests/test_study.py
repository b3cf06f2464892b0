"""A study's one compute calibration: measured once before the first run, read by the next
study, charged by every run, refused for another model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lowcomm.bench.runs import study_calibration
from lowcomm.config import PlacementConfig, RunConfig, TrainConfig
from lowcomm.models import ModelConfig

TINY = TrainConfig(
    model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
    placement=PlacementConfig(workers=2),
    run=RunConfig(steps=2),
)


def test_a_study_measures_once_and_every_run_charges_that_file(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    first = study_calibration(TINY, path, vocab_size=64, option="--out", tag="t")
    assert first is not None and first.measured and path.exists()
    again = study_calibration(TINY, path, vocab_size=64, option="--out", tag="t")
    assert again is not None and not again.measured
    assert again.calibration == first.calibration  # two studies, one cost
    runs = [first.apply(dataclasses.replace(TINY, method=m)) for m in ("ddp", "diloco")]
    assert {run.comm.calibration for run in runs} == {str(path.resolve())}
    # A run off the calibrated model is left as it is.
    declared = first.apply(
        dataclasses.replace(
            TINY,
            comm=dataclasses.replace(TINY.comm, seconds_per_microbatch=0.1),
        )
    )
    assert declared.comm.calibration is None
    # The report names the file relative to its own directory, never by an absolute path.
    beside = first.describe("--train.calibration", tmp_path)
    assert "saved in `calibration.json`, relative to this report" in beside
    assert "Charge it again in another study: `--train.calibration DIR/calibration.json`" in beside
    below = first.describe("--train.calibration", tmp_path / "paper")
    assert "`../calibration.json`" in below and str(tmp_path) not in below + beside


def test_a_calibration_of_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    study_calibration(TINY, path, vocab_size=64, option="--out", tag="t")
    wider = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, n_embd=64))
    with pytest.raises(ValueError, match=r"^--out: .* parameters") as error:
        study_calibration(wider, path, vocab_size=64, option="--out", tag="t")
    assert "\n" not in str(error.value)


def test_no_calibration_off_the_calibrated_model(tmp_path: Path) -> None:
    cpu_time = dataclasses.replace(
        TINY,
        comm=dataclasses.replace(TINY.comm, compute_model="cpu-time"),
    )
    path = tmp_path / "calibration.json"
    assert study_calibration(cpu_time, path, vocab_size=64, option="--out", tag="t") is None
    assert not path.exists()
