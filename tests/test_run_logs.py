"""Logs and plots are complete: the final validation loss is the last
validation point of metrics.jsonl and of loss.png, and loss.png colours a series alike in
both panels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _cli import lowcomm
from lowcomm.config import PlacementConfig, RunConfig, TrainConfig
from lowcomm.train.metrics import RunWriter, StepRecord
from lowcomm.train.records import StepMetrics

SMALL = [
    "--workers", "2", "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-batches", "1",
    "--progress", "False", "--plot", "False",
]  # fmt: skip


@pytest.mark.slow
def test_final_validation_loss_is_the_last_point_of_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--steps", "5", "--eval-every", "2", "--out", str(out), *SMALL)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    evaluated = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
    assert [step for step, _ in evaluated] == [1, 3, 4]
    assert evaluated[-1][1] == summary["final_val_loss"]


def _records(count: int) -> list[StepRecord]:
    def worker(step: int) -> StepMetrics:
        values = [3.0, 0.1, 0.05, 100.0, 0.2, 1, 64, 1]
        return StepMetrics(*(value - 0.1 * step for value in values), params_finite=1.0)

    return [
        StepRecord.from_workers(step, 1e-3, [worker(step)], 2.5 if step % 2 else None, "virtual")
        for step in range(count)
    ]


def test_loss_png_uses_one_colour_per_series_in_both_panels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    saved: list[Figure] = []

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        Path(args[0]).write_bytes(b"")

    monkeypatch.setattr(Figure, "savefig", keep)
    writer = RunWriter(
        TrainConfig(
            run=RunConfig(out=str(tmp_path / "run"), progress=False),
            placement=PlacementConfig(workers=1),
        )
    )
    for record in _records(6):
        writer.write_step(record)
    writer.close_steps()
    writer._plot()
    [figure] = saved
    colours: dict[str, set[str]] = {}
    for axis in figure.axes:
        for line in axis.get_lines():
            colours.setdefault(str(line.get_label()), set()).add(str(line.get_color()))
    assert set(colours) == {"train", "validation"}
    assert all(len(found) == 1 for found in colours.values()), colours
    assert colours["train"] != colours["validation"]
