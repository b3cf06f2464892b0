"""Declared faults with one process per worker: the same trace gives the numbers of the run
with every worker a thread of one process (losses, modeled times, the faults block), launched
locally or by torchrun; a worker may end by a planned SIGKILL while its peers go on; and what
does not run with faults in processes is refused in one line."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from _faults import (
    Run,
    generated_faults,
    same_numbers,
    stopped_and_resumed,
    tiny_config,
    trace_file,
    trained,
    under_torchrun,
)
from lowcomm.comm import Role
from lowcomm.comm.torch_comm import QuorumTorchComm
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.launch.spawn import WorkerFailed, end_by_sigkill, spawn_workers
from lowcomm.models import ModelConfig
from lowcomm.strategies.diloco import DiLoCoOptions

WORKERS = 3

#: A crash, its replacement's join a few steps later, and a straggler: each round's quorum
#: changes twice, the joiner is healed, and the straggler's factor stretches its compute.
TRACE = """\
# when    worker    what
step=2    worker=2  crash
step=5    worker=2  join
step=1    worker=0  slow factor=3 for=3
"""


def _config(
    method: str, out: Path, trace: Path, *, processes: bool, workers: int = WORKERS
) -> TrainConfig:
    config = tiny_config(
        method, out, trace, workers=workers, workers_per_process=1 if processes else workers,
        eval_batches=2,
    )  # fmt: skip
    if method == "streaming_diloco":  # (two fragments, each flying one step)
        config.model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
        config.diloco = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
    return config


def _same_numbers(run: Run, reference: Run) -> None:
    """:func:`same_numbers`, a NaN loss on either side a difference."""
    same_numbers(run, reference, nan_equal=False)


@pytest.mark.parametrize(
    "method", ["ddp", "diloco", "local_adamw", "eager", "diloco_delayed", "co2"]
)
def test_the_same_trace_in_one_process_and_in_processes_gives_the_same_numbers(
    method: str, tmp_path: Path
) -> None:
    trace = trace_file(tmp_path, TRACE)
    threads = trained(_config(method, tmp_path / "threads", trace, processes=False))
    processes = trained(_config(method, tmp_path / "processes", trace, processes=True))
    _same_numbers(processes, threads)
    # The trace took effect: the crash's step ran on 2 workers, the join's on 3 again.
    assert [r["quorum"] for r in processes[0]] == [3, 3, 2, 2, 2, 3, 3, 3]
    assert {"worker": 2, "kind": "join"} in processes[0][5]["membership_events"]
    # ddp drops the crash's step; a method whose exchange lands a round late loses the one
    # in flight at the crash; diloco and local_adamw drop none.
    late = ("ddp", "eager", "diloco_delayed", "co2")
    assert processes[1]["faults"]["rounds_dropped"] == (1 if method in late else 0)
    assert processes[1]["faults"]["goodput"] < 1.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"ranks_per_worker": 2, "worker_sharding": "fsdp", "device": "cuda"},
            "not yet supported with worker processes on --device cuda",
        ),
    ],
)
def test_what_faults_in_processes_do_not_run_with_yet_is_refused_in_one_line(
    overrides: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    config = _config("ddp", tmp_path / "out", tmp_path / "trace.txt", processes=True)
    config = with_options(config, **overrides)
    with pytest.raises(ConfigError, match=expected) as caught:
        config.validate()
    assert "\n" not in str(caught.value)


def test_faults_in_worker_processes_pass_the_checks(tmp_path: Path) -> None:
    config = _config("diloco", tmp_path / "out", tmp_path / "trace.txt", processes=True)
    config.validate()  # (no refusal: the placement runs with faults)


#: Four workers whose quorums overlap and recur: two crashes a step apart, a leave and its
#: rejoin landing with a join, so the processes meet sets {0,1,2,3}, {0,1,3}, {0,3}, {0,1,2,3}.
OVERLAPPING_TRACE = """\
step=2  worker=2  crash
step=3  worker=1  leave
step=5  worker=1  rejoin
step=5  worker=2  join
step=6  worker=3  slow factor=2 for=2
"""


@pytest.mark.parametrize("method", ["streaming_diloco", "demo", "sparta"])
def test_overlapping_events_on_four_workers_give_the_same_numbers_in_processes(
    method: str, tmp_path: Path
) -> None:
    trace = trace_file(tmp_path, OVERLAPPING_TRACE)
    threads = trained(_config(method, tmp_path / "t", trace, processes=False, workers=4))
    processes = trained(_config(method, tmp_path / "p", trace, processes=True, workers=4))
    _same_numbers(processes, threads)
    assert [r["quorum"] for r in processes[0]] == [4, 4, 3, 2, 2, 4, 4, 4]


#: Every event placed by time: the steps they land on are agreed between the processes at run
#: time, and the link's events stretch and hold the quorum's transfers.
TIMED_TRACE = """\
t=0.05 worker=2 crash
t=0.5  worker=2 join
t=0.02 worker=0 slow factor=3 for=0.2
t=0.1  link factor=0.5 for=0.3
t=0.7  link down for=0.2
"""


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_trace_placed_by_time_with_link_events_gives_the_same_numbers_in_processes(
    method: str, tmp_path: Path
) -> None:
    trace = trace_file(tmp_path, TIMED_TRACE)
    threads = trained(_config(method, tmp_path / "threads", trace, processes=False))
    processes = trained(_config(method, tmp_path / "processes", trace, processes=True))
    _same_numbers(processes, threads)
    quorums = [r["quorum"] for r in processes[0]]
    assert 2 in quorums and quorums[-1] == 3  # (the crash and the join both landed)


def test_a_generated_trace_gives_the_same_numbers_in_processes(tmp_path: Path) -> None:
    runs = []
    for processes in (False, True):
        config = _config("diloco", tmp_path / str(processes), tmp_path / "x", processes=processes)
        runs.append(trained(generated_faults(config)))
    _same_numbers(runs[1], runs[0])
    assert runs[1][1]["faults"]["membership_changes"]  # (the generated crashes landed)


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_run_in_processes_stopped_mid_trace_and_resumed_gives_the_uninterrupted_numbers(
    method: str, tmp_path: Path
) -> None:
    """A checkpoint after step 3 (worker 2 dead, for diloco its crash not yet detected),
    resumed in worker processes: the run without a stop, in one process, to the same
    tolerances."""
    trace = trace_file(tmp_path, TRACE)
    whole = trained(_config(method, tmp_path / "whole", trace, processes=False))
    resumed = stopped_and_resumed(
        lambda: _config(method, tmp_path / "resumed", trace, processes=True)
    )
    _same_numbers(resumed, whole)


def test_a_quorum_below_the_minimum_waits_for_its_join_in_processes_as_in_one_process(
    tmp_path: Path,
) -> None:
    trace = trace_file(
        tmp_path, "t=0.1 worker=1 crash\nt=0.1 worker=2 crash\nt=1e6 worker=1 join\n"
    )
    runs = []
    for processes in (False, True):
        config = _config("ddp", tmp_path / str(processes), trace, processes=processes)
        config.fault.fault_min_workers, config.fault.fault_quorum_wait_s = 2, 2e6
        runs.append(trained(config))
    _same_numbers(runs[1], runs[0])
    assert max(r["clock_s"] for r in runs[1][0]) > 1e6  # (the modeled wait for the join)


def test_the_same_trace_under_torchrun_gives_the_numbers_of_one_process(tmp_path: Path) -> None:
    trace = trace_file(tmp_path, TRACE)
    threads = trained(_config("diloco", tmp_path / "threads", trace, processes=False))
    _same_numbers(under_torchrun(tmp_path, trace, processes=WORKERS, eval_batches=2), threads)


def _survivors_of_a_sigkill(planned: bool) -> list[float]:
    """Three workers reduce together; worker 2 is then SIGKILLed (by plan or not), and the
    other two make their quorum's group and reduce on it, leave it and come back to it."""
    comm = QuorumTorchComm(timeout_s=60.0)
    everyone = torch.ones(1)
    comm.all_reduce(everyone, op="sum", role=Role.OTHER).wait()
    if comm.slot == 2:
        if planned:
            end_by_sigkill("declared crash of worker 2")
        os.kill(os.getpid(), signal.SIGKILL)
    comm.prepare((0, 1))  # (its group is made now, by the survivors, after the kill)
    comm.enter(1, (0, 1))
    pair = torch.tensor([float(comm.slot + 1)])
    comm.all_reduce(pair, op="mean", role=Role.OTHER).wait()
    comm.enter(2, (0, 1, 2))  # (the world's group: worker 2 is gone from it)
    comm.enter(3, (0, 1))  # (a set met before keeps its group)
    again = torch.tensor([float(comm.slot)])
    comm.all_reduce(again, op="sum", role=Role.OTHER).wait()
    return [float(everyone[0]), float(pair[0]), float(again[0]), float(comm.world_size)]


