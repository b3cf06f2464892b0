"""A run of M = P x K workers: P processes (the local spawner or torchrun), each running K
workers as threads (``1 < --workers-per-process K < --workers``).

Each process is one rank of a ``torch.distributed`` world of P; its workers ``w = p K + k``
run :func:`lowcomm.train.loop.train_worker` on threads, as in
:mod:`lowcomm.launch.inprocess`, each with a :class:`~lowcomm.comm.stacked.StackedComm` as
its group and another as its bookkeeping group (the in-process rendezvous of the K threads,
stacked on a ``TorchComm`` of the P processes). What the workers of a process share is built
once per process (:mod:`lowcomm.train.shared`); the calibration is measured by the processes
in turn and agreed on, on a Gloo group of its own.

A hierarchical worker (``--ranks-per-worker R``) is R threads of its process: process ``p``
runs global ranks ``p K R .. (p + 1) K R - 1`` (rank ``g % R`` of worker ``g // R``, as
:func:`lowcomm.launch.groups.worker_layout` lays them out); a worker's replica group is an
in-process group of its R threads, and the outer group of local rank ``r`` is stacked, like the
strategy's group, on a process group of its own (one per ``r``: each courier issues on its
own).

With declared faults (flat workers) the strategy's group is a
:class:`~lowcomm.faults.stacked.QuorumStackedGroup`, whose collectives run over each round's
quorum; a declared crash stops its worker's thread, not its process
(:mod:`lowcomm.faults.stacked`).

A worker that raises aborts its process's groups, the process exits non-zero with that
worker's one-line error (:class:`~lowcomm.launch.spawn.WorkerFailed` naming the worker), and
the launcher (the local spawner, or torchrun's agent) stops the other processes, whose
collectives fail on the closed connection meanwhile.
"""

from __future__ import annotations

import os

import torch

from lowcomm.comm.base import Role
from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.comm.stacked import StackedGroup
from lowcomm.comm.torch_comm import TorchComm
from lowcomm.config import TrainConfig
from lowcomm.faults.run import FaultSettings
from lowcomm.faults.stacked import ProcessSets, QuorumStackedGroup
from lowcomm.launch import heap
from lowcomm.launch.device_memory import processes_on_this_machine
from lowcomm.launch.inprocess import RankThreads, check_shared, run_threads, worker_turns
from lowcomm.launch.spawn import Interrupted, _WorkerStop
from lowcomm.train.loop import WorkerSummary, train_worker
from lowcomm.train.rundir import ERROR_LOG, run_directory
from lowcomm.train.shared import shared_setup
from lowcomm.train.task import Task


def train_stacked(
    config: TrainConfig, task: Task | None = None, *, keep_parameters: bool = False
) -> list[WorkerSummary]:
    """Train this process's ``--workers-per-process`` workers as threads; return their
    summaries in rank order. The process group of the P processes is initialised (this
    process is rank ``p``: it runs workers ``p K .. p K + K - 1``).

    Raises:
        WorkerFailed: one of this process's workers raised (its traceback is in the run's
            ``error.log``); the error names that worker.
        _WorkerStop: this process got SIGINT or SIGTERM; its workers have stopped.
    """
    timeout = config.comm.collective_timeout_s
    torch.set_num_threads(1)
    heap.return_large_blocks()  # (the workers' freed activations go back to the system)
    # (The spawner or torchrun bound this process's device; --device cuda is one process.)
    device = (
        torch.device("cpu")
        if config.placement.device == "cpu"
        else torch.device("cuda", torch.cuda.current_device())
    )
    inter = TorchComm(timeout_s=timeout)
    # Every process creates the groups in the same order (new_group is collective).
    inter_books = inter.cpu_side_group()
    ranks = _stacked_threads(config, inter, inter_books)
    shared = shared_setup(config, task, whole_run=False)
    check_shared(
        config, shared, task, device, processes=processes_on_this_machine(inter.world_size),
        report=os.environ.get("LOCAL_RANK", "0") == "0",  # (one process of each machine)
    )  # fmt: skip
    with torch.no_grad():  # one initial model everywhere, as a worker process broadcasts it
        for parameter in shared.model.parameters():
            inter.broadcast(parameter.data, src=0, role=Role.PARAMETER).wait()

    def work(thread: int) -> WorkerSummary:
        return train_worker(
            config, ranks.raw(thread), keep_parameters=keep_parameters,
            bookkeeping=ranks.books(thread), shared=shared, task=task,
            levels=ranks.levels(thread),
        )  # fmt: skip

    try:
        return run_threads(
            work, ranks.count, ranks.groups,
            log_path=run_directory(config) / ERROR_LOG, first_rank=ranks.first_rank,
            turns=worker_turns(config, ranks.count),
        )  # fmt: skip
    except Interrupted as stop:  # stopped, not failed: leave as a stopped worker process does
        raise _WorkerStop(stop.signum) from None
    finally:
        for group in ranks.groups:
            if isinstance(group, StackedGroup | QuorumStackedGroup):
                group.close()


def _stacked_threads(config: TrainConfig, inter: TorchComm, inter_books: TorchComm) -> RankThreads:
    """This process's K x R threads on stacked groups (strategy, bookkeeping and, with R > 1,
    one outer group per local rank, each on its own process group of the P processes) and
    in-process replica groups (a worker's R ranks are all here)."""
    per_process, ranks = config.placement.workers_per_process, config.placement.ranks_per_worker
    timeout, threads = config.comm.collective_timeout_s, per_process * ranks
    # With declared faults the groups between workers follow the quorum: the strategy's
    # (flat workers) or each rank's outer group (a worker of several ranks enters its
    # quorum on those, lowcomm.train.loop.set_up), their process groups made in one order.
    faults = FaultSettings.of(config.fault).enabled
    sets = ProcessSets(threads, timeout_s=timeout)
    world: StackedGroup | QuorumStackedGroup
    if faults and ranks == 1:
        world = QuorumStackedGroup(threads, inter, timeout_s=timeout, name="strategy", sets=sets)
    else:
        world = StackedGroup(threads, inter, timeout_s=timeout, name="strategy")
    books = StackedGroup(threads, inter_books, timeout_s=timeout, name="bookkeeping")
    if ranks == 1:
        return RankThreads(threads, world, books, first_rank=world.first_rank)
    # (Gloo process groups: --device cuda runs its workers in one process, see
    # TrainConfig.placement_refusal.)
    outers: list[StackedGroup | QuorumStackedGroup] = [
        QuorumStackedGroup(
            per_process, inter.cpu_side_group(), timeout_s=timeout, name=f"outer {r}", sets=sets
        )
        if faults
        else StackedGroup(per_process, inter.cpu_side_group(), timeout_s=timeout, name=f"outer {r}")
        for r in range(ranks)
    ]
    first_worker = inter.rank * per_process
    replicas = [
        InProcessGroup(ranks, timeout_s=timeout, name=f"worker {first_worker + k} replica")
        for k in range(per_process)
    ]
    return RankThreads(threads, world, books, replicas, outers, first_rank=world.first_rank)


def spawned_stacked(config: TrainConfig, task: Task | None = None) -> list[WorkerSummary]:
    """Entry point of a process started by the local spawner (the group is initialised)."""
    return train_stacked(config, task)
