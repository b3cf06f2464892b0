"""Run-or-resume of one ``lowcomm train`` configuration, shared by ``bench compare`` and
``reproduce``.

A run directory whose ``summary.json`` exists (written atomically, last) holds a finished run:
it is not run again, so an interrupted sweep resumes where it stopped. A finished run whose
``config.json`` differs from the requested configuration is refused, never silently reused.
A finished run's checkpoints are dropped unless asked to keep them (``--checkpoints keep``):
the reports read the summary and metrics, the final model stays in ``model/``, an interrupted
run is run again from its start, and one benchmark's checkpoints filled 12 GB of disk.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Literal

from lowcomm.config import TrainConfig


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
    run_dir = Path(str(config.out))
    if (run_dir / "summary.json").exists():
        previous = json.loads((run_dir / "config.json").read_text())
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


def val_curve(run_dir: Path, summary: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, clock seconds, validation loss) at each evaluation, ending with the final one."""
    curve = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("val_loss") is not None:
            curve.append((record["step"] + 1, record["clock_s"], record["val_loss"]))
    if curve and curve[-1][0] == summary["steps"]:
        # metrics.jsonl's last step carries the final validation (runs since issue 13); the
        # summary's point has the same loss at the time after the final drain.
        curve.pop()
    curve.append((summary["steps"], summary["modeled_time_s"], summary["final_val_loss"]))
    return curve


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN when there are fewer than two values)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan
