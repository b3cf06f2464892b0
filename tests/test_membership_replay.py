"""A fault trace replayed on the live worker processes of a --membership torchft job: the
launcher SIGKILLs a worker at its crash, starts a new one at its join, and reports the job's
goodput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.membership.options import MembershipOptions
from lowcomm.membership.replay import check_replay, job_goodput
from lowcomm.models import ModelConfig
from lowcomm.strategies.diloco import DiLoCoOptions

TOKENS_PER_STEP = 2 * 16  # (micro-batch 2 of a 16-token block, one micro-batch per step)


def _config(out: Path, trace: str, steps: int = 8, **overrides: Any) -> TrainConfig:
    path = out / "trace.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace)
    config = with_options(
        TrainConfig(
            method="diloco", model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2), diloco=DiLoCoOptions(sync_every=4),
        ),
        workers=3, steps=steps, clock="real", network="wan", latency_ms=200.0,
        eval_every=1000, eval_batches=2, progress=False, plot=False, out=str(out), log_every=1,
        membership="torchft", faults=str(path),
        membership_options=MembershipOptions(detect_s=2.0, quorum_s=60.0, digests=True),
    )  # fmt: skip
    config = with_options(config, **overrides)
    config.validate()
    return config


def test_link_events_are_refused_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, "t=1 link factor=0.5 for=2\n")
    with pytest.raises(ConfigError) as caught:
        check_replay(config)
    message = str(caught.value)
    assert "link events are not yet replayed with --membership torchft" in message
    assert "\n" not in message


def test_a_cluster_worker_does_not_replay_a_trace(tmp_path: Path) -> None:
    config = _config(tmp_path, "step=2 worker=1 crash\n")
    config.placement.membership_options = MembershipOptions(lighthouse="127.0.0.1:1", worker=0)
    with pytest.raises(ConfigError, match="local launcher replays a trace"):
        check_replay(config)
    from lowcomm.membership.local import run_membership

    with pytest.raises(ConfigError, match="local launcher replays a trace"):
        run_membership(config)


def test_job_goodput_is_committed_over_fault_free_tokens(tmp_path: Path) -> None:
    config = _config(tmp_path, "step=2 worker=1 crash\n")
    records = [
        {"committed_tokens": 640, "clean_step_s": 1.0, "clean_steps": 10, "trained_until": 110.0},
        {"committed_tokens": 320, "clean_step_s": 1.0, "clean_steps": 10, "trained_until": 105.0},
        {"committed_tokens": 64, "clean_step_s": 0.0, "clean_steps": 0, "trained_until": None},
    ]
    figures = job_goodput(config, records, started=100.0)
    # 3 workers x 32 tokens a step over 10 s at 0.1 s a step: 9600 tokens with no fault.
    assert figures["committed_tokens"] == 1024
    assert figures["fault_free_step_s"] == pytest.approx(0.1)
    assert figures["run_s"] == pytest.approx(10.0)
    assert figures["goodput"] == pytest.approx(1024 / 9600)
    assert figures["worker_seconds_lost"] == pytest.approx(3 * 10.0 * (1 - 1024 / 9600))
    assert job_goodput(config, records, started=None)["goodput"] is None


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_trace_kills_at_its_crash_and_starts_a_worker_at_its_join(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")
    from lowcomm.launch.run import run_training

    steps = 160
    trace = "step=10 worker=2 crash\nstep=20 worker=2 join\nstep=4 worker=1 slow factor=2 for=2\n"
    config = _config(tmp_path / "run", trace, steps=steps)
    summary = run_training(config, report=None)
    assert summary is not None
    job = json.loads((tmp_path / "run" / "membership.json").read_text())
    codes = {slot: [p["exit_code"] for p in runs] for slot, runs in job["workers"].items()}
    assert codes == {"0": [0], "1": [0], "2": [-9, 0]}, codes
    run = tmp_path / "run"
    # The kill landed at the crash's step: the dead worker trained steps 0 to 9.
    assert [r["step"] for r in _lines(run / "worker2" / "metrics.jsonl")] == list(range(10))
    launcher = job["faults"]["launcher"]
    assert [(e["event"], e["worker"]) for e in launcher] == [("crash", 2), ("join", 2)]
    assert max(launcher[1]["live_steps"]) >= 20  # (started once the live workers reached it)
    # The survivors record the quorum changes in metrics.jsonl, as a simulated run does.
    events = [
        r["membership_events"]
        for r in _lines(run / "worker0" / "metrics.jsonl")
        if "membership_events" in r
    ]
    assert events == [[{"worker": 2, "kind": "crash"}], [{"worker": 2, "kind": "join"}]]
    # Committed tokens: every step of the survivors, the dead worker's rounds committed
    # before its crash (steps 0 to 7: syncs at 3 and 7), and the joiner's steps after the
    # sync it healed in and sat out.
    joiner = json.loads((run / "worker2.1" / "membership.json").read_text())
    healed = next(e for e in joiner["events"] if e["event"] == "healed")["step"]
    expected = (2 * steps + 8 + (steps - healed - 1)) * TOKENS_PER_STEP
    faults = job["faults"]
    assert faults["committed_tokens"] == expected
    # (Measured on the wall clock: the fault-free step time is the mean of the clean steps,
    # which load on the machine moves, so the ratio is positive but not bounded by 1.)
    assert faults["goodput"] > 0
    assert summary["faults"]["goodput"] == faults["goodput"]
    for directory in ("worker0", "worker1", "worker2.1"):
        own = json.loads((run / directory / "summary.json").read_text())["faults"]
        assert own["goodput"] == faults["goodput"] and own["scope"] == "job"
    # The joiner's data continued where its slot's would be: no sample twice in the pass.
    assert joiner["data_position"] == steps
