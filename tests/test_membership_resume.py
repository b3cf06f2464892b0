"""--membership torchft with checkpoints: a local job of 3 worker processes (diloco, ddp,
local_sgd) stopped after a few rounds (--stop-after) and resumed (--resume OUT), each worker from its own checkpoint in
its own run directory, follows the uninterrupted job; a job whose workers' checkpoints name
different steps, or checkpoints off a round's end, are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.membership.options import MembershipOptions
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions

STEPS = 12
H = 4


def _config(out: Path | None, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method="diloco",
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=H),
            local=LocalOptions(sync_every=H),
        ),
        workers=3,
        steps=STEPS,
        clock="virtual",
        seconds_per_microbatch=0.01,
        eval_every=1000,
        eval_batches=2,
        progress=False,
        plot=False,
        out=None if out is None else str(out),
        log_every=1,
        membership="torchft",
        membership_options=MembershipOptions(detect_s=2.0, quorum_s=60.0, digests=True),
    )
    return with_options(config, **overrides)


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): float(r["train_loss"]) for r in map(json.loads, lines)}


def _digests(run: Path) -> dict[int, str]:
    record = json.loads((run / "membership.json").read_text())
    return {int(d["step"]): str(d["sha256"]) for d in record["digests"]}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "ddp", "local_sgd"])
def test_stopped_and_resumed_job_follows_the_uninterrupted_one(tmp_path: Path, method: str) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")
    from lowcomm.launch.run import run_training
    from lowcomm.membership.local import check_resume

    run_training(_config(tmp_path / "whole", method=method), report=None)
    job = tmp_path / "job"
    run_training(_config(job, method=method, checkpoint_every=H, stop_after=2 * H), report=None)
    for slot in range(3):
        latest = (job / f"worker{slot}" / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step-{2 * H:06d}", slot  # (each worker's own, at one round's end)
        assert sorted(_losses(job / f"worker{slot}")) == list(range(2 * H))

    # The job's options, which `lowcomm train --resume OUT` alone continues with.
    saved = TrainConfig.from_dict(json.loads((job / "config.json").read_text()))
    assert (saved.method, saved.run.steps, saved.placement.workers) == (method, STEPS, 3)

    # A job whose workers stopped at different steps is refused, naming them.
    skewed = tmp_path / "skewed"
    shutil.copytree(job, skewed)
    shutil.rmtree(skewed / "worker2" / "checkpoints" / f"step-{2 * H:06d}")
    (skewed / "worker2" / "checkpoints" / "latest").write_text(f"step-{H:06d}\n")
    with pytest.raises(ConfigError, match=r"different steps .*worker2 at step 4"):
        check_resume(_config(None, method=method, resume=str(skewed)))

    run_training(_config(None, method=method, resume=str(job), checkpoint_every=H), report=None)
    for slot in range(3):
        whole, resumed = tmp_path / "whole" / f"worker{slot}", job / f"worker{slot}"
        want, got = _losses(whole), _losses(resumed)
        assert sorted(got) == list(range(STEPS)), slot
        for step in range(STEPS):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (slot, step)
        # (The resumed workers' rounds after the stop commit the same parameters.)
        assert _digests(resumed)[STEPS - 1] == _digests(whole)[STEPS - 1], slot
    assert _digests(job / "worker0")[STEPS - 1] == _digests(job / "worker2")[STEPS - 1]


def test_checkpoints_off_a_rounds_end_are_refused_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, checkpoint_every=3)
    with pytest.raises(ConfigError, match=r"--checkpoint-every: 3 is not a round's end") as error:
        config.validate()
    assert "\n" not in str(error.value)


def test_methods_not_yet_checkpointed_are_refused_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, method="streaming_diloco", stop_after=4)
    with pytest.raises(ConfigError, match=r"streaming_diloco does not yet keep checkpoints"):
        config.validate()
