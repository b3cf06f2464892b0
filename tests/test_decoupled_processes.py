"""decoupled_diloco with its learners in worker processes (``--workers-per-process 1``, or 2
threads in each of 2 processes; each learner keeps a replica of the synchronizer): the same
run gives the numbers of the run with every learner a thread of one process (losses to 1e-6,
modeled times to 1e-9 s, bytes equal), without faults, with a trace of a crash, a join and a
straggler, and stopped mid-trace and resumed in processes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.launch.run import run_training
from lowcomm.models import ModelConfig
from lowcomm.strategies.decoupled_diloco import DecoupledOptions

WORKERS = 3
STEPS = 12

#: Worker 2 crashes while its first fragment is in flight (its process is killed), a process
#: started at launch takes its slot at the join and is healed from a live learner's
#: synchronizer, and worker 0 runs 3x slower for a while, so merges go without it and its
#: fragments come late.
TRACE = """\
# when    worker    what
step=3    worker=2  crash
step=7    worker=2  join
step=1    worker=0  slow factor=3 for=5
"""


def _config(
    out: Path, *, processes: bool, trace: Path | None, workers: int = WORKERS, per_process: int = 1
) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method="decoupled_diloco",
            model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
        ),
        workers=workers, workers_per_process=per_process if processes else workers, steps=STEPS,
        network="wan", clock="virtual", seconds_per_microbatch=0.01, eval_every=4,
        eval_batches=2, log_every=1, progress=False, plot=False, out=str(out),
        decoupled=DecoupledOptions(sync_every=4, fragments=2),
    )  # fmt: skip
    if trace is not None:
        config.fault.faults, config.fault.fault_detection_s = str(trace), 2.5
    return config


def _run(config: TrainConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    summary = run_training(config, report=None)
    assert summary is not None
    out = Path(str(config.run.out))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], summary


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))


def _same_numbers(
    got: tuple[list[dict[str, Any]], dict[str, Any]],
    want: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    """Per-step losses to 1e-6, modeled times to 1e-9 s, the same learners stepping, quorums,
    membership events and bytes, and the same summary (times, losses, tokens, faults)."""
    assert [r["step"] for r in got[0]] == [r["step"] for r in want[0]] == list(range(STEPS))
    for g, w in zip(got[0], want[0], strict=True):
        for name in ("train_loss", "val_loss"):
            assert _close(g[name], w[name]), (name, g, w)
        assert abs(g["clock_s"] - w["clock_s"]) <= 1e-9, (g, w)
        for name in ("microbatches_per_worker", "bytes_sent_per_worker", "quorum",
                     "membership_events", "committed_steps"):  # fmt: skip
            assert g.get(name) == w.get(name), (name, g, w)
    summary, expected = got[1], want[1]
    assert _close(summary["final_val_loss"], expected["final_val_loss"])
    for name in ("modeled_time_s", "compute_s", "exposed_comm_s"):
        assert abs(summary[name] - expected[name]) <= 1e-9, name
    for name in ("tokens", "committed_tokens", "bytes_sent_per_worker", "bytes_by_role"):
        assert summary[name] == expected[name], name
    for name, values in expected["per_worker"].items():
        for g, w in zip(summary["per_worker"][name], values, strict=True):
            assert abs(g - w) <= 1e-9, (name, summary["per_worker"][name], values)
    faults = summary.get("faults")
    assert (faults is None) == (expected.get("faults") is None)
    if faults is not None:
        assert faults.keys() == expected["faults"].keys()
        for key, value in expected["faults"].items():
            if isinstance(value, float):
                assert math.isclose(faults[key], value, rel_tol=1e-9, abs_tol=1e-9), key
            else:
                assert faults[key] == value, key


@pytest.mark.slow
def test_learners_in_processes_give_the_numbers_of_one_process(tmp_path: Path) -> None:
    threads = _run(_config(tmp_path / "threads", processes=False, trace=None))
    processes = _run(_config(tmp_path / "processes", processes=True, trace=None))
    _same_numbers(processes, threads)
    # The learners exchanged: fragments went up and replies came back on every link.
    roles = processes[1]["bytes_by_role"]
    assert roles["pseudo_gradient"] > 0 and roles["parameter"] == roles["pseudo_gradient"]
    assert all(sent > 0 for sent in processes[1]["per_worker"]["bytes_sent"])


@pytest.mark.slow
def test_a_trace_in_processes_gives_the_numbers_of_one_process(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    threads = _run(_config(tmp_path / "threads", processes=False, trace=trace))
    processes = _run(_config(tmp_path / "processes", processes=True, trace=trace))
    _same_numbers(processes, threads)
    # The trace took effect: two learners from the crash to the join, and the straggler
    # stepped at fewer ticks than the others while slow.
    assert [r["quorum"] for r in processes[0]] == [3, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3, 3]
    assert {"worker": 2, "kind": "join"} in processes[0][7]["membership_events"]
    assert any(len(r["microbatches_per_worker"]) < r["quorum"] for r in processes[0][1:6])
    assert 0 < processes[1]["faults"]["goodput"] < 1


#: On four workers: a crash, a leave and its rejoin (the learner keeps its process and its
#: stale replica, which the heal replaces) landing with the crashed slot's join.
LEAVE_TRACE = """\
step=2  worker=2  crash
step=3  worker=1  leave
step=6  worker=1  rejoin
step=6  worker=2  join
step=7  worker=3  slow factor=2 for=3
"""


@pytest.mark.slow
def test_a_leave_and_its_rejoin_in_processes_give_the_numbers_of_one_process(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(LEAVE_TRACE)
    runs = [
        _run(_config(tmp_path / str(p), processes=p, trace=trace, workers=4)) for p in (False, True)
    ]
    _same_numbers(runs[1], runs[0])
    assert [r["quorum"] for r in runs[1][0]] == [4, 4, 3, 2, 2, 2, 4, 4, 4, 4, 4, 4]


@pytest.mark.slow
def test_two_learners_in_each_of_two_processes_give_the_numbers_of_one_process(
    tmp_path: Path,
) -> None:
    """K = 2 threads in each of 2 processes: each learner keeps its own replica (its process's
    other learner is fed over the group like the remote ones); a crash stops a thread, not
    its process."""
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE.replace("worker=2", "worker=3"))
    runs = [
        _run(_config(tmp_path / str(k), processes=k < 4, trace=trace, workers=4, per_process=k))
        for k in (4, 2)
    ]
    _same_numbers(runs[1], runs[0])
    assert [r["quorum"] for r in runs[1][0]] == [4, 4, 4, 3, 3, 3, 3, 4, 4, 4, 4, 4]


@pytest.mark.slow
def test_a_run_in_processes_stopped_mid_trace_and_resumed_gives_the_uninterrupted_numbers(
    tmp_path: Path,
) -> None:
    """Stopped after step 5 (worker 2's process killed, its slot vacant, fragments in
    flight), every process resumed from its own checkpoint of its replica: the run without a
    stop, in one process."""
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    whole = _run(_config(tmp_path / "whole", processes=False, trace=trace))
    out = tmp_path / "resumed"
    config = _config(out, processes=True, trace=trace)
    config.run.stop_after = 5
    assert run_training(config, report=None) is None  # (stopped, with a checkpoint)
    config = _config(out, processes=True, trace=trace)
    config.run.resume = str(out)
    _same_numbers(_run(config), whole)


@pytest.mark.slow
def test_a_finished_run_in_processes_extended_with_more_steps_merges_to_its_new_end(
    tmp_path: Path,
) -> None:
    """A finished run of 12 steps resumed with --steps 24: each process's replica of the
    synchronizer comes back from the final checkpoint, drained at the old end, and merges
    again. The extension in processes gives the same extension's numbers in one process,
    with fragments merged after step 12 and every loss finite."""
    runs = []
    for name, processes in (("threads", False), ("processes", True)):
        out = tmp_path / name
        _run(_config(out, processes=processes, trace=None))
        config = _config(out, processes=processes, trace=None)
        config.run.steps, config.run.resume = 2 * STEPS, str(out)
        runs.append(_run(config)[0])
    threads, processes = runs
    assert [r["step"] for r in processes] == [r["step"] for r in threads] == list(range(2 * STEPS))
    for got, want in zip(processes, threads, strict=True):
        assert _close(got["train_loss"], want["train_loss"]), (got, want)
        assert math.isfinite(got["train_loss"]) and got["extras"] == want["extras"], (got, want)
    assert any(r["extras"]["syncs_completed"] for r in processes if r["step"] >= STEPS + 2)
