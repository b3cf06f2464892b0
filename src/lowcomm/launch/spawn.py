"""Start N worker processes on this machine, or join a ``torchrun`` job."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from lowcomm.launch.devices import (
    backend_for,
    bind_device,
    check_distinct_gpus,
    check_distinct_gpus_in_store,
    check_gpu_count,
    init_options,
)
from lowcomm.launch.rendezvous import agree_generation, set_gloo_interface
from lowcomm.prestart import WORKER_MODULES, under_torchrun, use_forkserver

__all__ = [
    "WorkerFailed",
    "backend_for",
    "end_by_sigkill",
    "init_from_env",
    "launch_folder",
    "leave_failed_rank",
    "spawn_workers",
    "under_torchrun",
]

T = TypeVar("T")

# Set in every worker: one intra-op thread each, so N workers on a few cores neither
# oversubscribe nor perturb the virtual clock's CPU-time measurement.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


#: Seconds the workers get to stop after SIGTERM before they are killed.
STOP_GRACE_S = 5.0

#: In a worker started by :func:`spawn_workers`: the launch's folder of results and failure
#: records (None elsewhere).
_RESULT_DIR: str | None = None


class Interrupted(RuntimeError):
    """The launcher got SIGINT or SIGTERM; every worker has been stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")


class _LauncherSignal(BaseException):
    """Raised in the launcher's main thread by its SIGINT/SIGTERM handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _WorkerStop(BaseException):
    """Raised in a worker by SIGTERM (the launcher stopping it), like KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    raise _WorkerStop(signum)


class WorkerFailed(RuntimeError):
    """A worker process raised or died; the message carries its rank and error."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker {rank} failed: {message}")
        self.rank = rank
        self.message = message


def init_from_env(*, device: str, timeout_s: float) -> None:
    """Join the process group described by torchrun's environment variables, on this
    process's device (``cuda:LOCAL_RANK`` for cuda, checked against the node's GPUs)."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    bound = bind_device(
        device,
        int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(local_world) if local_world else None,
    )
    options = init_options(bound, timeout_s)
    timeout = options["timeout"]
    interface = set_gloo_interface()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"lowcomm: {socket.gethostname()}: {interface}", file=sys.stderr, flush=True)
    if not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} <= set(os.environ):
        dist.init_process_group(**options)  # (init_method's own variables)
        check_distinct_gpus(bound)
        return
    # The store is made here, not by init_process_group, so that the GPUs are checked through
    # it before NCCL starts. Under torchrun it is the agent's, kept across elastic restarts:
    # each group meets under a prefix of its own (agree_generation: the restart count can
    # differ between the members of one group). Without torchrun, rank 0 serves it, as the
    # env:// rendezvous does.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    generation = agree_generation(store, rank, world_size, timeout.total_seconds())
    group_store = dist.PrefixStore(f"lowcomm/generation{generation}", store)  # type: ignore[attr-defined]
    check_distinct_gpus_in_store(group_store, rank, world_size, bound, timeout_s)
    dist.init_process_group(store=group_store, rank=rank, world_size=world_size, **options)


