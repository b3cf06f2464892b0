"""Which device a worker process runs on, and how its process group is made for it.

One GPU per process: local rank ``r`` of a node drives ``cuda:r``, unless the launcher gave
each process a GPU of its own (``CUDA_VISIBLE_DEVICES`` naming a single device, as SLURM's
``--gpus-per-task=1`` does), in which case every process drives its only visible device,
``cuda:0``. Two processes on one GPU would share its memory and NCCL refuses (or hangs on) two
ranks of one communicator on one device, so more processes than GPUs on a node is an error
here, with the fix, rather than a cryptic NCCL failure later; at the rendezvous, before any
NCCL communicator, :func:`check_distinct_gpus_in_store` verifies through the store that no two
ranks drive the same physical GPU (:func:`check_distinct_gpus`: the same on a group already
made).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lowcomm.comm.torch_comm import process_group_timeout

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig


def backend_for(device: str) -> str:
    """The ``torch.distributed`` backend of a device kind: NCCL for cuda, else Gloo."""
    return "nccl" if device == "cuda" else "gloo"


def check_gpu_count(processes_per_node: int, *, available: int | None = None) -> None:
    """Raise if a node would run more processes than it has GPUs.

    Raises:
        ValueError: naming the counts and the fix.
    """
    count = torch.cuda.device_count() if available is None else available
    if count == 0:
        raise ValueError(
            "--device cuda: no GPU is visible to this process (torch.cuda.device_count() is 0); "
            "check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu"
        )
    if processes_per_node > count:
        raise ValueError(
            f"--device cuda: {processes_per_node} processes on this node but {count} GPU(s) "
            f"visible; run at most {count} processes per node (--workers / --nproc-per-node), "
            f"one per GPU"
        )


def given_own_gpu(visible: int, cuda_visible_devices: str | None) -> bool:
    """Whether the launcher gave this process exactly one GPU of its own: one device visible,
    selected by a ``CUDA_VISIBLE_DEVICES`` that names a single device."""
    if visible != 1 or cuda_visible_devices is None:
        return False
    names = [name for name in cuda_visible_devices.split(",") if name.strip()]
    return len(names) == 1


def bind_device(
    device: str, local_rank: int, *, local_world_size: int | None = None
) -> torch.device:
    """Make this process's device current and return it: ``cuda:local_rank`` for cuda (after
    checking the node has a GPU for it), or ``cuda:0`` when the launcher gave this process a
    GPU of its own; the CPU otherwise.

    Raises:
        ValueError: when the node has fewer GPUs than processes, naming the fix.
    """
    if device != "cuda":
        return torch.device("cpu")
    if given_own_gpu(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")):
        gpu = torch.device("cuda", 0)
    else:
        check_gpu_count(max(local_rank + 1, local_world_size or 0))
        gpu = torch.device("cuda", local_rank)
    torch.cuda.set_device(gpu)
    return gpu


def shared_gpus(placements: Sequence[tuple[str, str]]) -> list[str]:
    """The physical GPUs driven by more than one rank, from each rank's (host, GPU UUID), as
    readable lines ``"host GPU uuid: ranks 0, 3"``; empty when every rank has its own."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, placement in enumerate(placements):
        ranks.setdefault(placement, []).append(rank)
    return [
        f"{host} GPU {uuid}: ranks {', '.join(map(str, owners))}"
        for (host, uuid), owners in ranks.items()
        if len(owners) > 1
    ]


def check_distinct_gpus(device: torch.device) -> None:
    """After the rendezvous, refuse a job in which two ranks drive the same physical GPU
    (for example a launcher that gave several processes the same ``CUDA_VISIBLE_DEVICES``).

    Raises:
        ValueError: naming the shared GPU, its ranks and the fix.
    """
    if device.type != "cuda" or not dist.is_initialized():
        return
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    placements: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(placements, mine)
    shared = shared_gpus([tuple(p) for p in placements])
    if shared:
        raise ValueError(
            "--device cuda: two or more ranks drive the same GPU ("
            + "; ".join(shared)
            + "); give every process its own GPU (at most one process per GPU per node)"
        )


def placement(device: torch.device) -> tuple[str, str] | None:
    """This process's (host, GPU UUID) on ``device``; None off the GPU."""
    if device.type != "cuda":
        return None
    return socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)


