"""--token-budget with --membership torchft: every round carries each participant's tokens
since its last commit, every live worker adds their sum when the round commits, so each holds
the job's committed tokens alike and all stop at the same step: with no fault the static
run's, through a kill the first committed round that reaches the budget on every survivor and
the joiner, which took the count with its healing. Jobs are tests/test_membership_torchft.py's
(3 worker processes of a tiny GPT on a local lighthouse, diloco syncing every 4 steps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.membership.options import MembershipOptions
from test_membership_torchft import _config, _kill_and_restart, _record

#: Tokens the 3 workers train in one step (micro-batches of 2 sequences of 16 tokens).
PER_STEP = 3 * 2 * 16


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _summary(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "summary.json").read_text()))


def _commits(record: dict[str, Any]) -> dict[int, int]:
    """Per loop step of a committed round, the job's committed tokens after it."""
    return {e["step"]: e["job_tokens"] for e in record["events"] if e["event"] == "commit"}


def _needs_torchft() -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "ddp"])
def test_no_fault_budget_stops_where_the_static_run_does(tmp_path: Path, method: str) -> None:
    """The budget is 8 steps' tokens, the cap 12: ddp commits every step, diloco at its
    second sync (steps 3 and 7), so both stop after step 8 as the static run does."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    common: dict[str, Any] = dict(
        clock="virtual", seconds_per_microbatch=0.01, token_budget=8 * PER_STEP
    )
    static = _config(method, tmp_path / "static", 12, membership="static", **common)
    static.placement.membership_options = MembershipOptions()
    run_training(static, report=None)
    run_training(_config(method, tmp_path / "torchft", 12, **common), report=None)
    want = _rows(tmp_path / "static")
    assert [r["step"] for r in want] == list(range(8))
    runs = [tmp_path / "torchft" / f"worker{k}" for k in range(3)]
    got = [_rows(run) for run in runs]
    assert all([r["step"] for r in rows] == list(range(8)) for rows in got)
    for step, row in enumerate(want):
        mean = sum(rows[step]["train_loss"] for rows in got) / 3
        assert mean == pytest.approx(row["train_loss"], rel=1e-6, abs=1e-6), step
    # Each worker records the job's committed tokens, as the static run does.
    assert _summary(tmp_path / "static")["committed_tokens"] == 8 * PER_STEP
    for run in runs:
        assert _summary(run)["committed_tokens"] == 8 * PER_STEP, run
        assert _summary(run)["faults"]["committed_tokens"] == 8 * PER_STEP, run
    counts = [_commits(_record(run)) for run in runs]
    assert counts[0] == counts[1] == counts[2]
    assert counts[0][7] == 8 * PER_STEP and max(counts[0]) == 7


#: Per method, where a budget of 6 steps' tokens ends the run (12 at most) when committed
#: tokens are counted: diloco commits its round of steps 4..7 at step 7; streaming_diloco's
#: fragment rounds complete a step after their launch, and commit the tokens up to there;
#: co2's round launched at step 7 commits its tokens (those up to its launch) when the
#: next one waits for it, at step 11.
INSIDE = {"diloco": 8, "streaming_diloco": 8, "co2": 12}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(INSIDE))
def test_a_budget_inside_a_round_stops_where_committed_tokens_reach_it(
    tmp_path: Path, method: str
) -> None:
    """6 steps' tokens, inside a round: the job's count grows only when a round commits, so
    the torchft job stops at the step a static run that counts committed tokens (any fault
    trace, an empty one here) does, with its losses and its count; a static run without a
    trace counts tokens as they are computed and stops after step 6."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    trace = tmp_path / "none.txt"
    trace.write_text("# no fault\n")
    common: dict[str, Any] = dict(
        clock="virtual", seconds_per_microbatch=0.01, token_budget=6 * PER_STEP
    )
    static = _config(method, tmp_path / "static", 12, membership="static", **common)
    static.placement.membership_options = MembershipOptions()
    run_training(static, report=None)
    run_training(with_options(static, out=str(tmp_path / "traced"), faults=str(trace)), report=None)
    run_training(_config(method, tmp_path / "torchft", 12, **common), report=None)
    assert len(_rows(tmp_path / "static")) == 6
    want = _rows(tmp_path / "traced")
    assert [r["step"] for r in want] == list(range(INSIDE[method]))
    got = [_rows(tmp_path / "torchft" / f"worker{k}") for k in range(3)]
    assert all(len(rows) == len(want) for rows in got)
    for step, row in enumerate(want):
        mean = sum(rows[step]["train_loss"] for rows in got) / 3
        assert mean == pytest.approx(row["train_loss"], rel=1e-6, abs=1e-6), step
    committed = _summary(tmp_path / "traced")["committed_tokens"]
    assert committed >= 6 * PER_STEP
    for k in range(3):
        assert _summary(tmp_path / "torchft" / f"worker{k}")["committed_tokens"] == committed