def leave_failed_rank(error: BaseException) -> NoReturn:
    """End this torchrun rank at once after ``error``, as the local spawner ends a failed
    worker: without ``destroy_process_group()``, which would wait on the collective that failed
    (with NCCL, until its watchdog fires) while the agent waits on this process. A refusal
    (``ValueError``: ConfigError, DataError) is said in one line, exit status 2; an interrupt
    exits 130; anything else prints its traceback for torchrun's log, exit status 1."""
    if isinstance(error, ValueError | WorkerFailed):  # (a thread of this process failed)
        print(f"lowcomm: error: {error}", file=sys.stderr)
        code = 1 if isinstance(error, WorkerFailed) else 2
    elif isinstance(error, KeyboardInterrupt):
        print("lowcomm: interrupted", file=sys.stderr)
        code = 130
    else:
        traceback.print_exception(error, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch_folder() -> Path | None:
    """The launch's folder of results and records, in a worker that :func:`spawn_workers`
    started (None elsewhere: under torchrun, or in the launcher): where a worker that ends by
    plan (:func:`end_by_sigkill`) leaves what its peers need of it."""
    return None if _RESULT_DIR is None else Path(_RESULT_DIR)


def end_by_sigkill(reason: str) -> NoReturn:
    """End this worker process now by SIGKILL, as a planned end (a declared crash): it leaves
    no result and no failure record, its peers' groups that leave it out go on (each group's
    connections are its own; the spawner's store is a file, served by no worker), and the
    launcher counts it done, not failed (:func:`spawn_workers`). Only in a worker that
    :func:`spawn_workers` started: under torchrun the agent would restart every worker.

    Args:
        reason: what ended it, for the launch's record.
    """
    if _RESULT_DIR is None:
        raise RuntimeError(
            "end_by_sigkill: only a worker process started by spawn_workers may end by plan"
        )
    rank = os.environ["RANK"]
    (Path(_RESULT_DIR) / f"rank{rank}.gone").write_text(reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL ends the process")


def _worker_entry(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    store_path: str,
    result_dir: str,
    device: str,
    timeout_s: float,
    environment: dict[str, str],
    cwd: str,
) -> None:
    # SIGTERM (the launcher stopping the run) unwinds like SIGINT does, so the run files are
    # closed; either ends this worker without a failure record.
    signal.signal(signal.SIGTERM, _raise_stop)
    global _RESULT_DIR
    _RESULT_DIR = result_dir
    # A forkserver child inherits the server's environment and directory, taken when the
    # server started: make them this launch's, as a spawned interpreter would have them.
    for key in set(os.environ) - set(environment):
        del os.environ[key]
    os.environ.update(environment)
    os.environ.update(_WORKER_ENV)
    os.chdir(cwd)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        bound = bind_device(device, local_rank, local_world_size=world_size)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        check_distinct_gpus_in_store(store, local_rank, world_size, bound, timeout_s)
        dist.init_process_group(
            store=store, rank=local_rank, world_size=world_size, **init_options(bound, timeout_s)
        )
        result = fn(*args)
        torch.save(result, Path(result_dir) / f"rank{local_rank}.pt")
    except (KeyboardInterrupt, _WorkerStop) as stop:
        # Stopped, not failed (the launcher was interrupted, or died: torch's spawner asks for
        # SIGINT when the parent dies). Leave at once, without a failure record.
        code = stop.signum if isinstance(stop, _WorkerStop) else signal.SIGINT
        sys.stderr.flush()
        os._exit(128 + int(code))
    except BaseException as error:
        # Leave the time and full traceback where the parent can find the first failure, then
        # fail this process. (A peer of a failed worker fails too, slightly later, with a
        # "connection closed" error: the earliest failure is the cause.)
        record: dict[str, object] = {"time": time.time(), "traceback": traceback.format_exc()}
        if isinstance(error, WorkerFailed):  # one of this process's worker threads
            record.update(worker=error.rank, message=error.message)
        (Path(result_dir) / f"rank{local_rank}.err").write_text(json.dumps(record))
        # Exit now: tearing the group down would wait on the collective that failed (a hung
        # peer could hold this worker for as long as it hangs).
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _start_method(fn: Callable[..., Any]) -> str:
    """``forkserver`` with torch and ``fn``'s module imported once in the server, so each
    worker is a fork of an interpreter that has already paid the imports (about 2 s of CPU
    per worker: with 16 workers on 2 cores, most of the start-up); ``spawn`` where there is
    no forkserver (not POSIX).

    The server is a fresh interpreter started on first use, or earlier by
    :func:`lowcomm.prestart.start_forkserver` (not a fork of this process, whose OpenMP and
    Gloo threads a fork would copy half-alive), and imports nothing that starts threads or
    touches CUDA, so forking it is safe.
    """
    modules = [*WORKER_MODULES, __name__]
    if getattr(fn, "__module__", None) not in (None, "__main__"):
        modules.append(fn.__module__)
    return "forkserver" if use_forkserver(modules) else "spawn"


def spawn_workers(
    fn: Callable[..., T],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    device: str = "cpu",
    timeout_s: float = 300.0,
    log_path: Path | None = None,
) -> list[T]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in one process group.

    ``fn`` must be importable (defined at module level). Each process gets one intra-op
    thread. If any worker raises or dies, the others are terminated and
    :class:`WorkerFailed` names the first failing rank and its error; the failing workers'
    tracebacks go to ``log_path`` if given, else to stderr. A worker that ends by
    :func:`end_by_sigkill` (a planned end) has not failed: the others go on.

    SIGINT or SIGTERM sent to this (the launching) process stops every worker: each gets
    SIGTERM, and any still alive :data:`STOP_GRACE_S` seconds later SIGKILL; then
    :class:`Interrupted` is raised. (Called outside the main thread, the launcher's signals
    are left alone.)

    Returns:
        Each rank's return value, in rank order (None for a rank that ended by
        :func:`end_by_sigkill`).
    """
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} must be >= 1")
    if device == "cuda":
        check_gpu_count(world_size)  # before any process starts
    scratch = tempfile.mkdtemp(prefix="lowcomm-spawn-")
    try:
        with _LauncherSignals() as signals:
            with _worker_environment():  # inherited by the spawned interpreters at start-up
                store = os.path.join(scratch, "store")
                entry = (fn, args, world_size, store, scratch, device, timeout_s, dict(os.environ))
                context = start_processes(  # type: ignore[no-untyped-call]
                    _worker_entry,
                    args=(*entry, os.getcwd()),
                    nprocs=world_size,
                    join=False,
                    start_method=_start_method(fn),
                )
            _join(context, signals, scratch, log_path)
        return [_result(Path(scratch), r) for r in range(world_size)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _result(scratch: Path, rank: int) -> Any:
    """Rank ``rank``'s return value (None: it ended by plan, :func:`end_by_sigkill`)."""
    if (scratch / f"rank{rank}.gone").exists():
        return None
    return torch.load(scratch / f"rank{rank}.pt", weights_only=False)


def _planned_end(scratch: str, rank: int) -> bool:
    """Whether worker ``rank`` ended by :func:`end_by_sigkill` (it wrote its record first)."""
    return (Path(scratch) / f"rank{rank}.gone").exists()


def _wait_workers(context: Any, scratch: str, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the workers; True once every one has ended. torch's
    ``ProcessContext.join``, except that a worker that ended by plan (:func:`end_by_sigkill`)
    is done, not failed. On a failure the others are stopped (SIGTERM, then SIGKILL after
    30 s) and ``ProcessExitedException`` names the failed one, as torch's join does."""
    import multiprocessing.connection

    ready = multiprocessing.connection.wait(list(context.sentinels), timeout=timeout_s)
    for sentinel in ready:
        index = context.sentinels.pop(sentinel)
        process = context.processes[index]
        process.join()
        code = process.exitcode
        if code == 0:
            continue
        if _planned_end(scratch, index):
            reason = (Path(scratch) / f"rank{index}.gone").read_text()
            print(
                f"lowcomm: worker process {index} (pid {process.pid}) ended by "
                f"{_signal_name(code)} as planned: {reason}",
                flush=True,
            )
            continue
        for other in context.processes:
            if other.is_alive():
                other.terminate()
        deadline = time.monotonic() + 30.0
        for other in context.processes:
            other.join(timeout=max(0.0, deadline - time.monotonic()))
            if other.is_alive():
                other.kill()
            other.join()
        if os.access(context.error_files[index], os.R_OK):  # (raised before its own handler)
            with open(context.error_files[index], "rb") as raised:
                trace = pickle.load(raised)
            message = f"\n\n-- Process {index} terminated with the following error:\n{trace}"
            raise ProcessRaisedException(message, index, process.pid)
        if code < 0:
            name = _signal_name(code)
            raise ProcessExitedException(
                f"process {index} terminated with signal {name}", error_index=index,
                error_pid=process.pid, exit_code=code, signal_name=name,
            )  # fmt: skip
        raise ProcessExitedException(
            f"process {index} terminated with exit code {code}", error_index=index,
            error_pid=process.pid, exit_code=code,
        )  # fmt: skip
    return not context.sentinels


def _signal_name(code: int) -> str:
    """The name of the signal that ended a process with exit code ``code`` (negative)."""
    return signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)


@contextmanager
def _worker_environment() -> Iterator[None]:
    """This process's environment with :data:`_WORKER_ENV` set, restored afterwards."""
    saved_env = {key: os.environ.get(key) for key in _WORKER_ENV}
    os.environ.update(_WORKER_ENV)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _join(context: Any, signals: _LauncherSignals, scratch: str, log_path: Path | None) -> None:
    """Wait for every worker; stop them all on a signal to the launcher (:class:`Interrupted`)
    or on the first failure (:class:`WorkerFailed`)."""
    # torch logs each survivor it terminates after a failure: the failure's own line says what
    # happened.
    quiet = _Quiet("torch.multiprocessing.spawn")
    try:
        signals.arm()  # a signal during the start was held until now
        while not _wait_workers(context, scratch, 1.0):
            pass
        signals.disarm()
    except _LauncherSignal as received:
        signals.disarm()
        _stop_workers(context.processes, signals)
        raise Interrupted(received.signum) from None
    except (ProcessRaisedException, ProcessExitedException) as error:
        signals.disarm()
        exit_codes = [process.exitcode for process in context.processes]
        raise _first_failure(scratch, error.error_index, str(error), exit_codes, log_path) from None
    finally:
        quiet.restore()


class _Quiet:
    """Raise a logger's level to ERROR until :meth:`restore`."""

    def __init__(self, name: str) -> None:
        import logging

        self._logger = logging.getLogger(name)
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def restore(self) -> None:
        self._logger.setLevel(self._level)


class _LauncherSignals:
    """SIGINT and SIGTERM handlers of the launcher while its workers run.

    Until :meth:`arm` (while the workers are being started) a signal is only recorded, so no
    started worker is left unaccounted for; armed, the first one raises
    :class:`_LauncherSignal` in the main thread; disarmed (while stopping), signals are
    recorded, and a second one hurries the stop.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._armed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _LauncherSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self._armed:
            self._armed = False
            raise _LauncherSignal(signum)

    def arm(self) -> None:
        if self.received:
            raise _LauncherSignal(self.received[0])
        self._armed = True

    def disarm(self) -> None:
        self._armed = False


def _stop_workers(processes: list[Any], signals: _LauncherSignals) -> None:
    """SIGTERM every live worker, SIGKILL those alive after the grace period (or at a second
    signal), and reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    already = len(signals.received)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.is_alive() for p in processes):
        if time.monotonic() >= deadline or len(signals.received) > already:
            break
        time.sleep(0.05)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()


