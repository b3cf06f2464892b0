"""Declared faults under torchrun: a crash is emulated in place (its worker's process, which
torchrun's agent must not see die, loses its state and waits outside the quorum), on the real
clock as on the virtual one, with one worker a process or two; the emulation gives every
method the numbers of a thread that keeps its state; and the memory pre-flight of a local
launch counts the processes standing by for a trace's joins.

The virtual clock under torchrun giving the numbers of one process is
tests/test_faults_processes.py's and tests/test_faults_placements.py's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import torchrun
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.faults.engine import WorkerFaults
from lowcomm.faults.run import supported_methods
from lowcomm.launch import device_memory
from lowcomm.launch.device_memory import check_worker_processes
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import check_process_memory
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.train.checkpoint import step_directory
from lowcomm.train.task import CorpusTask

STEPS = 8


def _config(out: Path, trace: Path, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method="diloco",
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=2),
        ),
        workers=3,
        workers_per_process=1,
        steps=STEPS,
        network="wan",
        clock="real",
        seconds_per_microbatch=None,
        progress=False,
        plot=False,
        out=str(out),
        faults=str(trace),
    )
    return with_options(config, **overrides)


@pytest.mark.parametrize("per_process", [1, 2])
def test_faults_under_torchrun_on_the_real_clock_pass_the_checks(
    per_process: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace.txt"
    workers = 3 if per_process == 1 else 4
    config = _config(tmp_path / "out", trace, workers=workers, workers_per_process=per_process)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    config.validate()  # (no refusal: a crash is emulated in place)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _states(out: Path, step: int, workers: int) -> list[dict[str, Any]]:
    directory = step_directory(out, step)
    return [torch.load(directory / f"rank{w}.pt", weights_only=True) for w in range(workers)]


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "per_process", "lost"), [(3, 1, 2), (4, 2, 1)])
def test_a_crash_under_torchrun_on_the_real_clock_loses_the_state_and_the_join_heals_it(
    workers: int, per_process: int, lost: int, tmp_path: Path
) -> None:
    """Worker ``lost`` crashes at step 2 and joins at step 5 (diloco, a sync every 2 steps):
    the survivors go on without it, the checkpoint between holds nothing of it (its process
    zeroed its parameters and its method's state), and after the last sync its parameters
    equal the others'. Every process ends well: torchrun's agent saw no worker die."""
    trace = tmp_path / "trace.txt"
    trace.write_text(f"step=2 worker={lost} crash\nstep=5 worker={lost} join\n")
    out = tmp_path / "out"
    flags = [
        "train", "--method", "diloco", "--workers", str(workers), "--workers-per-process",
        str(per_process), "--steps", str(STEPS), "--network", "wan", "--clock", "real",
        "--eval-every", "4", "--eval-batches", "2", "--log-every", "1", "--checkpoint-every",
        "4", "--keep-checkpoints", "3", "--progress", "False", "--plot", "False",
        "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "32",
        "--model.block-size", "16", "--micro-batch-size", "2", "--diloco.sync-every", "2",
        "--faults", str(trace), "--fault-detection-s", "0.05", "--out", str(out),
    ]  # fmt: skip
    processes = workers // per_process
    launched = subprocess.run(
        [*torchrun(tmp_path), "--standalone", "--nproc-per-node", str(processes), "-m",
         "lowcomm", *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["quorum"] for r in records] == [workers] * 2 + [workers - 1] * 3 + [workers] * 3
    assert records[2]["membership_events"] == [{"worker": lost, "kind": "crash"}]
    assert records[5]["membership_events"] == [{"worker": lost, "kind": "join"}]
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clock"] == "real"
    assert [c["step"] for c in summary["faults"]["membership_changes"]] == [2, 5]

    # Between the crash and the join: nothing of the lost worker survives; the others train.
    away = _states(out, 4, workers)
    for worker, state in enumerate(away):
        held = _tensors(state["model"]) + _tensors(state["strategy"])
        nonzero = [bool(t.count_nonzero()) for t in held if t.is_floating_point()]
        assert (not any(nonzero)) if worker == lost else any(nonzero), worker
    # After the last sync (step 7): the joiner, healed at step 5, holds the others' model.
    end = _states(out, STEPS, workers)
    for state in end:
        assert state["model"].keys() == end[0]["model"].keys()
        for name, tensor in state["model"].items():
            assert torch.equal(tensor, end[0]["model"][name]), name
    assert any(bool(t.count_nonzero()) for t in end[lost]["model"].values())


#: Methods that run in processes, where torchrun places them: all that take faults.
IN_PROCESSES = supported_methods()


def _numbers(out: Path) -> tuple[list[tuple[float, float | None, float]], dict[str, Any]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    rows = [(r["train_loss"], r["val_loss"], r["clock_s"]) for r in records]
    return rows, {"final_val_loss": summary["final_val_loss"], **summary["faults"]}


@pytest.mark.parametrize("method", IN_PROCESSES)
def test_a_crash_that_zeroes_its_state_in_place_changes_no_number(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulation under torchrun (the crashed worker zeroes its state where it stands)
    gives the numbers of a thread that keeps its state until its join: every method's join
    heals what it needs and starts the rest by its rule, so nothing of the lost worker is
    read. Run here with every worker a thread, the emulation switched on for them."""
    trace = tmp_path / "trace.txt"
    trace.write_text("step=2 worker=2 crash\nstep=5 worker=2 join\n")
    runs = []
    for in_place in (False, True):
        monkeypatch.setattr(WorkerFaults, "loses_state_in_place", in_place)
        out = tmp_path / str(in_place)
        config = _config(
            out, trace, workers_per_process=3, clock="virtual", seconds_per_microbatch=0.01,
            eval_every=4, eval_batches=2, log_every=1, fault_detection_s=2.5,
            checkpoint_every=4, keep_checkpoints=3,
        )  # fmt: skip
        config.local = LocalOptions(sync_every=2)
        if method == "streaming_diloco":  # (two fragments, each flying one step)
            config.model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
            config.diloco = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
        config.method = method
        config.validate()
        train_in_process(config)
        runs.append(_numbers(out))
        # (The checkpoint between the crash and the join holds what worker 2 kept.)
        kept = _states(out, 4, 3)[2]["model"].values()
        assert any(bool(t.count_nonzero()) for t in kept) is not in_place
    assert runs[1] == runs[0]


# --- the memory pre-flight of a local launch counts the standby processes -----------------


def _each(config: TrainConfig) -> tuple[int, float]:
    """The model's parameters and the floor of one worker process."""
    model = CorpusTask().shapes_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    each = check_worker_processes(config, parameters, free_bytes=lambda: 1e15)
    assert each is not None
    return parameters, each.total


def test_the_processes_standing_by_for_joins_count_in_the_memory_floor(tmp_path: Path) -> None:
    config = _config(tmp_path / "out", tmp_path / "trace.txt")
    parameters, each = _each(config)
    free = 3.5 * each  # (3 processes fit, 4 do not)
    assert check_worker_processes(config, parameters, free_bytes=lambda: free) is not None
    with pytest.raises(ConfigError) as caught:
        check_worker_processes(config, parameters, standbys=1, free_bytes=lambda: free)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "--workers 3: 4 worker processes (3 and 1 standing by for the joins of the --faults "
        "trace) on this machine need at least "
    )
    assert "at most 2 workers fit: pass --workers 2" in message


def test_the_launch_counts_a_standby_for_each_join_after_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace.txt"
    config = _config(tmp_path / "out", trace)
    _, each = _each(config)
    monkeypatch.setattr(device_memory, "available_host_bytes", lambda: 3.5 * each)
    trace.write_text("step=2 worker=2 crash\n")  # (no join: no standby, 3 processes fit)
    check_process_memory(config, CorpusTask())
    trace.write_text("step=2 worker=2 crash\nstep=5 worker=2 join\n")
    with pytest.raises(ConfigError, match=r"^--workers 3: 4 worker processes \(3 and 1 standing"):
        check_process_memory(config, CorpusTask())