def exchange_placements(
    store: Any, rank: int, world_size: int, mine: tuple[str, str], timeout_s: float
) -> list[tuple[str, str]]:
    """Every rank's (host, GPU UUID), through the rendezvous store (before any NCCL
    communicator exists): each rank writes its own key and reads the others'."""
    store.set(f"lowcomm/placement/{rank}", "\n".join(mine))
    keys = [f"lowcomm/placement/{other}" for other in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    out: list[tuple[str, str]] = []
    for key in keys:
        host, _, uuid = bytes(store.get(key)).decode().partition("\n")
        out.append((host, uuid))
    return out


def check_distinct_gpus_in_store(
    store: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    *,
    mine: tuple[str, str] | None = None,
) -> None:
    """Before the process group is made, refuse a job in which two ranks drive the same
    physical GPU: NCCL would otherwise fail first, with its own "Duplicate GPU detected" (or
    hang), naming neither the ranks nor the fix. ``mine``: this rank's (host, GPU UUID),
    by default :func:`placement`'s.

    Raises:
        ValueError: on every rank alike, naming the shared GPU, its ranks and the fix.
    """
    mine = placement(device) if mine is None else mine
    if mine is None:
        return
    shared = shared_gpus(exchange_placements(store, rank, world_size, mine, timeout_s))
    if shared:
        raise ValueError(
            "--device cuda: two or more ranks drive the same GPU ("
            + "; ".join(shared)
            + "); give every process its own GPU (at most one process per GPU per node)"
        )


def init_options(device: torch.device, collective_timeout_s: float) -> dict[str, Any]:
    """Keyword arguments for ``init_process_group`` on ``device``: the backend, a timeout
    longer than the collective wait's (so the wait reports a :class:`CollectiveTimeout`
    before NCCL's watchdog aborts), and for NCCL the bound device (``device_id``: no guessing
    which GPU this rank drives, and an eager communicator)."""
    options: dict[str, Any] = {
        "backend": backend_for(device.type),
        "timeout": process_group_timeout(collective_timeout_s),
    }
    if device.type == "cuda":
        options["device_id"] = device
    return options


def overlap_steps(config: TrainConfig) -> float:
    """The most optimizer steps one of the run's collectives stays queued: launched, and
    waited for that many steps later (0: each is waited for in the step that launched it).
    From the method's declaration (``Transfer.hidden_steps`` of its cost model, which depends
    on the options only: the timing handed to it here is a placeholder)."""
    from lowcomm.strategies import method_options, strategy_class
    from lowcomm.strategies.declaration import Timing

    cls = strategy_class(config.method)
    placeholder = Timing(step_seconds=1.0, all_reduce_seconds=lambda fraction: 1.0)
    transfers = cls.cost.traffic(method_options(cls, config), placeholder)
    return max((transfer.hidden_steps for transfer in transfers), default=0.0)


def watchdog_note(config: TrainConfig) -> str | None:
    """One line for the start of a run whose process groups' timeout may end it as hung
    though nothing hangs, or None.

    NCCL's watchdog counts from the launch of a collective, and an overlapped method waits
    for it ``steps`` (:func:`overlap_steps`) steps later; until the last rank launches it, it
    is not complete. Any persistent difference of speed between the ranks lets the fastest run
    ahead until that wait holds it, so a collective stays incomplete for about the whole
    window, ``steps`` steps of the slowest rank in wall time (on the virtual clock too, whose
    modeled step time is not the wall time the watchdog measures). That time is not known
    before the run, so the group's timeout is not sized from it; the line says which steps
    would exceed it and what to pass: ``--collective-timeout-s`` C + ``steps`` x S keeps C
    for a collective after its wait begins, with steps of S seconds. Said on NCCL (a GPU run
    of several processes) where a step as long as a collective may wait (C) would exceed it."""
    if config.placement.device != "cuda" or config.placement.processes < 2:
        return None
    steps = overlap_steps(config)
    allowed_s = process_group_timeout(config.comm.collective_timeout_s).total_seconds()
    if steps * config.comm.collective_timeout_s <= allowed_s:
        return None
    return (
        f"lowcomm: note: {config.method} keeps a collective queued for up to {steps:g} steps, "
        f"and NCCL's watchdog aborts a run whose collective is incomplete {allowed_s:g} s "
        f"after its launch: steps over {allowed_s / steps:.3g} s on the slowest rank would end "
        f"it though nothing hangs; for steps of S seconds pass --collective-timeout-s "
        f"{config.comm.collective_timeout_s:g} + {steps:g} x S"
    )


__all__ = [
    "backend_for",
    "bind_device",
    "check_distinct_gpus",
    "check_distinct_gpus_in_store",
    "check_gpu_count",
    "exchange_placements",
    "given_own_gpu",
    "init_options",
    "overlap_steps",
    "placement",
    "shared_gpus",
    "watchdog_note",
]
