"""Process groups of hierarchical workers (a worker made of R ranks).

Global rank ``g`` is local rank ``g % R`` of worker ``g // R``. The replica group of worker
``m`` (its ranks, on the link of ``--inner-network``) is ranks ``[m R, (m + 1) R)``; the outer
group of local index ``r`` is ranks ``{m R + r}``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lowcomm.comm.torch_comm import TorchComm, process_group_timeout


def worker_layout(
    world_size: int, ranks_per_worker: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(replica groups, outer groups) as lists of global ranks.

    Raises:
        ValueError: when ``world_size`` is not a multiple of ``ranks_per_worker``.
    """
    if ranks_per_worker < 1 or world_size % ranks_per_worker:
        raise ValueError(
            f"--ranks-per-worker: {ranks_per_worker} does not divide the world size "
            f"{world_size}; launch workers x ranks-per-worker processes"
        )
    workers = world_size // ranks_per_worker
    replica = [
        list(range(m * ranks_per_worker, (m + 1) * ranks_per_worker)) for m in range(workers)
    ]
    outer = [[m * ranks_per_worker + r for m in range(workers)] for r in range(ranks_per_worker)]
    return replica, outer


def level_comms(
    ranks_per_worker: int, timeout_s: float | None = None, *, backend: str | None = None
) -> tuple[TorchComm, TorchComm]:
    """This rank's (replica, outer) communicators, whose waits give up after ``timeout_s``
    (``--collective-timeout-s``, as the world's) with the rank and collective named. Every
    rank of the world must call it (all groups are created on every rank, in the same order,
    as torch.distributed requires). ``backend``: the groups' (None: the world's; ``gloo``:
    host groups of the same ranks, on which a GPU's virtual clock agrees on launch times)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    replica_groups, outer_groups = worker_layout(world_size, ranks_per_worker)
    timeout = None if timeout_s is None else process_group_timeout(timeout_s)
    mine: dict[str, Any] = {}
    for ranks in replica_groups:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine["replica"] = group
    for ranks in outer_groups:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine["outer"] = group
    return (
        TorchComm(mine["replica"], timeout_s=timeout_s),
        TorchComm(mine["outer"], timeout_s=timeout_s),
    )
