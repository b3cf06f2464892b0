"""Run every worker of a training job in this process (``--workers-per-process`` = ``--workers``).

Each worker is a thread running the per-worker path every process runs
(:func:`lowcomm.train.loop.train_worker`), with an :class:`~lowcomm.comm.inprocess.InProcessComm`
as its group and another one as its bookkeeping group: no ``torch.distributed``, no interpreter
or torch import per worker, the corpus, tokenizer, validation batches, calibration and initial
model built once (:mod:`lowcomm.train.shared`). Threads, because torch's grad mode and autocast
are per thread; the run uses one intra-op thread (``torch.set_num_threads(1)``), as each worker
process does.

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
from pathlib import Path
from typing import Protocol, TypeVar, cast

import torch

from lowcomm.comm.inprocess import GroupAborted, InProcessGroup
from lowcomm.config import TrainConfig
from lowcomm.launch.spawn import (
    STOP_GRACE_S,
    Interrupted,
    _first_failure,
    _LauncherSignal,
    _LauncherSignals,
)
from lowcomm.train.loop import WorkerSummary, train_worker
from lowcomm.train.shared import shared_setup
from lowcomm.train.task import Task

T = TypeVar("T")


def train_in_process(
    config: TrainConfig,
    *,
    keep_parameters: bool = False,
    log_path: Path | None = None,
    task: Task | None = None,
) -> list[WorkerSummary]:
    """Train ``config``'s workers as threads of this process; return their summaries in rank
    order (the run directory is written as by worker processes). ``task``: the model, data
    and loss (:mod:`lowcomm.train.task`; default ``lowcomm train``'s), shared by the threads.

    The caller has checked and prepared the run as :func:`lowcomm.launch.run.run_training`
    does (``config.validate()``, pre-flight, the corpus).

    Raises:
        WorkerFailed: a worker raised (its traceback goes to ``log_path``, else stderr).
        Interrupted: this process got SIGINT or SIGTERM; every worker has stopped.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shared = shared_setup(config, task)
        timeout = config.collective_timeout_s
        strategy = InProcessGroup(config.workers, timeout_s=timeout, name="strategy")
        books = InProcessGroup(config.workers, timeout_s=timeout, name="bookkeeping")

        def work(rank: int) -> WorkerSummary:
            return train_worker(
                config, strategy.comm(rank), keep_parameters=keep_parameters,
                bookkeeping=books.comm(rank), shared=shared, task=task,
            )  # fmt: skip

        return run_threads(work, config.workers, (strategy, books), log_path=log_path)
    finally:
        torch.set_num_threads(threads_before)


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
) -> list[T]:
    """Run ``fn(rank)`` for ``count`` ranks, each on its own thread; return the results in rank
    order. A rank that raises aborts ``groups`` (its peers' collectives raise), and the first
    failure is raised as :class:`WorkerFailed`; a signal to this process's main thread aborts
    them and raises :class:`Interrupted` once the workers stopped (or after a grace period).
    ``first_rank``: the worker number of rank 0 in errors (this process's first worker when
    the run's workers are spread over several processes)."""
    results: list[T | None] = [None] * count
    failures = _Failures()

    def entry(rank: int) -> None:
        try:
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