@pytest.mark.slow
def test_a_stopped_and_resumed_job_stops_where_the_straight_one_does(tmp_path: Path) -> None:
    """Stopped inside a sync round (step 6 of diloco's 4..7): the resumed workers take back
    the job's count and their tokens since the last sync from their checkpoints."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    common: dict[str, Any] = dict(
        clock="virtual", seconds_per_microbatch=0.01, token_budget=8 * PER_STEP
    )
    run_training(_config("diloco", tmp_path / "whole", 12, **common), report=None)
    job = tmp_path / "job"
    run_training(_config("diloco", job, 12, stop_after=6, **common), report=None)
    resumed = with_options(_config("diloco", job, 12, **common), resume=str(job))
    run_training(resumed, report=None)
    for slot in range(3):
        whole, part = tmp_path / "whole" / f"worker{slot}", job / f"worker{slot}"
        want, got = _rows(whole), _rows(part)
        assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(8)), slot
        for a, b in zip(got, want, strict=True):
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6, abs=1e-6)
        assert _summary(part)["committed_tokens"] == 8 * PER_STEP, slot


#: Per method: the budget in fault-free steps, the --steps cap and the steps of a round.
#: (ddp's rounds are slower than diloco's, each paced by the emulated 200 ms link: a
#: budget of 60 steps still leaves the joiner's process time to start.)
KILLED = {"diloco": (120, 400, 4), "ddp": (60, 150, 1)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.long) if m == "ddp" else m for m in KILLED]
)
def test_after_a_kill_every_live_worker_stops_at_the_same_step(tmp_path: Path, method: str) -> None:
    """Worker 2 is SIGKILLed after 10 steps and started again: the tokens it had not
    committed are lost and it sits out the round it healed in, so the job needs more steps
    than the fault-free ones to commit the budget; every live worker stops at the same one."""
    _needs_torchft()
    steps, cap, period = KILLED[method]
    budget = steps * PER_STEP
    job = _kill_and_restart(method, tmp_path, steps=cap, restart=True, token_budget=budget)
    codes, dirs = job["codes"], job["dirs"]
    assert codes[0] == [0] and codes[1] == [0] and codes[2] == [-9, 0], codes
    live = [dirs[(0, 0)], dirs[(1, 0)], dirs[(2, 1)]]
    ends = [_rows(run)[-1]["step"] for run in live]
    assert ends[0] == ends[1] == ends[2] and steps < ends[0] + 1 < cap, ends
    assert (ends[0] + 1) % period == 0  # (the round that committed the budget)
    # Their job-wide counts agree, after every round each committed and at the end, and
    # are the sum of what every process committed of its own (the killed one's included).
    records = [_record(run) for run in live]
    finals = [_summary(run)["committed_tokens"] for run in live]
    assert finals[0] == finals[1] == finals[2]
    assert budget <= finals[0] < budget + period * PER_STEP
    assert [r["job_tokens"] for r in records] == finals
    own = sum(int(_record(d)["committed_tokens"]) for d in dirs.values())
    assert own == finals[0]
    survivors, joiner = [_commits(r) for r in records[:2]], _commits(records[2])
    assert survivors[0] == survivors[1]
    assert joiner and all(survivors[0][step] == count for step, count in joiner.items())
    # The joiner took its source's count with its healing: the job's after the round before.
    healed = next(e for e in records[2]["events"] if e["event"] == "healed")
    before = max(step for step in survivors[0] if step < healed["step"])
    assert healed["job_tokens"] == survivors[0][before]


def test_decoupled_diloco_with_a_budget_is_refused_in_one_line() -> None:
    config = with_options(
        TrainConfig(method="decoupled_diloco"),
        membership="torchft",
        clock="virtual",
        token_budget=4096,
    )
    with pytest.raises(ConfigError) as refused:
        config.validate()
    line = str(refused.value)
    assert line.startswith("--token-budget: 4096 with --membership torchft --method ")
    assert line.endswith("give --steps") and "\n" not in line


def test_other_methods_take_a_budget() -> None:
    for method in ("ddp", "diloco", "co2", "demo"):
        with_options(TrainConfig(method=method), membership="torchft", token_budget=4096).validate()


def test_a_checkpoint_without_the_count_is_refused_with_a_budget(tmp_path: Path) -> None:
    from lowcomm.membership.worker import TORCHFT_STEP, _token_counts

    (tmp_path / TORCHFT_STEP).write_text('{"step": 3, "batches_committed": 6}\n')
    with pytest.raises(ConfigError, match=r"holds no count .* resume it without --token-budget"):
        _token_counts(tmp_path)
    (tmp_path / TORCHFT_STEP).write_text(
        '{"step": 3, "batches_committed": 6, "lowcomm_tokens": {"job": 384, "pending": 64}}\n'
    )
    assert _token_counts(tmp_path) == (384, 64)
