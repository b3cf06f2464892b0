"""A run of M = P x K workers: P processes (the local spawner or torchrun), each running K
workers as threads (``1 < --workers-per-process K < --workers``; issue 30).

Each process is one rank of a ``torch.distributed`` world of P; its workers ``w = p K + k``
run :func:`lowcomm.train.loop.train_worker` on threads, as in
:mod:`lowcomm.launch.inprocess`, each with a :class:`~lowcomm.comm.stacked.StackedComm` as
its group and another as its bookkeeping group (the in-process rendezvous of the K threads,
stacked on a ``TorchComm`` of the P processes). What the workers of a process share is built
once per process (:mod:`lowcomm.train.shared`); the calibration is measured by the processes
in turn and agreed on, on a Gloo group of its own.

A worker that raises aborts its process's groups, the process exits non-zero with that
worker's one-line error (:class:`~lowcomm.launch.spawn.WorkerFailed` naming the worker), and
the launcher (the local spawner, or torchrun's agent) stops the other processes, whose
collectives fail on the closed connection meanwhile.
"""

from __future__ import annotations

import torch

from lowcomm.comm.base import Role
from lowcomm.comm.stacked import StackedGroup
from lowcomm.comm.torch_comm import TorchComm
from lowcomm.config import TrainConfig
from lowcomm.launch.inprocess import run_threads
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
    per_process, timeout = config.workers_per_process, config.collective_timeout_s
    torch.set_num_threads(1)
    inter = TorchComm(timeout_s=timeout)
    # Every process creates the groups in the same order (new_group is collective).
    inter_books, inter_calibration = inter.cpu_side_group(), inter.cpu_side_group()
    shared = shared_setup(config, task, calibration_group=inter_calibration)
    with torch.no_grad():  # one initial model everywhere, as a worker process broadcasts it
        for parameter in shared.model.parameters():
            inter.broadcast(parameter.data, src=0, role=Role.PARAMETER).wait()
    strategy = StackedGroup(per_process, inter, timeout_s=timeout, name="strategy")
    books = StackedGroup(per_process, inter_books, timeout_s=timeout, name="bookkeeping")

    def work(member: int) -> WorkerSummary:
        return train_worker(
            config, strategy.comm(member), keep_parameters=keep_parameters,
            bookkeeping=books.comm(member), shared=shared, task=task,
        )  # fmt: skip

    try:
        return run_threads(
            work, per_process, (strategy, books),
            log_path=run_directory(config) / ERROR_LOG, first_rank=strategy.first_rank,
        )  # fmt: skip
    except Interrupted as stop:  # stopped, not failed: leave as a stopped worker process does
        raise _WorkerStop(stop.signum) from None
    finally:
        strategy.close()
        books.close()


def spawned_stacked(config: TrainConfig, task: Task | None = None) -> list[WorkerSummary]:
    """Entry point of a process started by the local spawner (the group is initialised)."""
    return train_stacked(config, task)
