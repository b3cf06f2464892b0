"""--compile: each transformer block's forward compiled with torch.compile (inductor on the
CPU); a compiled run trains the uncompiled run's numbers to float32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowcomm.config import (
    CommConfig,
    ConfigError,
    NumericsConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
)


def _config(out: Path, compiled: bool) -> TrainConfig:
    config = TrainConfig(
        placement=PlacementConfig(workers=1),
        run=RunConfig(
            steps=3, eval_every=3, eval_batches=1, progress=False, plot=False, out=str(out)
        ),
        comm=CommConfig(seconds_per_microbatch=0.01),
        numerics=NumericsConfig(compile=compiled),
    )
    config.model.n_layer, config.model.n_embd, config.model.n_head = 2, 32, 2
    config.model.block_size, config.data.micro_batch_size = 16, 2
    config.validate()
    return config


@pytest.mark.slow  # (inductor's compilation: 12 s with its cache warm, 65 s cold, loaded machine)
def test_a_compiled_run_trains_the_uncompiled_runs_numbers(tmp_path: Path) -> None:
    """One worker in this process, 3 steps of ddp on a 2-block GPT: the losses (train and
    validation) agree to float32 rounding, and the blocks ran compiled."""
    from lowcomm.comm.local import LocalComm
    from lowcomm.train.loop import train_worker

    losses = {}
    try:
        for compiled in (False, True):
            out = tmp_path / str(compiled)
            train_worker(_config(out, compiled), LocalComm())
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            losses[compiled] = [row["train_loss"] for row in rows] + [rows[-1]["val_loss"]]
        counters = torch._dynamo.utils.counters["stats"]
        assert counters["unique_graphs"] >= 1  # the blocks were compiled
    finally:
        torch._dynamo.reset()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_compile_is_refused_where_it_cannot_run() -> None:
    config = TrainConfig(
        placement=PlacementConfig(workers=2, workers_per_process=2),
        numerics=NumericsConfig(compile=True),
    )
    with pytest.raises(ConfigError, match=r"--compile: --workers-per-process 2 .* not thread-safe"):
        config.validate()
    from lowcomm.models.recompute import compile_blocks

    with pytest.raises(ValueError, match="--compile: Linear has no list of transformer blocks"):
        compile_blocks(torch.nn.Linear(2, 2))
