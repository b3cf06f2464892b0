"""Run every worker of a training job in this process (``--workers-per-process`` = ``--workers``).

Each worker is a thread running the per-worker path every process runs
(:func:`lowcomm.train.loop.train_worker`), with an :class:`~lowcomm.comm.inprocess.InProcessComm`
as its group and another one as its bookkeeping group: no ``torch.distributed``, no interpreter
or torch import per worker, the corpus, tokenizer, validation batches, calibration and initial
model built once (:mod:`lowcomm.train.shared`). Threads, because torch's grad mode and autocast
are per thread; the run uses one intra-op thread (``torch.set_num_threads(1)``), as each worker
process does.

A hierarchical worker (``--ranks-per-worker R``) is R threads, one per rank, as it is R
processes: thread ``g`` is global rank ``g`` (rank ``g % R`` of worker ``g // R``), its replica
group an in-process group of its worker's R threads and its outer group one of the threads of
the same local rank in every worker (:class:`RankThreads`, the layout of
:func:`lowcomm.launch.groups.worker_layout`).

On a GPU (``--device cuda``) every thread drives the process's one GPU (one CUDA context):
the workers' tensors, the in-process collectives' buffers and their results stay on it. A
number of workers whose estimated memory exceeds the GPU's free memory is refused before any
starts (:mod:`lowcomm.launch.device_memory`).

As with processes: a worker that raises aborts both groups (every other worker's collectives
raise at once) and the run ends with :class:`~lowcomm.launch.spawn.WorkerFailed` naming the
first failing worker's error in one line, its traceback in the run's ``error.log``; SIGINT or
SIGTERM to this process (in its main thread) stops every worker at its next collective and
raises :class:`~lowcomm.launch.spawn.Interrupted`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol, TypeVar, cast

import torch
from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.comm.inprocess import GroupAborted, InProcessGroup
from lowcomm.comm.turns import Turns, cpu_count
from lowcomm.config import ConfigError, TrainConfig
from lowcomm.launch import heap
from lowcomm.launch.spawn import (
    STOP_GRACE_S,
    Interrupted,
    _first_failure,
    _LauncherSignal,
    _LauncherSignals,
)
from lowcomm.train.loop import WorkerSummary, train_worker
from lowcomm.train.shared import SharedSetup, shared_setup
from lowcomm.train.task import CorpusTask, Task, calibration_pass

T = TypeVar("T")


def train_in_process(
    config: TrainConfig,
    *,
    keep_parameters: bool = False,
    log_path: Path | None = None,
    task: Task | None = None,
) -> list[WorkerSummary]:
    """Train ``config``'s workers as threads of this process (a thread per rank of a
    hierarchical worker); return their summaries in global rank order (the run directory is
    written as by worker processes). ``task``: the model, data and loss
    (:mod:`lowcomm.train.task`; default ``lowcomm train``'s), shared by the threads.

    The caller has checked and prepared the run as :func:`lowcomm.launch.run.run_training`
    does (``config.validate()``, pre-flight, the corpus).

    Raises:
        ConfigError: the built model's dropout cannot be each worker's own, or (on a GPU)
            the workers do not fit its memory (:func:`check_shared`).
        WorkerFailed: a worker raised (its traceback goes to ``log_path``, else stderr).
        Interrupted: this process got SIGINT or SIGTERM; every worker has stopped.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    heap.return_large_blocks()  # (the workers' freed activations go back to the system)
    try:
        device = process_device(config)
        shared = shared_setup(config, task)
        check_shared(config, shared, task, device)
        ranks = RankThreads.in_process(
            config.placement.workers,
            config.placement.ranks_per_worker,
            config.comm.collective_timeout_s,
        )

        def work(rank: int) -> WorkerSummary:
            if device.type == "cuda":  # (the current device is per thread)
                torch.cuda.set_device(device)
            return train_worker(
                config, ranks.raw(rank), keep_parameters=keep_parameters,
                bookkeeping=ranks.books(rank), shared=shared, task=task,
                levels=ranks.levels(rank),
            )  # fmt: skip

        return run_threads(
            work, ranks.count, ranks.groups, log_path=log_path,
            turns=worker_turns(config, ranks.count),
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)


def worker_turns(config: TrainConfig, threads: int) -> Turns | None:
    """How many of ``threads`` worker threads run at once: one per CPU when there are more
    threads than CPUs, on the virtual clock (:mod:`lowcomm.comm.turns`); None: all of them."""
    slots = cpu_count()
    if config.comm.clock != "virtual" or threads <= slots:
        return None
    return Turns(slots)


class Group(Protocol):
    """A group of in-process members (an ``InProcessGroup``, a ``StackedGroup``)."""

    def comm(self, member: int) -> Comm: ...

    def abort(self, reason: str) -> None: ...


class RankThreads:
    """The communicators of the threads of one process: ``K`` workers of ``R`` ranks each,
    thread ``j`` rank ``j % R`` of the process's worker ``j // R`` (global rank
    ``first_rank + j``), as :func:`lowcomm.launch.groups.worker_layout` lays ranks out.

    Args:
        threads: K R, the threads of this process.
        world: the strategy's raw group of every rank (K R members here).
        books: the bookkeeping group, likewise.
        replicas: with R > 1, each local worker's replica group (R members, all here).
        outers: with R > 1, each local rank's outer group (K members here, one per worker).
        first_rank: the global rank of thread 0.
    """

    def __init__(
        self,
        threads: int,
        world: Group,
        books: Group,
        replicas: Sequence[Group] = (),
        outers: Sequence[Group] = (),
        first_rank: int = 0,
    ) -> None:
        self.count = threads
        self._world, self._books = world, books
        self._replicas, self._outers = list(replicas), list(outers)
        self.ranks = max(1, len(outers))
        self.first_rank = first_rank

    @classmethod
    def in_process(cls, workers: int, ranks: int, timeout_s: float | None) -> RankThreads:
        """Every rank of the run in this process, on in-process groups."""

        def group(size: int, name: str) -> InProcessGroup:
            return InProcessGroup(size, timeout_s=timeout_s, name=name)

        threads = workers * ranks
        world, books = group(threads, "strategy"), group(threads, "bookkeeping")
        if ranks == 1:
            return cls(threads, world, books)
        replicas = [group(ranks, f"worker {m} replica") for m in range(workers)]
        outers = [group(workers, f"outer {r}") for r in range(ranks)]
        return cls(threads, world, books, replicas, outers)

    @property
    def groups(self) -> list[Group]:
        """Every group (a failing thread aborts them all)."""
        return [self._world, self._books, *self._replicas, *self._outers]

    def raw(self, thread: int) -> Comm:
        return self._world.comm(thread)

    def books(self, thread: int) -> Comm:
        return self._books.comm(thread)

    def levels(self, thread: int) -> tuple[Comm, Comm] | None:
        """Thread ``thread``'s (replica, outer) communicators; None for flat workers."""
        if not self._replicas:
            return None
        worker, rank = divmod(thread, self.ranks)
        return self._replicas[worker].comm(rank), self._outers[rank].comm(worker)


def process_device(config: TrainConfig) -> torch.device:
    """The device every worker of this process drives: the CPU, or the process's GPU
    (``cuda:0``, or the one GPU the launcher made visible), made current here.

    Raises:
        ValueError: ``--device cuda`` and no GPU is visible (naming the fix).
    """
    from lowcomm.launch.devices import bind_device

    return bind_device(config.placement.device, 0)


def check_shared(
    config: TrainConfig,
    shared: SharedSetup,
    task: Task | None,
    device: torch.device,
    *,
    processes: int = 1,
    report: bool = True,
) -> None:
    """Refusals that need the built model, before any worker starts: a dropout the worker's
    own generator cannot drive (a transformers model's, of a config file or --init-from), and
    workers that do not fit the memory they share (printing the estimate when they do): the
    GPU's, or on the CPU the host's, which ``processes`` processes of this machine share
    (:mod:`lowcomm.launch.device_memory`). ``report``: print the estimate (one process of a
    machine does).

    Raises:
        ConfigError: in one line, naming the reason and the fix.
    """
    task = CorpusTask() if task is None else task
    if isinstance(task, CorpusTask):
        foreign = global_dropout(shared.model)
        if foreign is not None:
            raise ConfigError(
                f"--workers-per-process: {config.placement.workers_per_process} with a model whose "
                f"dropout draws from the process-global generator ({foreign}), which the "
                f"workers of one process would share; use a model without dropout, the "
                f"built-in gpt, or --workers-per-process 1"
            )
    from lowcomm.launch import device_memory as memory

    threads = config.placement.workers_per_process * config.placement.ranks_per_worker
    loss = calibration_pass(task, config, device)
    if device.type == "cuda":  # (each process of a machine has a GPU of its own)
        estimate = memory.check_device_memory(config, shared.model, loss, device)
        free, what, processes = memory.free_device_bytes(device), "device memory", 1
    else:
        found = memory.check_host_memory(config, shared.model, loss, processes=processes)
        if found is None:  # (the free memory cannot be read here)
            return
        estimate, free = found
        what = "memory"
    if not report:
        return
    where = "" if processes == 1 else f" ({processes} processes of {threads})"
    unit = "workers" if config.placement.ranks_per_worker == 1 else "rank threads"
    print(
        f"lowcomm: {processes * threads} {unit} on {device}{where}: about "
        f"{memory.amount(processes * threads * estimate.total)} of {what} "
        f"({memory.amount(estimate.total)} each), {memory.amount(free)} free",
        flush=True,
    )


def global_dropout(model: nn.Module) -> str | None:
    """What in ``model`` drops with the process-global generator (a torch dropout module with
    p > 0, a transformers config's dropout probability), or None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name or type(module).__name__}: {type(module).__name__}(p={module.p})"
    hf_config = getattr(model, "hf_config", None)
    if hf_config is not None:
        from lowcomm.models.hf import DROPOUT_FIELDS

        for field in DROPOUT_FIELDS:
            value = getattr(hf_config, field, None)
            if isinstance(value, int | float) and value > 0:
                return f"the transformers config's {field} = {value}"
    return None


class _Failures:
    """What the worker threads raised: (time, rank, error, traceback), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[tuple[float, int, BaseException, str]] = []

    def add(self, rank: int, error: BaseException) -> None:
        with self._lock:
            self.records.append((time.time(), rank, error, traceback.format_exc()))

    def causes(self) -> list[tuple[float, int, BaseException, str]]:
        """The failures that caused the others (a peer's aborted collective is a consequence)."""
        own = [r for r in self.records if not isinstance(r[2], GroupAborted)]
        return own or list(self.records)


class Abortable(Protocol):
    """A group of in-process members that a failing member ends (an ``InProcessGroup``, a
    ``StackedGroup``)."""

    def abort(self, reason: str) -> None: ...


def run_threads(
    fn: Callable[[int], T],
    count: int,
    groups: Sequence[Abortable],
    *,
    log_path: Path | None = None,
    first_rank: int = 0,
    turns: Turns | None = None,
) -> list[T]:
    """Run ``fn(rank)`` for ``count`` ranks, each on its own thread; return the results in rank
    order. A rank that raises aborts ``groups`` (its peers' collectives raise), and the first
    failure is raised as :class:`WorkerFailed`; a signal to this process's main thread aborts
    them and raises :class:`Interrupted` once the workers stopped (or after a grace period).
    ``first_rank``: the worker number of rank 0 in errors (this process's first worker when
    the run's workers are spread over several processes). ``turns``: how many of the threads
    run at once (None: all)."""
    results: list[T | None] = [None] * count
    failures = _Failures()

    def entry(rank: int) -> None:
        try:
            with nullcontext() if turns is None else turns.worker(rank):
                results[rank] = fn(rank)
        except BaseException as error:
            failures.add(first_rank + rank, error)
            line = f"{type(error).__name__}: {error}".splitlines()[0]
            for group in groups:
                group.abort(f"worker {first_rank + rank} failed: {line}")

    threads = [
        threading.Thread(
            target=entry, args=(rank,), name=f"lowcomm-worker-{first_rank + rank}", daemon=True
        )
        for rank in range(count)
    ]
    with _LauncherSignals() as signals:
        for thread in threads:
            thread.start()
        try:
            signals.arm()
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.2)  # (returns now and then: signals are handled)
            signals.disarm()
        except _LauncherSignal as received:
            signals.disarm()
            _stop(threads, groups, received.signum)
            raise Interrupted(received.signum) from None
    if failures.records:
        raise _failure(failures, log_path)
    return cast(list[T], results)


