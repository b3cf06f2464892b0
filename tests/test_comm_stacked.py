"""The stacked comm (M = P x K: K worker threads in each of P Gloo processes) against a flat
Gloo group of M processes: every collective, asynchronous handles issued ahead of their waits,
and a failing member that aborts its group instead of leaving its peers hanging."""

from __future__ import annotations

import time

import pytest
import torch

from lowcomm.comm import Comm, Role
from lowcomm.comm.inprocess import GroupAborted
from lowcomm.comm.stacked import StackedGroup
from lowcomm.launch import WorkerFailed, spawn_workers
from lowcomm.launch.inprocess import run_threads

PROCESSES, PER_PROCESS = 2, 2
WORLD = PROCESSES * PER_PROCESS


def every_collective(comm: Comm) -> dict[str, torch.Tensor]:
    """Every collective of the protocol on ``comm`` (one rank's view), several in flight at
    once, on random inputs; what each left in its tensor."""
    rank, world = comm.rank, comm.world_size
    generator = torch.Generator().manual_seed(rank)
    out: dict[str, torch.Tensor] = {}
    for op in ("sum", "mean", "max"):
        out[f"all_reduce_{op}"] = torch.randn(37, generator=generator)
    handles = [
        comm.all_reduce(out[f"all_reduce_{op}"], op=op, role=Role.GRADIENT)  # type: ignore[arg-type]
        for op in ("sum", "mean", "max")
    ]
    fused = torch.randn(10, generator=generator)
    segments = [(Role.PARAMETER, 4), (Role.FIRST_MOMENT, 6)]
    handles.append(comm.all_reduce(fused, op="mean", role=Role.PARAMETER, segments=segments))
    out["fused"] = fused
    full = torch.randn(3 * world, generator=generator)
    for op in ("sum", "mean", "max"):
        out[f"reduce_scatter_{op}"] = torch.empty(3, 1) if op == "mean" else torch.empty(3)
        handles.append(
            comm.reduce_scatter(
                out[f"reduce_scatter_{op}"], full.clone(), op=op, role=Role.GRADIENT
            )  # type: ignore[arg-type]
        )
    out["all_gather"] = torch.empty(2 * world)
    mine = torch.tensor([float(rank), -10.0 * rank])
    handles.append(comm.all_gather(out["all_gather"], mine, role=Role.PARAMETER))
    out["all_to_all"] = torch.empty(2 * world)
    sent = torch.arange(2.0 * world) + 100 * rank
    handles.append(comm.all_to_all(out["all_to_all"], sent, role=Role.GRADIENT))
    for src in range(world):  # from every rank: the first and last of each process
        out[f"broadcast_{src}"] = torch.full((3,), float(rank))
        handles.append(comm.broadcast(out[f"broadcast_{src}"], src=src, role=Role.PARAMETER))
    handles.append(comm.barrier())
    for handle in reversed(handles):  # waited in any order
        handle.wait()
    return out


def _flat() -> dict[str, torch.Tensor]:
    from lowcomm.comm.torch_comm import TorchComm

    return every_collective(TorchComm())


def _stacked() -> list[dict[str, torch.Tensor]]:
    from lowcomm.comm.torch_comm import TorchComm

    group = StackedGroup(PER_PROCESS, TorchComm(), name="test")
    try:
        return run_threads(
            lambda member: _staggered(group, member), PER_PROCESS, (group,),
            first_rank=group.first_rank,
        )  # fmt: skip
    finally:
        group.close()


def _staggered(group: StackedGroup, member: int) -> dict[str, torch.Tensor]:
    comm = group.comm(member)
    assert (comm.rank, comm.world_size) == (group.first_rank + member, WORLD)
    time.sleep(0.02 * member)  # members post at different times
    return every_collective(comm)


def test_every_collective_of_two_processes_of_two_threads_equals_a_flat_gloo_group() -> None:
    flat = spawn_workers(_flat, WORLD)
    stacked = [result for process in spawn_workers(_stacked, PROCESSES) for result in process]
    assert len(stacked) == WORLD
    for rank, (got, want) in enumerate(zip(stacked, flat, strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            # A sum's terms are added in another order (this process's members first).
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-6, atol=1e-6, msg=f"rank {rank}: {name}"
            )
    # The all-to-all and broadcasts are exact: chunk j of rank i lands in rank j's chunk i.
    for rank, got in enumerate(stacked):
        want = torch.cat(
            [torch.tensor([2.0 * rank, 2.0 * rank + 1]) + 100 * i for i in range(WORLD)]
        )
        assert torch.equal(got["all_to_all"], want)
        for src in range(WORLD):
            assert torch.equal(got[f"broadcast_{src}"], torch.full((3,), float(src)))


def _one_fails() -> None:
    from lowcomm.comm.torch_comm import TorchComm

    group = StackedGroup(PER_PROCESS, TorchComm(), name="test")

    def member(k: int) -> None:
        comm = group.comm(k)
        comm.barrier().wait()
        if comm.rank == 3:
            raise RuntimeError("injected failure on purpose")
        comm.barrier().wait()  # would wait forever without the abort

    run_threads(member, PER_PROCESS, (group,), first_rank=group.first_rank)


def test_a_failing_worker_ends_every_process_with_its_error() -> None:
    with pytest.raises(WorkerFailed, match="worker 3 failed: RuntimeError: injected failure"):
        spawn_workers(_one_fails, PROCESSES, timeout_s=60)


def test_a_member_aborted_in_this_process_raises_at_once() -> None:
    from lowcomm.comm.local import LocalComm

    group = StackedGroup(2, LocalComm(), name="test")
    handle = group.comm(0).barrier()
    group.abort("worker 1 failed: boom")
    with pytest.raises(GroupAborted, match="worker 1 failed: boom"):
        handle.wait()
    with pytest.raises(GroupAborted):
        group.comm(1).barrier()
