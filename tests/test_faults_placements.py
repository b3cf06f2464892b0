"""Declared faults in the placements beyond one process and one process per worker: K
workers in each of several processes (a crash stops a worker's thread, its process's other
workers go on, the quorum's groups span the processes that hold its members), and workers of
several ranks. The same trace gives the numbers of the run with every worker a thread of one
process: losses to 1e-6, modeled times to 1e-9 s, the same quorums, events and faults block."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _faults import (
    same_numbers,
    stopped_and_resumed,
    tiny_config,
    trace_file,
    trained,
    under_torchrun,
)
from lowcomm.config import ConfigError, with_options
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight

#: Worker 1 (process 0's second) crashes and joins again; worker 3 (process 1's second)
#: straggles: a quorum with two members in one process and one in the other.
TRACE = """\
# when    worker    what
step=2    worker=1  crash
step=5    worker=1  join
step=1    worker=3  slow factor=3 for=3
"""

#: Both workers of process 0 are gone for a while: a quorum held by process 1 alone.
EMPTY_PROCESS = """\
step=2    worker=0  crash
step=3    worker=1  leave
step=5    worker=0  join
step=6    worker=1  rejoin
"""

#: Placed by time: each event lands on the first step starting at or after it, the step's
#: start agreed over every worker of both processes.
TIMED = """\
t=0.02    worker=2  crash
t=2.6     worker=2  join
t=0       worker=0  slow factor=2 for=0.1
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "trace"), [("ddp", TRACE), ("diloco", EMPTY_PROCESS), ("local_adamw", TIMED)]
)
def test_the_same_trace_with_two_workers_a_process_gives_the_numbers_of_one_process(
    method: str, trace: str, tmp_path: Path
) -> None:
    path = trace_file(tmp_path, trace)
    one = trained(tiny_config(method, tmp_path / "one", path, workers=4, workers_per_process=4))
    two = trained(tiny_config(method, tmp_path / "two", path, workers=4, workers_per_process=2))
    same_numbers(two, one)
    quorums = [r["quorum"] for r in two[0]]
    if trace == TRACE:  # (the crash's step and those after it ran on 3 workers)
        assert quorums == [4, 4, 3, 3, 3, 4, 4, 4]
    elif trace == EMPTY_PROCESS:  # (steps 3 and 4 ran on process 1's two workers alone)
        assert quorums == [4, 4, 3, 2, 2, 3, 4, 4]
    else:  # (the crash and the join each landed on a step, as in one process)
        assert quorums == [4, 3, 3, 3, 4, 4, 4, 4]


def test_two_workers_a_process_pass_the_checks_locally_and_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config("ddp", tmp_path / "out", tmp_path / "t", workers=4, workers_per_process=2)
    config.validate()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    config.validate()
    config.comm.clock, config.comm.seconds_per_microbatch = "real", None
    config.validate()  # (a crash stops its worker's thread: no process is killed)


@pytest.mark.slow
def test_the_same_trace_under_torchrun_with_two_workers_a_process_gives_the_same_numbers(
    tmp_path: Path,
) -> None:
    trace = trace_file(tmp_path, TRACE)
    one = trained(tiny_config("diloco", tmp_path / "one", trace, workers=4, workers_per_process=4))
    launched = under_torchrun(
        tmp_path, trace, "--workers", "4", "--workers-per-process", "2", processes=2
    )
    same_numbers(launched, one)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "trace"), [("diloco", EMPTY_PROCESS), ("demo", TRACE), ("ddp", TRACE)]
)
def test_workers_of_two_ranks_in_processes_give_the_numbers_of_one_process(
    method: str, trace: str, tmp_path: Path
) -> None:
    path = trace_file(tmp_path, trace)
    placement = {"workers": 4, "ranks_per_worker": 2}
    one = trained(tiny_config(method, tmp_path / "one", path, workers_per_process=4, **placement))
    two = trained(tiny_config(method, tmp_path / "two", path, workers_per_process=2, **placement))
    same_numbers(two, one)
    expected = [4, 4, 3, 2, 2, 3, 4, 4] if trace == EMPTY_PROCESS else [4, 4, 3, 3, 3, 4, 4, 4]
    assert [r["quorum"] for r in two[0]] == expected


