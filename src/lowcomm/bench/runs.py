"""Run-or-resume of one ``lowcomm train`` configuration, and the one compute calibration of a
study, shared by ``bench compare`` and ``reproduce``.

A run directory whose ``summary.json`` exists (written atomically, last) holds a finished run:
it is not run again, so an interrupted sweep resumes where it stopped. A finished run whose
``config.json`` differs from the requested configuration is refused, never silently reused.
A finished run's checkpoints are dropped unless asked to keep them (``--checkpoints keep``):
the reports read the summary and metrics, the final model stays in ``model/``, an interrupted
run is run again from its start, and one benchmark's checkpoints filled 12 GB of disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lowcomm.config import TrainConfig

if TYPE_CHECKING:
    from lowcomm.comm.calibration import Calibration


def run_one(config: TrainConfig) -> str | None:
    """Run one training job through the one launch path (what ``lowcomm train`` does: the
    same checks, ``workers x ranks-per-worker`` processes); return an error message instead
    of raising. A directory holding an unfinished run of this sweep (an interrupted one) is
    cleared first: the sweep runs it again from the start."""
    from lowcomm.launch import WorkerFailed
    from lowcomm.launch.run import run_training
    from lowcomm.train.rundir import clear_run, run_directory

    clear_run(run_directory(config))
    try:
        run_training(config, report=None)
    except (WorkerFailed, ValueError) as error:  # ValueError: ConfigError, DataError
        return str(error)
    return None


#: What a sweep does with a finished run's checkpoints (``--checkpoints``).
CheckpointPolicy = Literal["drop", "keep"]
CHECKPOINTS_HELP = (
    "drop: delete a finished run's checkpoints (its model/, metrics and summary stay, which is "
    "all the report reads; an interrupted run is run again from its start). keep: keep them, "
    "to resume a run with more --steps later (about 100 MB per run of the default model)."
)


def run_or_resume(
    config: TrainConfig,
    name: str,
    *,
    tag: str,
    option: str = "--out",
    checkpoints: CheckpointPolicy = "drop",
) -> str | None:
    """Run ``config`` into ``config.out`` unless a finished run of the same configuration is
    there; return an error message if the run failed, None if its summary is available. A
    finished run's checkpoints are deleted unless ``checkpoints`` is ``keep``.

    Raises ValueError (naming ``option``) if the directory holds a finished run of another
    configuration.
    """
    from lowcomm.launch.run import make_paths_absolute

    make_paths_absolute(config)  # as the run's config.json will hold them
    run_dir = Path(str(config.run.out))
    if (run_dir / "summary.json").exists():
        from lowcomm.config import nested

        # (nested: a run of the flat shape, written before the components, is the same run)
        previous = nested(json.loads((run_dir / "config.json").read_text()))
        if previous != json.loads(config.to_json()):
            raise ValueError(
                f"{option}: {run_dir} holds a finished run with a different configuration; "
                f"pass another {option} (or move that directory away) to keep both"
            )
        print(f"[{tag}] {name}: done before, skipped", file=sys.stderr)
        return None
    print(f"[{tag}] {name}: running", file=sys.stderr)
    error = run_one(config)
    if error is not None:
        print(f"[{tag}] {name}: FAILED: {error}", file=sys.stderr)
    elif checkpoints == "drop":
        drop_checkpoints(run_dir)
    return error


def drop_checkpoints(run_dir: Path) -> None:
    """Delete a finished run's checkpoints (its model/, metrics and summary stay)."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def final_loss(summary: dict[str, Any]) -> float | None:
    """A run's final validation loss; None where its final validation had no batch on any
    worker (summary.json's ``final_val_loss_note`` says why)."""
    value = summary.get("final_val_loss")
    return None if value is None else float(value)


