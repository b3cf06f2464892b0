"""``lowcomm bench compare --budget tokens`` with faults: every method's run trains past
--steps (up to --max-steps) until it has committed the budget, a dropped round's tokens not
counting."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lowcomm.bench.compare import CompareBench, run_compare
from lowcomm.config import with_options
from lowcomm.faults.run import FaultFlags

WORKERS, MICRO_BATCH, BLOCK, STEPS = 3, 2, 16, 8
PER_STEP = WORKERS * MICRO_BATCH * BLOCK
#: Worker 1 crashes at step 3 and a replacement joins at step 6: ddp drops step 3's round.
CRASH = "step=3 worker=1 crash\nstep=6 worker=1 join\n"


def _bench(tmp_path: Path, **more: object) -> CompareBench:
    trace = tmp_path / "crash.txt"
    trace.write_text(CRASH)
    base = CompareBench(methods=("ddp",)).train
    train = with_options(
        base, model=replace(base.model, n_layer=1, n_head=2, n_embd=32, block_size=BLOCK),
        data=replace(base.data, micro_batch_size=MICRO_BATCH), seconds_per_microbatch=0.01,
        eval_every=1000, eval_batches=2, plot=False,
    )  # fmt: skip
    options: dict[str, Any] = {
        "methods": ("ddp", "diloco+h2:diloco.sync-every=2"), "workers": WORKERS,
        "steps": STEPS, "out": str(tmp_path / "compare"), "budget": "tokens",
        "fault": FaultFlags(faults=str(trace), fault_detection_s=2.5), "train": train,
    }  # fmt: skip
    return CompareBench(**{**options, **more})


def test_each_method_commits_the_token_budget_despite_a_crash(tmp_path: Path) -> None:
    bench = _bench(tmp_path)
    budget = bench.token_budget()
    assert budget == STEPS * PER_STEP
    assert bench.step_cap() == 2 * STEPS
    results = run_compare(bench)
    assert results["failures"] == {}
    for label, row in results["methods"].items():
        summary = json.loads((Path(row["runs"][0]) / "summary.json").read_text())
        committed = summary["faults"]["committed_tokens"]
        round_tokens = PER_STEP * (1 if label == "ddp" else 2)
        assert budget <= committed < budget + round_tokens, label
        assert summary["committed_tokens"] == committed == row["tokens"]
        # The crash cost it committed tokens, so it took more steps than --steps.
        assert STEPS < summary["steps"] < bench.step_cap(), label
    assert results["methods"]["ddp"]["rounds_dropped"] == 1
    report = (Path(bench.out) / "report.md").read_text()
    assert f"a budget of {budget:,} committed tokens" in report
    assert f"at most {2 * STEPS} steps" in report
    assert "Short of the budget" not in report


def test_a_step_cap_below_what_the_faults_need_is_reported_short(tmp_path: Path) -> None:
    bench = _bench(tmp_path, methods=("ddp",), max_steps=STEPS)
    results = run_compare(bench)
    row = results["methods"]["ddp"]
    assert row["steps"] == STEPS and row["tokens"] < bench.token_budget()
    report = (Path(bench.out) / "report.md").read_text()
    assert "Short of the budget at the step cap" in report
    assert f"- ddp: {row['tokens']:,.0f} of {bench.token_budget():,} tokens committed" in report


def test_max_steps_is_refused_where_it_means_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--max-steps: 20 is for --budget tokens with faults"):
        CompareBench(methods=("ddp",), steps=8, max_steps=20, out=str(tmp_path))
    with pytest.raises(ValueError, match="--max-steps: 4 is below --steps 8"):
        _bench(tmp_path, max_steps=4)
