"""A validation that no worker holds a batch for: fewer --eval-batches than workers, and the
workers that hold them out of the step's quorum. Its loss is left out of the record (never
NaN), and the run says why."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lowcomm.config import with_options
from test_faults_train import _config, _run, _trace


def test_a_validation_without_any_batch_leaves_val_loss_out(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # One validation batch: worker 0's. It is out at steps 2-3 and again from step 6 on;
    # validations follow steps 1, 3 and 5, and the final one step 7.
    trace = _trace(tmp_path, "step=2 worker=0 crash\nstep=4 worker=0 join\nstep=6 worker=0 crash\n")
    config = with_options(_config("ddp", tmp_path / "out", trace), eval_every=2, eval_batches=1)
    records, summary, _ = _run(config)
    losses = {r["step"]: r["val_loss"] for r in records if r["val_loss"] is not None}
    assert sorted(losses) == [1, 5] and all(math.isfinite(v) for v in losses.values()), records
    assert all(r["val_loss"] is None for r in records if r["step"] in (3, 7)), records
    assert summary["final_val_loss"] is None
    assert "no worker in the validation held a batch (--eval-batches 1" in str(
        summary["final_val_loss_note"]
    )
    said = [line for line in capfd.readouterr().err.splitlines() if "held a batch" in line]
    assert len(said) == 1 and said[0].startswith("lowcomm: step 3: "), said
