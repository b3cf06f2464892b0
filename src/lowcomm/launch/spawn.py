"""Start N worker processes on this machine, or join a ``torchrun`` job."""

from __future__ import annotations

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

from lowcomm.launch.devices import (
    bind_device,
    check_distinct_gpus,
    check_gpu_count,
    init_options,
)

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


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


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
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restarts is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(**options)
        check_distinct_gpus(bound)
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
        store=dist.PrefixStore(f"lowcomm/attempt{restarts}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world_size,
        **options,
    )
    check_distinct_gpus(bound)


def _worker_entry(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    store_path: str,
    result_dir: str,
    device: str,
    timeout_s: float,
) -> None:
    os.environ.update(_WORKER_ENV)
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    bound = bind_device(device, local_rank, local_world_size=world_size)
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        store=store, rank=local_rank, world_size=world_size, **init_options(bound, timeout_s)
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
    if device == "cuda":
        check_gpu_count(world_size)  # before any process starts
    scratch = tempfile.mkdtemp(prefix="lowcomm-spawn-")
    try:
        store_path = os.path.join(scratch, "store")
        saved_env = {key: os.environ.get(key) for key in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)  # inherited by the spawned interpreters at start-up
        try:
            context = start_processes(  # type: ignore[no-untyped-call]
                _worker_entry,
                args=(fn, args, world_size, store_path, scratch, device, timeout_s),
                nprocs=world_size,
                join=False,
                start_method="spawn",
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
