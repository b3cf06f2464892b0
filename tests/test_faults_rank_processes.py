"""Declared faults with workers of several ranks, one process per rank (``--ranks-per-worker
R --workers-per-process 1``): a crash kills the R processes of its worker, a join has R
processes standing by take over its ranks, each healed from the same rank of a live member,
and the groups between workers follow the quorum on each rank's outer group. The same trace
gives the numbers of the run with every rank a thread of one process (losses to 1e-6,
modeled times to 1e-9 s, the same quorums, events and faults block), launched locally or by
torchrun."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _faults import (
    STEPS,
    generated_faults,
    same_numbers,
    stopped_and_resumed,
    tiny_config,
    trace_file,
    trained,
    under_torchrun,
)
from lowcomm.comm import Role
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.faults.processes import QuorumOuterComm, process_layout
from lowcomm.launch import device_memory
from lowcomm.launch.device_memory import check_worker_processes
from lowcomm.launch.run import check_process_memory
from lowcomm.launch.spawn import spawn_workers
from lowcomm.train.checkpoint import read_rank_state, step_directory
from lowcomm.train.task import CorpusTask

#: Worker 1's two ranks crash and join again (two processes killed, two standing by take
#: over), worker 0 straggles over the crash.
TRACE = """\
# when    worker    what
step=2    worker=1  crash
step=5    worker=1  join
step=1    worker=0  slow factor=3 for=3
"""

#: Worker 0's processes are killed (the run directory is written on by worker 1's rank 0),
#: and worker 1 leaves and rejoins with its processes kept.
WORKER_ZERO = """\
step=1    worker=0  crash
step=3    worker=1  leave
step=5    worker=0  join
step=6    worker=1  rejoin
"""

#: Placed by time: each event lands on the first step starting at or after it, the step's
#: start agreed over the live processes.
TIMED = """\
t=0.02    worker=2  crash
t=2.6     worker=2  join
t=0       worker=0  slow factor=2 for=0.1
"""

#: Each trace's quorums, step by step.
QUORUMS = {
    TRACE: [2, 2, 1, 1, 1, 2, 2, 2],
    WORKER_ZERO: [3, 2, 2, 1, 1, 2, 3, 3],
}


def _config(method: str, out: Path, trace: Path, *, processes: bool, **extra: Any) -> TrainConfig:
    workers = int(extra.pop("workers", 2))
    placement = {
        "workers": workers,
        "ranks_per_worker": 2,
        "workers_per_process": 1 if processes else workers,
    }
    return tiny_config(method, out, trace, **{**placement, **extra})


@pytest.mark.parametrize(
    ("method", "trace", "workers"),
    [("ddp", TRACE, 2), ("diloco", WORKER_ZERO, 3), ("local_adamw", TIMED, 3)],
    ids=["ddp-crash-join", "diloco-worker-0-killed", "local_adamw-by-time"],
)
def test_the_same_trace_in_one_process_and_in_a_process_per_rank_gives_the_same_numbers(
    method: str, trace: str, workers: int, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = trace_file(tmp_path, trace)
    threads = trained(_config(method, tmp_path / "t", path, processes=False, workers=workers))
    processes = trained(_config(method, tmp_path / "p", path, processes=True, workers=workers))
    same_numbers(processes, threads)
    quorums = [r["quorum"] for r in processes[0]]
    if trace in QUORUMS:
        assert quorums == QUORUMS[trace]
    else:  # (the timed crash and join both landed)
        assert 2 in quorums and quorums[-1] == 3
    # The crash killed both processes of its worker, as planned (not a run failure).
    printed = capfd.readouterr().out
    crashed = {TRACE: 1, WORKER_ZERO: 0, TIMED: 2}[trace]
    for rank in (0, 1):
        assert f"declared crash of worker {crashed} (rank {rank}) at step" in printed


def test_the_ranks_that_take_over_a_crashed_worker_are_healed_to_the_members_state(
    tmp_path: Path,
) -> None:
    """After the join, each rank of the joiner is healed from the same rank of a live
    member: the run's last step ends a round, after which the final checkpoint holds one
    model in every rank's file, the joiner's (written by the processes that took over) as
    the others'."""
    path = trace_file(tmp_path, "step=2 worker=1 crash\nstep=5 worker=1 join\n")
    config = _config("diloco", tmp_path / "out", path, processes=True)
    assert process_layout(config) == (0, 1, 2, 2, 3, 3)  # (two standing by, one per rank)
    records, summary = trained(config)
    assert [r["quorum"] for r in records] == [2, 2, 1, 1, 1, 2, 2, 2]
    final = step_directory(Path(str(config.run.out)), STEPS)
    models = [read_rank_state(final, rank)["model"] for rank in range(4)]
    for model in models[1:]:
        assert model.keys() == models[0].keys()
        assert all(torch.equal(model[name], models[0][name]) for name in model)
    # Worker 1's ranks took no step while it was out: fewer tokens than worker 0's.
    tokens = [read_rank_state(final, rank)["tokens"] for rank in range(4)]
    assert tokens[2] == tokens[3] < tokens[0] == tokens[1]
    assert summary["faults"]["membership_changes"][0]["quorum"] == 1


def test_a_generated_trace_gives_the_same_numbers_in_a_process_per_rank(tmp_path: Path) -> None:
    """A generated trace kills no process (each crashed worker is replaced in its own): the
    crashed worker's R processes wait outside the quorum until its replacement joins."""
    runs = []
    for processes in (False, True):
        config = _config(
            "diloco", tmp_path / str(processes), tmp_path / "x", processes=processes, workers=3
        )
        runs.append(trained(generated_faults(config)))
    same_numbers(runs[1], runs[0])
    assert runs[1][1]["faults"]["membership_changes"]  # (the generated crashes landed)


