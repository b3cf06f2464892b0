"""Start N worker processes on this machine, or join a ``torchrun`` job."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from lowcomm.prestart import WORKER_MODULES, under_torchrun, use_forkserver

__all__ = ["WorkerFailed", "backend_for", "init_from_env", "spawn_workers", "under_torchrun"]

T = TypeVar("T")

# Set in every worker: one intra-op thread each, so N workers on a few cores neither
# oversubscribe nor perturb the virtual clock's CPU-time measurement.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


class WorkerFailed(RuntimeError):
    """A worker process raised or died; the message carries its rank and error."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker {rank} failed: {message}")
        self.rank = rank
        self.message = message


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_from_env(*, device: str, timeout_s: float) -> None:
    """Join the process group described by torchrun's environment variables."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restarts is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend_for(device), timeout=timeout)
        return
    # An elastic restart reuses the agent's store: without a per-attempt prefix the new
    # workers would read the dead attempt's Gloo addresses and fail to connect.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    dist.init_process_group(
        backend_for(device),
        store=dist.PrefixStore(f"lowcomm/attempt{restarts}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


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
    # A forkserver child inherits the server's environment and directory, taken when the
    # server started: make them this launch's, as a spawned interpreter would have them.
    for key in set(os.environ) - set(environment):
        del os.environ[key]
    os.environ.update(environment)
    os.environ.update(_WORKER_ENV)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=local_rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(*args)
        torch.save(result, Path(result_dir) / f"rank{local_rank}.pt")
    except BaseException:
        # Leave the time and full traceback where the parent can find the first failure, then
        # fail this process. (A peer of a failed worker fails too, slightly later, with a
        # "connection closed" error: the earliest failure is the cause.)
        record = {"time": time.time(), "traceback": traceback.format_exc()}
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
) -> list[T]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in one process group.

    ``fn`` must be importable (defined at module level). Each process gets one intra-op
    thread. If any worker raises or dies, the others are terminated and
    :class:`WorkerFailed` names the first failing rank and its error.

    Returns:
        Each rank's return value, in rank order.
    """
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} must be >= 1")
    scratch = tempfile.mkdtemp(prefix="lowcomm-spawn-")
    try:
        store_path = os.path.join(scratch, "store")
        saved_env = {key: os.environ.get(key) for key in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)  # inherited by the spawned interpreters at start-up
        try:
            context = start_processes(  # type: ignore[no-untyped-call]
                _worker_entry,
                args=(
                    fn,
                    args,
                    world_size,
                    store_path,
                    scratch,
                    device,
                    timeout_s,
                    dict(os.environ),
                    os.getcwd(),
                ),
                nprocs=world_size,
                join=False,
                start_method=_start_method(fn),
            )
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            while not context.join(timeout=1.0):
                pass
        except (ProcessRaisedException, ProcessExitedException) as error:
            exit_codes = [process.exitcode for process in context.processes]
            raise _first_failure(scratch, error.error_index, str(error), exit_codes) from None
        return [torch.load(Path(scratch) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _first_failure(
    scratch: str, reported_rank: int, reported: str, exit_codes: list[int | None]
) -> WorkerFailed:
    """Find the failure that caused the others, and print its traceback to stderr.

    When one worker fails, its peers fail moments later on the broken connection, and the
    launcher may notice any of them first. A worker killed by a signal (other than the
    SIGTERM the launcher sends to the survivors) records nothing and is the cause; otherwise
    the earliest recorded exception is.
    """
    records: list[tuple[float, int, str]] = []
    for path in Path(scratch).glob("rank*.err"):
        try:
            record = json.loads(path.read_text())
            records.append((float(record["time"]), int(path.stem[4:]), str(record["traceback"])))
        except (OSError, ValueError, KeyError):
            continue
    recorded = {rank for _, rank, _ in records}
    for rank, code in enumerate(exit_codes):
        if code is not None and code < 0 and code != -signal.SIGTERM and rank not in recorded:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return WorkerFailed(rank, f"killed by {name} (exit code {code})")
    if not records:
        return WorkerFailed(reported_rank, reported.strip().splitlines()[-1] if reported.strip() else reported)
    _, rank, text = min(records)
    print(f"--- traceback of worker {rank} ---\n{text.rstrip()}", file=sys.stderr)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return WorkerFailed(rank, lines[-1] if lines else reported)