#: After :data:`STOP_GRACE_S`, how much longer a stop waits for worker threads still busy
#: (a thread cannot be killed; one left running when the interpreter exits may take the process
#: down mid-computation).
STOP_PATIENCE_S = 60.0


def _stop(threads: list[threading.Thread], groups: Sequence[Abortable], signum: int) -> None:
    """Abort the groups (each worker raises at its next collective) and give the workers
    :data:`STOP_GRACE_S` to unwind (closing their run files), then, saying so, up to
    :data:`STOP_PATIENCE_S` more; daemon threads still running after that are left to
    :func:`workers_alive` (the command line then exits without finalizing the interpreter)."""
    import signal

    for group in groups:
        group.abort(f"interrupted by {signal.Signals(signum).name}")
    for patience, say in ((STOP_GRACE_S, False), (STOP_PATIENCE_S, True)):
        busy = [thread for thread in threads if thread.is_alive()]
        if busy and say:
            print(
                f"lowcomm: waiting up to {patience:.0f} s for {len(busy)} worker(s) to reach "
                f"their next collective",
                file=sys.stderr,
                flush=True,
            )
        deadline = time.monotonic() + patience
        for thread in busy:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def workers_alive() -> int:
    """How many in-process worker threads are still running (after an interrupt whose stop
    gave up on them)."""
    return sum(
        1 for thread in threading.enumerate()
        if thread.name.startswith("lowcomm-worker-") and thread.is_alive()
    )  # fmt: skip


def _failure(failures: _Failures, log_path: Path | None) -> Exception:
    """The :class:`WorkerFailed` of the first cause, written and worded as the process
    launcher words a failed worker process."""
    scratch = tempfile.mkdtemp(prefix="lowcomm-inprocess-")
    try:
        causes = failures.causes()
        for when, rank, _, text in causes:
            record = {"time": when, "traceback": text}
            (Path(scratch) / f"rank{rank}.err").write_text(json.dumps(record))
        _, rank, error, _ = min(causes, key=lambda record: record[0])
        return _first_failure(scratch, rank, f"{type(error).__name__}: {error}", [], log_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