def val_curve(run_dir: Path, summary: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, clock seconds, validation loss) at each evaluation, ending with the final one
    (a run without a final validation loss ends on its last measured evaluation)."""
    curve = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("val_loss") is not None:
            curve.append((record["step"] + 1, record["clock_s"], record["val_loss"]))
    if curve and curve[-1][0] == summary["steps"]:
        # metrics.jsonl's last step carries the final validation (older runs' files do not);
        # the summary's point has the same loss at the time after the final drain.
        curve.pop()
    final = final_loss(summary)
    if final is not None:
        curve.append((summary["steps"], summary["modeled_time_s"], final))
    return curve


def bytes_curve(
    run_dir: Path, curve: list[tuple[int, float, float]], summary: dict[str, Any]
) -> list[float]:
    """The bytes sent per worker up to each point of ``curve`` (:func:`val_curve`): the sum
    of metrics.jsonl's per-step bytes through the point's step; the last point's is the
    summary's total (the final drain included)."""
    sent: dict[int, float] = {}
    total = 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        total += float(record.get("bytes_sent_per_worker", 0.0))
        sent[record["step"] + 1] = total
    steps = sorted(sent)
    points = []
    for step, _, _ in curve:
        reached = [s for s in steps if s <= step]
        points.append(sent[reached[-1]] if reached else 0.0)
    if points and final_loss(summary) is not None:
        # (the final point's: a curve without a final validation ends before the drain)
        points[-1] = float(summary["bytes_sent_per_worker"])
    return points


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN when there are fewer than two values)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


#: A study's calibration file in its output directory (unless the study is given one).
STUDY_CALIBRATION = "calibration.json"


@dataclass(frozen=True)
class StudyCalibration:
    """The one compute calibration every run of a study charges (``bench compare``,
    ``reproduce``, ...): measured once before the study's first run, or read from the file
    of an earlier study, and passed to every run as ``--calibration``."""

    path: Path
    calibration: Calibration
    measured: bool
    """Measured by this study (False: read from the file)."""

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` charging this calibration (unchanged if it is not on the calibrated
        compute model: the real clock, a declared cost, the CPU-time model)."""
        from lowcomm.train.compute import uses_calibration

        if not uses_calibration(config):
            return config
        return dataclasses.replace(
            config,
            comm=dataclasses.replace(config.comm, calibration=str(self.path)),
        )

    def describe(self, reuse: str, report_dir: Path) -> str:
        """The report's sentence: what every run charged and how to charge it again. The file
        is named relative to ``report_dir``, the report's own directory, so that a report
        copied elsewhere with its study names no path of the machine that wrote it."""
        c = self.calibration
        origin = "measured before the study's first run, saved in" if self.measured else "read from"
        shown = Path(os.path.relpath(self.path, Path(report_dir).resolve())).as_posix()
        return (
            f"Compute: every run on the calibrated model charges one calibration, "
            f"{c.seconds_per_microbatch * 1e3:.1f} ms per micro-batch of {c.micro_batch_size} x "
            f"{c.block_size} tokens and {c.seconds_per_element * 1e9:.3f} ns per element "
            f"outside micro-batches ({origin} `{shown}`, relative to this report), so every "
            f"method is charged the same compute. Charge it again in another study: "
            f"`{reuse} DIR/{shown}`, DIR being this report's directory."
        )

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "measured": self.measured, **self.calibration.to_dict()}


def study_calibration(
    train: TrainConfig, path: Path, *, vocab_size: int, option: str, tag: str
) -> StudyCalibration | None:
    """The study's one calibration at ``path``: read if the file exists, else measured now in
    this process (before any run) and written there. None when ``train`` does not use the
    calibrated compute model.

    Raises ValueError (naming ``option``) when the file was measured for another model,
    micro-batch shape or precision."""
    from lowcomm.comm.calibration import Calibration, check_calibration_file
    from lowcomm.models import build_model
    from lowcomm.train.compute import calibrate_in_process, uses_calibration

    if not uses_calibration(train):
        return None
    bf16 = train.numerics.precision == "bf16-mixed"
    problem = check_calibration_file(
        path, micro_batch_size=train.data.micro_batch_size, block_size=train.model.block_size,
        bf16=bf16,
    )  # fmt: skip
    if problem is None and path.exists():
        calibration = Calibration.load(path)
        params = sum(p.numel() for p in build_model(train.model, vocab_size).parameters())
        if train.run.init_from is None and calibration.num_params != params:
            problem = (
                f"was measured on a model of {calibration.num_params:,} parameters, this study "
                f"trains one of {params:,}"
            )
    if problem is not None:
        raise ValueError(f"{option}: {path} {problem}; pass another {option} or move it away")
    if path.exists():
        print(f"[{tag}] compute calibration: read from {path}", file=sys.stderr)
        return StudyCalibration(path.resolve(), Calibration.load(path), measured=False)
    print(f"[{tag}] compute calibration: measuring once for every run", file=sys.stderr)
    calibration = calibrate_in_process(train, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    calibration.save(path)
    return StudyCalibration(path.resolve(), calibration, measured=True)