def test_a_run_stopped_mid_trace_and_resumed_gives_the_uninterrupted_numbers(
    tmp_path: Path,
) -> None:
    """A checkpoint after step 3, worker 1's rank slots written from what its killed
    processes handed over; the resumed launch starts every process again and kills worker
    1's at once: the run without a stop, in one process, to the same tolerances."""
    path = trace_file(tmp_path, TRACE)
    whole = trained(_config("diloco", tmp_path / "whole", path, processes=False))
    resumed = stopped_and_resumed(
        lambda: _config("diloco", tmp_path / "resumed", path, processes=True)
    )
    same_numbers(resumed, whole)


def test_a_crash_and_join_on_the_real_clock_kill_and_replace_every_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = trace_file(tmp_path, "step=2 worker=1 crash\nstep=5 worker=1 join\n")
    config = _config(
        "diloco", tmp_path / "out", path, processes=True, clock="real", seconds_per_microbatch=None
    )
    records, summary = trained(config)
    assert [r["quorum"] for r in records] == [2, 2, 1, 1, 1, 2, 2, 2]
    assert math.isfinite(summary["final_val_loss"])
    printed = capfd.readouterr().out
    assert "declared crash of worker 1 (rank 0) at step 2" in printed
    assert "declared crash of worker 1 (rank 1) at step 2" in printed


def test_the_same_trace_under_torchrun_with_a_process_per_rank_gives_the_same_numbers(
    tmp_path: Path,
) -> None:
    """torchrun's processes are not killed: each rank of the crashed worker loses its state
    in place and waits outside the quorum until the join heals it."""
    path = trace_file(tmp_path, TRACE)
    threads = trained(_config("diloco", tmp_path / "threads", path, processes=False))
    same_numbers(under_torchrun(tmp_path, path, "--ranks-per-worker", "2", processes=4), threads)


def test_the_memory_floor_counts_a_standby_process_for_each_rank_of_a_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.txt"
    config = _config("diloco", tmp_path / "out", path, processes=True)
    model = CorpusTask().shapes_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    each = check_worker_processes(config, parameters, free_bytes=lambda: 1e15)
    assert each is not None
    monkeypatch.setattr(device_memory, "available_host_bytes", lambda: 5.5 * each.total)
    path.write_text("step=2 worker=1 crash\n")  # (no join: 4 processes fit)
    check_process_memory(config, CorpusTask())
    path.write_text("step=2 worker=1 crash\nstep=5 worker=1 join\n")
    with pytest.raises(ConfigError, match=r"^--workers 2: 6 worker processes \(4 and 2 standing"):
        check_process_memory(config, CorpusTask())


def test_a_process_per_rank_passes_the_checks_replicated_or_sharded(tmp_path: Path) -> None:
    config = _config("diloco", tmp_path / "out", tmp_path / "t", processes=True)
    config.validate()  # (no refusal: the placement runs with faults)
    with_options(config, worker_sharding="fsdp").validate()  # (tests/test_faults_fsdp.py)
    # A sharded worker's ranks are processes of their own (its mesh is theirs alone).
    threads = _config("diloco", tmp_path / "out", tmp_path / "t", processes=False)
    with pytest.raises(ConfigError, match="--worker-sharding fsdp") as caught:
        with_options(threads, worker_sharding="fsdp").validate()
    assert "\n" not in str(caught.value)


def _outer_groups_through_quorums() -> tuple[int, int, list[float], list[tuple[int, ...]]]:
    """Three workers of two ranks (six processes, rank slot = process) enter five quorums in
    turn on their rank's outer group, keeping the groups of two quorums: each quorum's pair
    of groups is destroyed two quorums later and made again when the quorum comes back."""
    comm = QuorumOuterComm(2, timeout_s=60.0, keep_groups=2)
    sums = []
    quorums = [(0, 1, 2), (0, 1), (0, 2), (1, 2), (0, 1, 2), (0, 1)]
    for quorum_id, members in enumerate(quorums, start=1):
        comm.prepare_quorum(members)
        if comm.slot in members:
            comm.enter(quorum_id, members)
            assert (comm.rank, comm.world_size) == (members.index(comm.slot), len(members))
            value = torch.tensor([float(comm.rank_slot)])  # (this rank's process of the worker)
            comm.all_reduce(value, op="sum", role=Role.OTHER).wait()
            sums.append(float(value[0]))
        assert len(comm.kept_sets) <= 2
    return comm.slot, comm.local_rank, sums, list(comm.kept_sets)


def test_each_ranks_outer_group_follows_the_quorum_over_that_ranks_processes() -> None:
    results = spawn_workers(_outer_groups_through_quorums, 6, timeout_s=60.0)
    quorums = [(0, 1, 2), (0, 1), (0, 2), (1, 2), (0, 1, 2), (0, 1)]
    for process, (slot, rank, sums, kept) in enumerate(results):
        assert (slot, rank) == (process // 2, process % 2)
        # Rank r's group holds the rank-r process of every member, and no other.
        want = [float(sum(2 * w + rank for w in q)) for q in quorums if slot in q]
        assert sums == want
        assert kept == [(rank, 2 + rank, 4 + rank), (rank, 2 + rank)]