def test_a_planned_sigkill_ends_one_worker_and_its_peers_go_on_over_their_quorum() -> None:
    """A declared crash's SIGKILL is no run failure: the launcher counts the worker done, its
    peers make and use a group that leaves it out (the spawner's store is a file, served by
    no worker), and a kill that was not planned still fails the run."""
    results = spawn_workers(_survivors_of_a_sigkill, 3, (True,), timeout_s=60.0)
    assert results[:2] == [[3.0, 1.5, 1.0, 2.0]] * 2
    assert results[2] is None
    with pytest.raises(WorkerFailed, match="killed by SIGKILL") as caught:
        spawn_workers(_survivors_of_a_sigkill, 3, (False,), timeout_s=60.0)
    assert caught.value.rank == 2


def _a_failure_after_a_planned_sigkill() -> None:
    """Worker 2 ends by plan; worker 0 then fails, and worker 1 waits to be stopped."""
    comm = QuorumTorchComm(timeout_s=60.0)
    comm.all_reduce(torch.ones(1), op="sum", role=Role.OTHER).wait()
    if comm.slot == 2:
        end_by_sigkill("declared crash of worker 2")
    time.sleep(2.0)  # (worker 2's kill is seen by the launcher first)
    if comm.slot == 0:
        raise RuntimeError("the failure that ends the run")
    time.sleep(120.0)


