"""--tensorboard: event files under OUT/tensorboard/, read back with tensorboard's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _cli import TINY, lowcomm
from lowcomm.config import RunConfig


@pytest.mark.slow
def test_tensorboard_events_hold_the_logged_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    done = lowcomm(
        "train", *TINY, "--steps", "4", "--eval-every", "2", "--tensorboard", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def series(tag: str) -> list[tuple[int, float]]:
        return [(event.step, event.value) for event in events.Scalars(tag)]

    def close(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
        return [s for s, _ in got] == [s for s, _ in want] and all(
            v == pytest.approx(w, rel=1e-6) for (_, v), (_, w) in zip(got, want, strict=True)
        )

    steps = [r["step"] for r in records]
    assert close(series("loss/train"), [(r["step"], r["train_loss"]) for r in records])
    assert close(series("lr"), [(r["step"], r["lr"]) for r in records])
    assert close(series("utilization"), [(r["step"], r["utilization"]) for r in records])
    sent = [(r["step"], r["bytes_sent_per_worker"]) for r in records]
    assert close(series("bytes/sent_per_worker"), sent)
    total = sum(value for _, value in sent)
    assert series("bytes/sent_per_worker_total")[-1][1] == pytest.approx(total)
    evaluated = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
    assert [s for s, _ in evaluated] == [1, 3]  # every 2 steps, and the last
    assert close(series("loss/validation"), evaluated)
    modeled = [(round(r["clock_s"] * 1000), r["train_loss"]) for r in records]
    assert close(series("loss_vs_modeled_ms/train"), modeled)
    walltimes = [event.wall_time for event in events.Scalars("loss/train")]
    assert walltimes == pytest.approx([r["clock_s"] for r in records])
    assert len(steps) == 4


def test_tensorboard_without_the_package_is_refused_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tensorboard on a machine without the tensorboard package: one line naming the option
    and the install command, from the pre-flight (no worker started, no run directory)."""
    import importlib.util

    from lowcomm.config import ConfigError, TrainConfig
    from lowcomm.launch.run import preflight

    real_find_spec = importlib.util.find_spec

    def without_tensorboard(name: str, *args: object) -> object:
        return None if name == "tensorboard" else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_tensorboard)
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        preflight(TrainConfig(run=RunConfig(tensorboard=True, out=str(out))))
    assert str(refused.value) == (
        "--tensorboard: needs the tensorboard package: pip install 'lowcomm[tensorboard]'"
    )
    assert not out.exists()
    preflight(
        TrainConfig(run=RunConfig(tensorboard=False, out=str(out)))
    )  # the same run without it passes
