"""Declared faults on the real clock, every worker a thread of one process: the events at
their step or at wall-clock times, a crash's detection really waited, a slow worker really
slowed, a link event stretching the real wait, and a quorum below the minimum waited for
for real. Tiny times; every bound here is one a sleep guarantees (a sleep of d takes at
least d), never a speed claim."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight
from lowcomm.models import ModelConfig
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.train.checkpoint import step_directory

WORKERS = 3
DETECTION_S = 0.05


def _config(method: str, out: Path, trace: Path, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method=method,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=2),
        ),
        workers=WORKERS,
        workers_per_process=WORKERS,
        steps=8,
        network="wan",
        clock="real",
        eval_every=4,
        eval_batches=2,
        log_every=1,
        progress=False,
        plot=False,
        out=str(out),
        faults=str(trace),
        fault_detection_s=DETECTION_S,
    )
    return with_options(config, **overrides)


def _run(config: TrainConfig) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    config.validate()
    preflight(config)
    train_in_process(config)
    out = Path(str(config.run.out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = out / "summary.json"
    return records, json.loads(summary.read_text()) if summary.exists() else None


def _trace(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.txt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_crash_and_a_join_by_step_run_on_the_real_clock(method: str, tmp_path: Path) -> None:
    trace = _trace(
        tmp_path,
        "step=2 worker=2 crash\nstep=5 worker=2 join\nstep=1 worker=0 slow factor=3 for=2\n",
    )
    records, summary = _run(_config(method, tmp_path / "out", trace))
    assert summary is not None and summary["clock"] == "real"
    assert [r["quorum"] for r in records] == [3, 3, 2, 2, 2, 3, 3, 3]
    assert records[2]["membership_events"] == [{"worker": 2, "kind": "crash"}]
    assert records[5]["membership_events"] == [{"worker": 2, "kind": "join"}]
    faults = summary["faults"]
    assert [c["step"] for c in faults["membership_changes"]] == [2, 5]
    if method == "ddp":  # the step is dropped, its survivors really wait the detection
        assert records[2]["dropped"] is True and faults["rounds_dropped"] == 1
        assert min(records[2]["exposed_comm_s_per_worker"]) >= DETECTION_S
        assert faults["committed_tokens"] == 32 * (21 - 2)  # (21 worker-steps, less the dropped)
    else:  # (the survivors wait for the detection at the sync of the crash's round)
        assert "dropped" not in records[2] and faults["rounds_dropped"] == 0
    assert faults["goodput"] is not None and faults["goodput"] > 0


def test_membership_events_at_wall_clock_times_land_on_the_first_step_after_them(
    tmp_path: Path,
) -> None:
    crash_at, join_at = 0.15, 0.4
    trace = _trace(tmp_path, f"t={crash_at} worker=1 crash\nt={join_at} worker=1 join\n")
    records, summary = _run(_config("ddp", tmp_path / "out", trace, steps=30))
    landed = {
        event["kind"]: record["step"]
        for record in records
        for event in record.get("membership_events") or []
    }
    assert set(landed) == {"crash", "join"} and landed["crash"] < landed["join"]
    for kind, at in (("crash", crash_at), ("join", join_at)):
        step = landed[kind]
        # (The step starts at or after the event, on the run's real clock; the one before
        # it started before the event.)
        assert records[step]["clock_s"] >= at
        if step >= 2:
            assert records[step - 2]["clock_s"] < at
    assert summary is not None


def test_a_quorum_below_the_minimum_is_waited_for_for_real(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    join_at = 0.5
    trace = _trace(
        tmp_path, f"t=0.05 worker=1 crash\nt=0.05 worker=2 crash\nt={join_at} worker=1 join\n"
    )
    records, summary = _run(
        _config("ddp", tmp_path / "out", trace, fault_min_workers=2, fault_quorum_wait_s=30.0)
    )
    waited = next(r for r in records if r.get("membership_events"))
    assert [e["kind"] for e in waited["membership_events"]] == ["crash", "crash", "join"]
    assert waited["clock_s"] >= join_at and waited["quorum"] == 2
    said = capfd.readouterr().out
    assert "waiting for worker 1, 2" in said and "a quorum of 2 formed after waiting" in said
    assert summary is not None


def test_a_quorum_that_does_not_form_in_the_wait_ends_with_a_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path, "t=0.05 worker=1 crash\nt=0.05 worker=2 crash\nt=60 worker=1 join\n")
    out = tmp_path / "out"
    records, summary = _run(
        _config("ddp", out, trace, fault_min_workers=2, fault_quorum_wait_s=0.2)
    )
    assert summary is None and step_directory(out, len(records)).is_dir()
    lines = [line for line in capfd.readouterr().out.splitlines() if "no quorum" in line]
    assert len(lines) == 1 and f"lowcomm train --resume {out}" in lines[0]


def test_link_events_on_a_gpus_real_clock_are_refused_in_one_line(tmp_path: Path) -> None:
    from lowcomm.faults.run import run_trace
    from lowcomm.faults.trace import TraceError

    trace = _trace(tmp_path, "step=1 worker=1 crash\nt=0.5 link factor=0.5 for=1\n")
    config = _config("ddp", tmp_path / "out", trace, device="cuda")
    with pytest.raises(TraceError, match="link events are not yet modeled") as caught:
        run_trace(config)
    assert "\n" not in str(caught.value)
    assert run_trace(with_options(config, device="cpu")) is not None


def test_a_degraded_link_stretches_each_real_transfer(tmp_path: Path) -> None:
    from lowcomm.comm.base import CollectiveKind
    from lowcomm.train.context import network_profile

    factor = 0.25
    trace = _trace(tmp_path, f"t=0 link factor={factor}\n")
    # (A slow link: the transfers, not the compute, make the steps' time.)
    config = _config("ddp", tmp_path / "out", trace, steps=3, bandwidth_gbps=0.07)
    records, _ = _run(config)
    # (A ring all-reduce sends 2 (M-1)/M of its payload; ddp sends one a step. The link
    # carries one transfer at a time, so step s ends after s + 1 stretched transfers.)
    payload = round(records[0]["bytes_sent_per_worker"] * WORKERS / (2 * (WORKERS - 1)))
    cost = network_profile(config.comm).collective_time(CollectiveKind.ALL_REDUCE, payload, WORKERS)
    for record in records:
        assert record["clock_s"] >= (record["step"] + 1) * cost / factor