@pytest.mark.parametrize("method", ["diloco", "local_adamw", "ddp"])
def test_a_crash_takes_every_rank_of_its_worker_and_healing_reaches_each_of_the_joiners(
    method: str, tmp_path: Path
) -> None:
    path = trace_file(tmp_path, "step=2 worker=1 crash\nstep=5 worker=1 join\n")
    config = tiny_config(method, tmp_path / "out", path, workers=3, workers_per_process=3)
    config = with_options(config, ranks_per_worker=2)
    config.validate()
    preflight(config)
    summaries = train_in_process(config, keep_parameters=True)
    out = Path(str(config.run.out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    parameters = [s.parameters for s in summaries]
    # Six rank threads; step 7 ends a round, after which every rank of every worker holds
    # the same model: the joiner's two ranks were each healed to the members' state (ddp:
    # each rank to its slice of the AdamW moments, else its updates would differ).
    assert len(parameters) == 6
    assert all(p is not None and torch.equal(parameters[0], p) for p in parameters)
    # Worker 1 (ranks 2 and 3) was out of steps 2-4 with both its ranks.
    assert [r["quorum"] for r in records] == [3, 3, 2, 2, 2, 3, 3, 3]
    tokens = [s.tokens for s in summaries]
    assert tokens[2] == tokens[3] < tokens[0] == tokens[1] == tokens[4] == tokens[5]
    # The healing transfer is charged on the link: the join step costs more than a plain one.
    plain = records[7]["clock_s"] - records[6]["clock_s"]
    assert records[5]["clock_s"] - records[4]["clock_s"] > plain
    assert records[5]["bytes_sent_per_worker"] > records[7]["bytes_sent_per_worker"]


@pytest.mark.parametrize(
    ("placement", "expected"),
    [
        (
            {"workers": 2, "workers_per_process": 1, "ranks_per_worker": 2,
             "worker_sharding": "fsdp", "device": "cuda"},
            "not yet supported with worker processes on --device cuda (the quorum's groups",
        ),
    ],
)  # fmt: skip
def test_what_workers_of_several_ranks_do_not_run_with_yet_is_refused_in_one_line(
    placement: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    config = tiny_config("diloco", tmp_path / "out", tmp_path / "t", **placement)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as caught:
        config.validate()
    assert "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_of_two_workers_a_process_stopped_mid_trace_and_resumed_gives_the_whole_run(
    ranks: int, tmp_path: Path
) -> None:
    """A checkpoint after step 3 (worker 1 dead, its crash not yet detected by diloco's
    survivors), resumed in processes of two workers: the run without a stop, in one
    process."""
    trace = trace_file(tmp_path, TRACE)
    placement = {"workers": 4, "ranks_per_worker": ranks}
    whole = trained(
        tiny_config("diloco", tmp_path / "whole", trace, workers_per_process=4, **placement)
    )
    resumed = stopped_and_resumed(
        lambda: tiny_config(
            "diloco", tmp_path / "resumed", trace, workers_per_process=2, **placement
        )
    )
    same_numbers(resumed, whole)


# --- the quorum's group across processes, written from a flat group's results -------------


def _flat_results(members: tuple[int, ...], slot: int) -> list[list[float]]:
    """What a flat group of ``members`` gives ``slot`` (each member's inputs from its slot)."""
    size, rank = len(members), members.index(slot)
    scattered = [sum(float(m + rank * 2 + t) for m in members) for t in range(2)]
    gathered = [float(m * 10 + t) for m in members for t in range(2)]
    exchanged = [float(m * 100 + rank * 2 + t) for m in members for t in range(2)]
    return [[sum(members) / size], scattered, gathered, exchanged, [float(members[size // 2])]]


def _collectives(comm: Any) -> list[list[float]]:
    """Every collective of the protocol, each member's inputs made from its slot."""
    from lowcomm.comm import Role

    slot, size = comm.slot, comm.world_size
    mean = torch.tensor([float(slot)])
    comm.all_reduce(mean, op="mean", role=Role.OTHER).wait()
    scatter_in = slot + torch.arange(size * 2, dtype=torch.float32)
    scattered = torch.empty(2)
    comm.reduce_scatter(scattered, scatter_in, op="sum", role=Role.OTHER).wait()
    gathered = torch.empty(size * 2)
    comm.all_gather(gathered, torch.tensor([slot * 10.0, slot * 10.0 + 1]), role=Role.OTHER).wait()
    exchange_in = slot * 100.0 + torch.arange(size * 2, dtype=torch.float32)
    exchanged = torch.empty(size * 2)
    comm.all_to_all(exchanged, exchange_in, role=Role.OTHER).wait()
    value = torch.tensor([float(slot)])
    comm.broadcast(value, src=size // 2, role=Role.OTHER).wait()
    return [t.tolist() for t in (mean, scattered, gathered, exchanged, value)]


#: Each step's quorum of 6 workers in 2 processes of 3: uneven (1 and 3 members), process 1
#: alone, every worker, process 0 alone.
_QUORUMS = [(0, 3, 4, 5), (3, 4), (0, 1, 2, 3, 4, 5), (1, 2)]


def _quorums_across_two_processes() -> dict[int, list[list[list[float]]]]:
    import threading

    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.faults.stacked import QuorumStackedGroup

    group = QuorumStackedGroup(3, TorchComm(timeout_s=60.0), timeout_s=60.0)
    results: dict[int, list[list[list[float]]]] = {}
    for step, members in enumerate(_QUORUMS):
        group.prepare(step, members)  # (every process, every step, in order)
        local = [m - group.first_rank for m in members if m // 3 == group.process]

        def member(k: int, quorum_id: int, members: tuple[int, ...] = members) -> None:
            comm = group.comm(k)
            comm.enter(quorum_id, members)
            results.setdefault(comm.slot, []).append(_collectives(comm))

        threads = [threading.Thread(target=member, args=(k, step + 1)) for k in local]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    group.close()
    return results


@pytest.mark.slow
def test_a_quorums_collectives_across_processes_give_a_flat_groups_results() -> None:
    from lowcomm.launch.spawn import spawn_workers

    processes = spawn_workers(_quorums_across_two_processes, 2, timeout_s=120.0)
    got = {slot: rows for results in processes for slot, rows in results.items()}
    for slot in range(6):
        expected = [_flat_results(m, slot) for m in _QUORUMS if slot in m]
        assert got[slot] == expected, slot