def _first_failure(
    scratch: str,
    reported_rank: int,
    reported: str,
    exit_codes: list[int | None],
    log_path: Path | None = None,
) -> WorkerFailed:
    """Find the failure that caused the others; its traceback goes to ``log_path`` (every
    failing worker's, and the message names the file) or, without one, to stderr.

    When one worker fails, its peers fail moments later on the broken connection, and the
    launcher may notice any of them first. A worker killed by a signal (other than the
    SIGTERM the launcher sends to the survivors, and other than a planned kill: a declared
    crash) records nothing and is the cause; otherwise the earliest recorded exception is.
    """
    records: list[tuple[float, int, str]] = []
    named: dict[int, tuple[int, str]] = {}  # process: (worker, message) it named itself
    for path in Path(scratch).glob("rank*.err"):
        try:
            record = json.loads(path.read_text())
            records.append((float(record["time"]), int(path.stem[4:]), str(record["traceback"])))
            if "worker" in record:
                named[int(path.stem[4:])] = (int(record["worker"]), str(record["message"]))
        except (OSError, ValueError, KeyError):
            continue
    recorded = {rank for _, rank, _ in records}
    for rank, code in enumerate(exit_codes):
        # (A worker killed by plan, a declared crash, is not the cause.)
        unplanned = rank not in recorded and not _planned_end(scratch, rank)
        if unplanned and code is not None and code < 0 and code != -signal.SIGTERM:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            message = f"killed by {name} (exit code {code})"
            cause = (
                "a signal leaves no traceback (SIGKILL is also what the kernel's out-of-memory "
                "killer sends: see dmesg)"
            )
            tracebacks = [(f"traceback of worker {r}", text) for _, r, text in sorted(records)]
            if _write_log(log_path, [(f"worker {rank} {message}", cause), *tracebacks]):
                return WorkerFailed(rank, f"{message} (details in {log_path})")
            return WorkerFailed(rank, message)
    if not records:
        return WorkerFailed(
            reported_rank, reported.strip().splitlines()[-1] if reported.strip() else reported
        )
    _, rank, text = min(records)
    if rank in named:
        # A process of several workers: it named the failing worker and wrote the traceback.
        return WorkerFailed(*named[rank])
    lines = [line for line in text.strip().splitlines() if line.strip()]
    message = lines[-1] if lines else reported
    tracebacks = [(f"traceback of worker {other}", txt) for _, other, txt in sorted(records)]
    if not _write_log(log_path, tracebacks):
        print(f"--- traceback of worker {rank} ---\n{text.rstrip()}", file=sys.stderr)
        return WorkerFailed(rank, message)
    return WorkerFailed(rank, f"{message} (traceback in {log_path})")


def _write_log(log_path: Path | None, entries: list[tuple[str, str]]) -> bool:
    """Append each (heading, text) to ``log_path``; False if there is none or it cannot be
    written."""
    if log_path is None:
        return False
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            stamp = datetime.datetime.now().isoformat(timespec="seconds")
            for heading, text in entries:
                log.write(f"--- {stamp}: {heading} ---\n{text.rstrip()}\n")
    except OSError:
        return False
    return True
