"""Equal-token comparisons: `bench compare` gives ACCO the tokens DDP commits, ends it there,
and lays its learning-rate schedule out over that budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests._cli import lowcomm

from lowcomm.config import PlacementConfig, RunConfig, TrainConfig
from lowcomm.reproduce.runner import equal_tokens
from lowcomm.train.context import strategy_context

TRAIN = (
    "--train.model.n-layer", "1", "--train.model.n-embd", "32", "--train.model.n-head", "2",
    "--train.model.block-size", "16", "--micro-batch-size", "2", "--train.eval-every", "5",
    "--train.eval-batches", "2",
    "--train.workers-per-process", "2",  # (each run's 2 workers in its own process)
)  # fmt: skip


@pytest.mark.slow
def test_compare_runs_acco_on_ddps_tokens(tmp_path: Path) -> None:
    steps = 10
    result = lowcomm(
        "bench", "compare", "--methods", "ddp,acco", "--steps", str(steps), "--workers", "2",
        "--network", "ethernet", "--out", str(tmp_path), *TRAIN, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    budget = steps * 2 * 2 * 16  # steps x workers x (micro-batch x block) tokens
    assert results["budget"] == "tokens" and results["token_budget"] == budget
    ddp = json.loads((tmp_path / "runs" / "ddp-s0" / "summary.json").read_text())
    acco = json.loads((tmp_path / "runs" / "acco-s0" / "summary.json").read_text())
    assert ddp["committed_tokens"] == ddp["tokens"] == budget
    assert acco["committed_tokens"] == budget  # ended when its commits reached DDP's tokens
    assert acco["steps"] < steps  # (it takes at least 2 micro-batches per committed step)
    assert results["methods"]["acco"]["tokens"] == results["methods"]["ddp"]["tokens"]
    assert "| steps |" in (tmp_path / "report.md").read_text()
    # Its schedule reaches its last step where the budget is spent, not before.
    records = [
        json.loads(line) for line in (tmp_path / "runs" / "acco-s0" / "metrics.jsonl").open()
    ]
    schedule = [r["extras"]["schedule_step"] for r in records if "schedule_step" in r["extras"]]
    assert schedule[-1] == steps
    assert all(s < steps for s in schedule[:-1])


def test_equal_tokens_budgets_only_variable_methods() -> None:
    acco = TrainConfig(
        method="acco",
        run=RunConfig(steps=8),
        placement=PlacementConfig(workers=2),
    )
    budgeted = equal_tokens(acco)
    per_microbatch = acco.data.micro_batch_size * acco.model.block_size
    assert budgeted.run.token_budget == 8 * 2 * per_microbatch
    assert strategy_context(budgeted).microbatch_budget == 8 * 2
    assert equal_tokens(TrainConfig(method="ddp")).run.token_budget is None


def test_a_token_budget_below_one_is_refused() -> None:
    result = lowcomm("train", "--token-budget", "0", timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error: --token-budget"), result.stderr
