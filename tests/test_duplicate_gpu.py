"""Two ranks on one physical GPU are refused through the rendezvous store, before any NCCL
communicator exists (NCCL would fail first with its own "Duplicate GPU detected", naming
neither the ranks nor the fix). The exchange runs on CPU: each rank's (host, GPU UUID) is given."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from lowcomm.launch.devices import check_distinct_gpus_in_store
from lowcomm.launch.rendezvous import GENERATION_KEY


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


def test_a_launch_without_torchrun_meets_in_a_store_lowcomm_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT alone (srun, a hand launch): the store is
    made by lowcomm (rank 0 serves it, as env:// does), so the GPU check can run in it before
    NCCL; one Gloo rank on loopback."""
    from lowcomm.launch.spawn import init_from_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "lo",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    init_from_env(device="cpu", timeout_s=10.0)
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        assert client.check([GENERATION_KEY])
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
