"""A fault trace replayed on the live worker processes of a --membership torchft job: the
launcher SIGKILLs a worker at its crash, starts a new one at its join, and reports the job's
goodput."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.membership.options import MembershipOptions
from lowcomm.membership.replay import (
    Channel,
    Replay,
    WorkerReplay,
    check_replay,
    job_goodput,
    link_time,
)
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


def test_link_time_follows_the_traces_link_events(tmp_path: Path) -> None:
    config = _config(tmp_path, "step=4 link factor=0.25 for=2\nt=10 link down for=5\n")
    trace = check_replay(config)  # (link events are replayed, not refused)
    assert trace is not None
    assert link_time(trace, 3, 0.0, 1.0) == 1.0
    assert link_time(trace, 4, 0.0, 1.0) == 4.0  # (cost / F while degraded)
    assert link_time(trace, 5, 0.0, 1.0) == 4.0
    assert link_time(trace, 6, 0.0, 1.0) == 1.0
    assert link_time(trace, 0, 12.0, 1.0) == 4.0  # (waits for the link up at 15, then 1)
    assert link_time(trace, 4, 12.0, 1.0) == 7.0


def test_a_workers_link_reads_the_trace_on_the_jobs_run_time(tmp_path: Path) -> None:
    import multiprocessing
    import time

    config = _config(tmp_path, "t=140 link down for=20\n")
    trace = check_replay(config)
    assert trace is not None
    channel = Channel.make(multiprocessing.get_context("spawn"), 3)
    channel.started.value = time.time() - 100.0  # (the job trained 100 s; its trace is at
    channel.before.value = 30.0  # 130 s with the 30 s of the job it resumed)
    model = WorkerReplay(channel, trace, slot=0).link_model(lambda: 50.0)
    # A transfer at the worker's clock 60 starts at run time ~140, in the down link: it
    # waits ~20 s for it, then takes its cost.
    assert model(60.0, 1.0) == pytest.approx(21.0, abs=1.0)
    assert model(40.0, 1.0) == 1.0  # (at run time ~120: the link is up)


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


def _launched(run: Path) -> list[tuple[str, int]]:
    job = json.loads((run / "membership.json").read_text())
    return [(e["event"], e["worker"]) for e in job["faults"]["launcher"]]


@pytest.mark.slow
def test_a_trace_kept_with_checkpoints_continues_where_it_stopped(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")
    from lowcomm.launch.run import run_training

    steps, stop = 88, 80
    trace = (
        "step=2 worker=1 crash\nstep=4 worker=1 join\nstep=6 worker=2 crash\n"
        "step=84 worker=1 crash\n"
    )
    run = tmp_path / "run"
    config = _config(run, trace, steps=steps, stop_after=stop)
    assert run_training(config, report=None) is None
    # The job stopped at step 80: the events before it happened, the crash after it did not,
    # and slot 1's live worker (its second process) wrote its checkpoint; slot 2 was dead.
    assert _launched(run) == [("crash", 1), ("join", 1), ("crash", 2)]
    for directory in ("worker0", "worker1.1"):
        latest = (run / directory / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step-{stop:06d}", directory
    stopped = tmp_path / "stopped"
    shutil.copytree(run, stopped)

    resumed = with_options(config, resume=str(run), stop_after=None, out=None)
    summary = run_training(resumed, report=None)
    assert summary is not None
    # Resumed at 80: only the crash at step 84 happens, in slot 1's continued process; slot 2
    # starts no worker, and the two that start begin together from their own checkpoints.
    assert _launched(run) == [("crash", 1)]
    job = json.loads((run / "membership.json").read_text())
    codes = {slot: [p["exit_code"] for p in runs] for slot, runs in job["workers"].items()}
    assert codes == {"0": [0], "1": [-9]}, codes
    # (The stopped job's own record is kept in the resumed job's, launches and all.)
    assert job["parts"] == [json.loads((stopped / "membership.json").read_text())]
    for directory in ("worker0", "worker1.1"):
        events = json.loads((run / directory / "membership.json").read_text())["events"]
        # (Slot 1's second process healed at its join, before the stop; no one after it.)
        assert not [e for e in events if e["event"] == "healed" and e["step"] >= stop], directory
        # The records of the steps before the stop are the stopped job's, quorum changes and
        # all: metrics.jsonl's lines and membership.json's events.
        before = json.loads((stopped / directory / "membership.json").read_text())["events"]
        assert [e for e in events if e["step"] < stop] == before, directory
        lines = _lines(run / directory / "metrics.jsonl")
        assert [r for r in lines if r["step"] < stop] == _lines(
            stopped / directory / "metrics.jsonl"
        )
    changes = [r for r in _lines(stopped / "worker0" / "metrics.jsonl") if "membership_events" in r]
    assert changes  # (slot 1's crash and join, slot 2's crash)
    # worker0's summary.json lists every quorum change of the job, before the stop and after.
    listed = json.loads((run / "worker0" / "summary.json").read_text())["faults"]
    listed = listed["membership_changes"]
    assert [c["step"] for c in listed][: len(changes)] == [r["step"] for r in changes]
    assert [c["events"] for c in listed][: len(changes)] == [
        r["membership_events"] for r in changes
    ]
    assert [Path(p["run"]).name for p in job["workers"]["1"]] == ["worker1.1"]
    # (Slot 1's process continued its directory from step 80 and was killed at 84.)
    assert [r["step"] for r in _lines(run / "worker1.1" / "metrics.jsonl")][-4:] == [80, 81, 82, 83]
    assert [r["step"] for r in _lines(run / "worker0" / "metrics.jsonl")][-1] == steps - 1
    assert job["replayed"]["step"] == steps


@pytest.mark.slow
def test_a_traces_link_events_slow_the_live_workers_link(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")
    from lowcomm.launch.run import run_training

    # (The virtual clock: each sync's exposed time is the link's model, so it is exact.)
    trace = "step=4 link factor=0.25 for=4\n"
    config = _config(
        tmp_path / "run", trace, steps=12, clock="virtual", seconds_per_microbatch=0.01
    )
    assert run_training(config, report=None) is not None
    for slot in range(3):
        comm = {
            r["step"]: r["exposed_comm_s"]
            for r in _lines(tmp_path / "run" / f"worker{slot}" / "metrics.jsonl")
        }
        assert comm[3] > 0
        # The sync at step 7 ran on the link degraded to 1/4 (steps 4 to 7); 11's did not.
        assert comm[7] == pytest.approx(4 * comm[3], rel=1e-6), slot
        assert comm[11] == pytest.approx(comm[3], rel=1e-6), slot


def test_a_resumed_replay_meets_only_the_events_after_the_stop(tmp_path: Path) -> None:
    import multiprocessing

    trace = "step=2 worker=2 crash\nstep=8 worker=2 join\nstep=9 worker=1 crash\n"
    config = _config(tmp_path, trace, steps=12)
    found = check_replay(config)
    assert found is not None
    channel = Channel.make(multiprocessing.get_context("spawn"), 3)
    # Stopped at step 8 with slot 2 dead: the join at 8 and the crash at 9 are still to come.
    replay = Replay(found, channel, 3, since=(8, 4.0), first=[0, 1])
    assert [(e.kind, e.worker, e.at) for e in replay.pending] == [("join", 2, 8), ("crash", 1, 9)]
    assert channel.before.value == 4.0  # (the workers' run time continues the stopped job's)
    # Training starts once the slots that have a worker are past their startup round.
    channel.steps[0] = channel.steps[1] = 8
    assert replay.training_started() is not None
