"""--token-budget with declared faults: the budget counts committed tokens (goodput's
numerator), so a run whose crash drops a round trains more steps than the fault-free run
until it has committed the budget, and every placement ends at the same step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.faults.run import faults_refusal
from lowcomm.launch.run import run_training
from lowcomm.models import ModelConfig
from lowcomm.strategies.diloco import DiLoCoOptions

WORKERS = 3
MICRO_BATCH, BLOCK = 2, 16
#: Tokens the three workers compute in one step.
PER_STEP = WORKERS * MICRO_BATCH * BLOCK
#: The budget: what the three workers commit in 8 fault-free steps.
BUDGET = 8 * PER_STEP
#: --steps: a cap well above what either run needs.
CAP = 30

#: Worker 1 crashes at step 3 and a replacement joins at step 6: ddp drops step 3 on every
#: member; diloco's survivors sync steps 2-3 without it, and its inner steps of the round are
#: lost.
CRASH = "step=3 worker=1 crash\nstep=6 worker=1 join\n"
#: No event: the same accounting of committed tokens, without a fault.
NONE = "# no fault\n"


def _config(method: str, out: Path, trace: Path, **overrides: Any) -> TrainConfig:
    options: dict[str, Any] = dict(
        workers=WORKERS, workers_per_process=WORKERS, steps=CAP, network="wan",
        clock="virtual", seconds_per_microbatch=0.01, eval_every=1000, eval_batches=2,
        log_every=1, progress=False, plot=False, out=str(out), faults=str(trace),
        fault_detection_s=2.5, token_budget=BUDGET,
    )  # fmt: skip
    return with_options(
        TrainConfig(
            method=method,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK),
            data=DataConfig(micro_batch_size=MICRO_BATCH),
            diloco=DiLoCoOptions(sync_every=2),
        ),
        **{**options, **overrides},
    )


def _run(config: TrainConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    summary = run_training(config, report=None)
    assert summary is not None
    out = Path(str(config.run.out))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], summary


def _trace(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.txt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_crash_makes_the_budget_take_more_steps_until_it_is_committed(
    method: str, tmp_path: Path
) -> None:
    clean = _run(_config(method, tmp_path / "clean", _trace(tmp_path, "none", NONE)))
    faulty = _run(_config(method, tmp_path / "faulty", _trace(tmp_path, "crash", CRASH)))
    # Fault-free: every step commits (ddp) or every sync commits its round (diloco, H = 2),
    # so the budget is reached at step 8 exactly.
    assert len(clean[0]) == 8
    assert clean[1]["faults"]["committed_tokens"] == clean[1]["committed_tokens"] == BUDGET
    assert clean[1]["faults"]["rounds_dropped"] == 0
    # With the crash a round is dropped and worker 1 is away for steps 3-5: the run goes on
    # past step 8, and ends at the first step whose commit reaches the budget.
    records, summary = faulty
    assert summary["faults"]["rounds_dropped"] == (1 if method == "ddp" else 0)
    assert [r["quorum"] for r in records[2:7]] == [3, 2, 2, 2, 3]
    assert 8 < len(records) < CAP
    committed = summary["faults"]["committed_tokens"]
    assert summary["committed_tokens"] == committed
    round_tokens = PER_STEP * (1 if method == "ddp" else 2)
    assert BUDGET <= committed < BUDGET + round_tokens
    # It computed more tokens than it committed: the dropped step's (ddp) or the crashed
    # worker's round (diloco).
    assert summary["tokens"] > committed
    assert all(math.isfinite(r["train_loss"]) for r in records)


def test_steps_still_cap_a_budget_the_faults_keep_from_being_committed(tmp_path: Path) -> None:
    config = _config("ddp", tmp_path / "out", _trace(tmp_path, "crash", CRASH), steps=9)
    records, summary = _run(config)
    assert len(records) == 9
    assert summary["faults"]["committed_tokens"] < BUDGET


def test_faults_with_a_token_budget_pass_the_checks(tmp_path: Path) -> None:
    config = _config("diloco", tmp_path / "out", _trace(tmp_path, "crash", CRASH))
    assert faults_refusal(config) is None
    config.validate()


@pytest.mark.slow
def test_worker_processes_end_a_budget_at_the_step_of_one_process(tmp_path: Path) -> None:
    """The budget is decided at every step over every worker, so threads and processes (a
    crash kills its worker's process) end at the same step with the same numbers."""
    trace = _trace(tmp_path, "crash", CRASH)
    threads = _run(_config("diloco", tmp_path / "threads", trace))
    processes = _run(_config("diloco", tmp_path / "processes", trace, workers_per_process=1))
    assert [r["step"] for r in processes[0]] == [r["step"] for r in threads[0]]
    assert len(threads[0]) > 8
    for got, want in zip(processes[0], threads[0], strict=True):
        assert math.isclose(got["train_loss"], want["train_loss"], rel_tol=1e-6)
        assert abs(got["clock_s"] - want["clock_s"]) <= 1e-9
        assert got.get("quorum") == want.get("quorum")
    for name in ("committed_tokens", "tokens"):
        assert processes[1][name] == threads[1][name], name
    assert processes[1]["faults"]["rounds_dropped"] == threads[1]["faults"]["rounds_dropped"]
