"""Checkpoints of a run with declared faults: a run stopped mid-trace and resumed gives the
uninterrupted run bit for bit (losses, modeled time, summary.json's faults block, the final
parameters), wherever the checkpoint falls in the trace; a resume replays only the trace it
was written with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.faults.run import supported_methods
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.decoupled_diloco import DecoupledOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions

WORKERS = 3


def _config(method: str, out: Path, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method=method,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=2),
            local=LocalOptions(sync_every=2),
            desloc=DeslocOptions(param_period=2),
            sparseloco=SparseLoCoOptions(sync_every=2),
            decoupled=DecoupledOptions(sync_every=2),
        ),
        workers=WORKERS,
        workers_per_process=WORKERS,
        steps=8,
        network="wan",
        clock="virtual",
        seconds_per_microbatch=0.01,
        eval_every=4,
        eval_batches=3,
        log_every=1,
        progress=False,
        plot=False,
        out=str(out),
        fault_detection_s=2.5,
    )
    if method == "sparta_diloco":  # (a round of 2 steps; a tenth of the parameters a step)
        config.sparta = SpartaOptions(sync_every=2, fraction=0.1)
    if method in ("streaming_diloco", "cocodc"):  # (two fragments, each flying one step)
        config.model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
        config.diloco = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
    return with_options(config, **overrides)


def _run(config: TrainConfig) -> tuple[list[dict[str, Any]], dict[str, Any], list[torch.Tensor]]:
    config.validate()
    preflight(config)
    summaries = train_in_process(config, keep_parameters=True)
    out = Path(str(config.run.out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return records, summary, [s.parameters for s in summaries if s.parameters is not None]


def _stopped_and_resumed(
    method: str, out: Path, stop_after: int, **overrides: Any
) -> tuple[list[dict[str, Any]], dict[str, Any], list[torch.Tensor]]:
    config = _config(method, out, stop_after=stop_after, **overrides)
    config.validate()
    preflight(config)
    train_in_process(config)
    assert (out / "checkpoints").is_dir()
    return _run(_config(method, out, resume=str(out), **overrides))


def _assert_same_run(
    resumed: tuple[list[dict[str, Any]], dict[str, Any], list[torch.Tensor]],
    whole: tuple[list[dict[str, Any]], dict[str, Any], list[torch.Tensor]],
) -> None:
    assert resumed[0] == whole[0]  # every step's losses, clock, quorum and events
    assert resumed[1]["faults"] == whole[1]["faults"]
    assert resumed[1]["modeled_time_s"] == whole[1]["modeled_time_s"]
    assert resumed[1]["final_val_loss"] == whole[1]["final_val_loss"]
    assert resumed[1]["committed_tokens"] == whole[1]["committed_tokens"]
    assert len(resumed[2]) == len(whole[2]) == WORKERS
    for a, b in zip(resumed[2], whole[2], strict=True):
        assert torch.equal(a, b)


CRASH_AND_JOIN = (
    "step=2 worker=2 crash\nstep=5 worker=2 join\nstep=1 worker=0 slow factor=3 for=2\n"
)


@pytest.mark.parametrize("method", supported_methods())
def test_a_run_resumed_mid_trace_gives_the_uninterrupted_run_bit_for_bit(
    method: str, tmp_path: Path
) -> None:
    # (After 3 steps worker 2 is dead and, for a sync-round method, its crash not yet
    # detected; after 5, it joins at the next step. A sync in flight at a crash is dropped.)
    trace = tmp_path / "trace.txt"
    trace.write_text(CRASH_AND_JOIN)
    whole = _run(_config(method, tmp_path / "whole", faults=str(trace)))
    assert whole[1]["faults"]["membership_changes"]  # (the trace acted)
    for stop_after in (3, 5):
        out = tmp_path / f"resumed-{stop_after}"
        _assert_same_run(_stopped_and_resumed(method, out, stop_after, faults=str(trace)), whole)


@pytest.mark.parametrize(
    ("method", "crash"),
    [("eager", 2), ("diloco_delayed", 2), ("co2", 2), ("streaming_diloco", 3), ("cocodc", 2)],
)
def test_an_exchange_that_failed_before_the_checkpoint_stays_failed_once_its_quorum_is_back(
    method: str, crash: int, tmp_path: Path
) -> None:
    # (The exchange in flight at the crash fails; the replacement joins the step after, so
    # the resumed run's quorum is whole again and cannot tell the failure from the members.)
    trace = tmp_path / "trace.txt"
    trace.write_text(f"step={crash} worker=2 crash\nstep={crash + 1} worker=2 join\n")
    whole = _run(_config(method, tmp_path / "whole", faults=str(trace)))
    assert whole[1]["faults"]["rounds_dropped"] >= 1  # (an exchange failed)
    for stop_after in (crash, crash + 1):
        out = tmp_path / f"resumed-{stop_after}"
        _assert_same_run(_stopped_and_resumed(method, out, stop_after, faults=str(trace)), whole)


def test_a_worker_that_left_before_the_checkpoint_rejoins_with_its_own_state(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("step=1 worker=1 leave\nstep=6 worker=1 rejoin\n")
    whole = _run(_config("diloco", tmp_path / "whole", faults=str(trace)))
    resumed = _stopped_and_resumed("diloco", tmp_path / "resumed", 4, faults=str(trace))
    _assert_same_run(resumed, whole)


def test_a_trace_placed_by_time_resumes_from_its_cursor(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("t=0.02 worker=1 crash\nt=2.6 worker=1 join\n")
    whole = _run(_config("ddp", tmp_path / "whole", faults=str(trace)))
    events = [r["step"] for r in whole[0] if "membership_events" in r]
    assert len(events) == 2 and events[0] < 3 < events[1]  # (the checkpoint falls between)
    resumed = _stopped_and_resumed("ddp", tmp_path / "resumed", 3, faults=str(trace))
    _assert_same_run(resumed, whole)


def test_a_generated_trace_grown_past_its_first_horizon_resumes_alike(tmp_path: Path) -> None:
    from lowcomm.faults.run import FIRST_HORIZON_MTBFS

    options: dict[str, Any] = {
        "fault_mtbf_s": 0.6, "fault_replace_after_s": 0.005, "fault_seed": 1,
        "fault_detection_s": 0.0, "steps": 40, "seconds_per_microbatch": 0.1,
    }  # fmt: skip
    whole = _run(_config("diloco", tmp_path / "whole", **options))
    assert whole[1]["modeled_time_s"] > FIRST_HORIZON_MTBFS * 0.6  # (grown)
    assert len(whole[1]["faults"]["membership_changes"]) >= 2
    grown = next(r["step"] for r in whole[0] if r["clock_s"] > FIRST_HORIZON_MTBFS * 0.6)
    assert grown < 36  # (the checkpoint holds the grown trace's cursor)
    resumed = _stopped_and_resumed("diloco", tmp_path / "resumed", 36, **options)
    _assert_same_run(resumed, whole)


def test_a_resume_with_a_changed_trace_file_is_refused_naming_both_digests(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(CRASH_AND_JOIN)
    out = tmp_path / "out"
    config = _config("ddp", out, faults=str(trace), stop_after=3)
    config.validate()
    preflight(config)
    train_in_process(config)
    before = "sha256:" + hashlib.sha256(trace.read_bytes()).hexdigest()
    trace.write_text(CRASH_AND_JOIN.replace("step=5", "step=6"))
    after = "sha256:" + hashlib.sha256(trace.read_bytes()).hexdigest()
    resumed = _config("ddp", out, faults=str(trace), resume=str(out))
    resumed.validate()
    with pytest.raises(ConfigError) as caught:
        preflight(resumed)
    message = str(caught.value)
    assert "\n" not in message and before in message and after in message


def test_a_checkpoint_with_faults_is_not_resumed_without_them(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(CRASH_AND_JOIN)
    out = tmp_path / "out"
    config = _config("ddp", out, faults=str(trace), stop_after=3)
    config.validate()
    preflight(config)
    train_in_process(config)
    resumed = _config("ddp", out, resume=str(out))
    resumed.validate()
    with pytest.raises(ConfigError, match="faults"):
        preflight(resumed)