def test_the_failure_named_is_not_a_planned_sigkill() -> None:
    with pytest.raises(WorkerFailed, match="the failure that ends the run") as caught:
        spawn_workers(_a_failure_after_a_planned_sigkill, 3, timeout_s=60.0)
    assert caught.value.rank == 0


def _cycling_through_more_sets_than_are_kept() -> tuple[list[float], list[tuple[int, ...]]]:
    """Four workers enter five sets in turn, keeping the groups of two: each set's group is
    destroyed two sets later and made again when the set comes back."""
    comm = QuorumTorchComm(timeout_s=60.0, keep_groups=2)
    sums = []
    sets = [(0, 1, 2), (0, 1), (0, 2, 3), (1, 2, 3), (0, 1, 2), (0, 1, 2, 3), (0, 1)]
    for quorum_id, members in enumerate(sets, start=1):
        comm.prepare(members)
        if comm.slot in members:
            comm.enter(quorum_id, members)
            value = torch.tensor([float(comm.slot)])
            comm.all_reduce(value, op="sum", role=Role.OTHER).wait()
            sums.append(float(value[0]))
        assert len(comm.kept_sets) <= 2
    return sums, list(comm.kept_sets)


def test_quorum_groups_beyond_those_kept_are_destroyed_and_made_again() -> None:
    results = spawn_workers(_cycling_through_more_sets_than_are_kept, 4, timeout_s=60.0)
    sets = [(0, 1, 2), (0, 1), (0, 2, 3), (1, 2, 3), (0, 1, 2), (0, 1, 2, 3), (0, 1)]
    for slot, (sums, kept) in enumerate(results):
        assert sums == [float(sum(members)) for members in sets if slot in members]
        assert kept == [(0, 1, 2), (0, 1)]  # (the whole world is the default group)
