"""Two ranks on one physical GPU are refused through the rendezvous store, before any NCCL
communicator exists (NCCL would fail first with its own "Duplicate GPU detected", naming
neither the ranks nor the fix). The exchange runs on CPU: each rank's (host, GPU UUID) is given."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from lowcomm.launch.devices import check_distinct_gpus_in_store


def _check_all(placements: list[tuple[str, str]]) -> list[str | None]:
    store = dist.HashStore()  # type: ignore[attr-defined]
    outcomes: list[str | None] = [None] * len(placements)

    def check(rank: int) -> None:
        try:
            check_distinct_gpus_in_store(
                store, rank, len(placements), torch.device("cuda", 0), 10.0, mine=placements[rank]
            )
        except ValueError as refused:
            outcomes[rank] = str(refused)

    threads = [threading.Thread(target=check, args=(r,)) for r in range(len(placements))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return outcomes


def test_ranks_on_one_gpu_are_refused_alike_before_the_group_exists() -> None:
    outcomes = _check_all([("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1"), ("a", "GPU-1")])
    for outcome in outcomes:
        assert outcome is not None and "a GPU GPU-1: ranks 0, 3" in outcome, outcome
        assert "at most one process per GPU per node" in outcome


def test_ranks_on_their_own_gpus_pass() -> None:
    assert _check_all([("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1")]) == [None, None, None]


def test_cpu_ranks_exchange_nothing() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    check_distinct_gpus_in_store(store, 0, 2, torch.device("cpu"), 0.1)  # no wait for rank 1
    assert not store.check(["lowcomm/placement/0"])
