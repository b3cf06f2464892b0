"""Which device a worker process runs on, and how its process group is made for it.

One GPU per process: local rank ``r`` of a node drives ``cuda:r``. Two processes on one GPU
would share its memory and NCCL refuses (or hangs on) two ranks of one communicator on one
device, so more processes than GPUs on a node is an error here, with the fix, rather than a
cryptic NCCL failure later.
"""

from __future__ import annotations

from typing import Any

import torch

from lowcomm.comm.torch_comm import process_group_timeout


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


def bind_device(device: str, local_rank: int, *, local_world_size: int | None = None) -> torch.device:
    """Make this process's device current and return it: ``cuda:local_rank`` for cuda (after
    checking the node has a GPU for it), the CPU otherwise.

    Raises:
        ValueError: when the node has fewer GPUs than processes, naming the fix.
    """
    if device != "cuda":
        return torch.device("cpu")
    check_gpu_count(max(local_rank + 1, local_world_size or 0))
    gpu = torch.device("cuda", local_rank)
    torch.cuda.set_device(gpu)
    return gpu


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


__all__ = ["backend_for", "bind_device", "check_gpu_count", "init_options"]
