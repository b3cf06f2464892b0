"""The comm layer across real Gloo processes: collectives, clocks, failures."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from lowcomm.comm import (
    CollectiveKind,
    Comm,
    NetworkComm,
    NetworkProfile,
    RealClock,
    Role,
    VirtualClock,
)
from lowcomm.launch import WorkerFailed, spawn_workers


def _collectives() -> dict[str, torch.Tensor]:
    from lowcomm.comm.torch_comm import TorchComm

    return collectives_on(TorchComm())


def collectives_on(comm: Comm) -> dict[str, torch.Tensor]:
    """Every collective once on ``comm`` (one rank's view); what each left in its tensor.
    (Also run on the in-process comm by test_comm_inprocess.py.)"""
    rank, world = comm.rank, comm.world_size
    out: dict[str, torch.Tensor] = {}
    x = torch.full((4,), float(rank + 1))
    comm.all_reduce(x, op="mean", role=Role.GRADIENT).wait()
    out["mean"] = x
    y = torch.full((4,), float(rank + 1))
    comm.all_reduce(y, op="sum", role=Role.GRADIENT).wait()
    out["sum"] = y
    z = torch.tensor([float(rank)])
    comm.all_reduce(z, op="max", role=Role.OTHER).wait()
    out["max"] = z
    full = torch.arange(2.0 * world) + 10 * rank
    shard = torch.empty(2)
    comm.reduce_scatter(shard, full, op="sum", role=Role.GRADIENT).wait()
    out["rs"] = shard
    shard_mean = torch.empty(2, 1)  # any shape of the right size
    comm.reduce_scatter(shard_mean, full, op="mean", role=Role.GRADIENT).wait()
    out["rs_mean"] = shard_mean.reshape(-1)
    shard_max = torch.empty(2)
    comm.reduce_scatter(shard_max, full, op="max", role=Role.GRADIENT).wait()
    out["rs_max"] = shard_max
    gathered = torch.empty(2 * world)
    comm.all_gather(gathered, torch.tensor([float(rank), -float(rank)]), role=Role.PARAMETER).wait()
    out["ag"] = gathered
    b = torch.full((3,), float(rank))
    comm.broadcast(b, src=world - 1, role=Role.PARAMETER).wait()
    out["bcast"] = b
    comm.barrier().wait()
    return out


def test_torch_comm_collectives_on_three_ranks() -> None:
    check_three_ranks(spawn_workers(_collectives, 3))


def check_three_ranks(results: list[dict[str, torch.Tensor]]) -> None:
    """What :func:`collectives_on` must give on three ranks."""
    for rank, out in enumerate(results):
        assert torch.allclose(out["mean"], torch.full((4,), 2.0))
        assert torch.allclose(out["sum"], torch.full((4,), 6.0))
        assert out["max"].item() == 2.0
        expected = sum(torch.arange(6.0) + 10 * r for r in range(3))[2 * rank : 2 * rank + 2]
        assert torch.allclose(out["rs"], expected)
        assert torch.allclose(out["rs_mean"], expected / 3)
        assert torch.equal(out["rs_max"], torch.arange(2.0 * rank, 2.0 * rank + 2) + 20)
        assert torch.allclose(out["ag"], torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0]))
        assert torch.allclose(out["bcast"], torch.full((3,), 2.0))


def _reduce_scatter_against_gloos_own() -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    generator = torch.Generator().manual_seed(comm.rank)
    full = torch.randn(comm.world_size * 1000, generator=generator)
    ours, gloos = torch.empty(1000), torch.empty(1000)
    comm.reduce_scatter(ours, full, op="sum", role=Role.GRADIENT).wait()
    dist.reduce_scatter_tensor(gloos, full.clone())
    return ours, gloos


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_on_gloo_equals_gloos_own(world: int) -> None:
    """On Gloo a reduce-scatter is an exchange (all_to_all_single) and a local sum, which
    moves the ring's bytes where Gloo's own moves an all-reduce's: the same result, bit for
    bit on 2 ranks, to rounding on more."""
    for ours, gloos in spawn_workers(_reduce_scatter_against_gloos_own, world):
        if world == 2:
            assert torch.equal(ours, gloos)
        else:
            assert torch.allclose(ours, gloos, rtol=1e-6, atol=1e-6)


PROFILE = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=20.0)


def _virtual_staggered() -> tuple[float, float, float]:
    """Rank r computes r+1 declared seconds, then all-reduces; returns (launch, end, exposed)."""
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    clock = VirtualClock(seconds_per_microbatch=1.0, speed_factor=float(raw.rank + 1))
    comm = NetworkComm(raw, PROFILE, clock)
    clock.microbatch_done()
    launch = clock.now()
    comm.all_reduce(torch.ones(250_000), role=Role.GRADIENT).wait()
    return launch, clock.now(), clock.exposed_comm_s


@pytest.mark.slow
def test_virtual_collective_starts_when_the_last_participant_arrives() -> None:
    results = spawn_workers(_virtual_staggered, 3)
    cost = PROFILE.collective_time(CollectiveKind.ALL_REDUCE, 1e6, 3)
    launches = [r[0] for r in results]
    assert launches == pytest.approx([1.0, 2.0, 3.0])  # the straggler's factor shows
    for launch, end, exposed in results:
        assert end == pytest.approx(3.0 + cost)  # everyone agrees on the completion
        assert exposed == pytest.approx(3.0 + cost - launch)


def _virtual_done_polling() -> list[bool]:
    """done() answers by the virtual clock: poll it while 'computing' in declared steps."""
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    cost = PROFILE.collective_time(CollectiveKind.ALL_REDUCE, 1e6, raw.world_size)
    clock = VirtualClock(seconds_per_microbatch=cost / 4)
    comm = NetworkComm(raw, PROFILE, clock)
    handle = comm.all_reduce(torch.ones(250_000), role=Role.GRADIENT)
    answers = []
    for _ in range(6):
        answers.append(handle.done())
        clock.microbatch_done()
    handle.wait()
    return answers


@pytest.mark.slow
def test_virtual_done_follows_the_virtual_clock() -> None:
    for answers in spawn_workers(_virtual_done_polling, 2):
        # After k quarter-costs of compute: done exactly from k = 4 on.
        assert answers == [False, False, False, False, True, True]


def _real_allreduce_timing() -> tuple[float, float]:
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    comm = NetworkComm(
        raw, NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=150.0), RealClock()
    )
    raw.barrier().wait()
    begin = time.perf_counter()
    handle = comm.all_reduce(torch.ones(1000), role=Role.GRADIENT)
    handle.wait()
    blocking = time.perf_counter() - begin
    raw.barrier().wait()
    begin = time.perf_counter()
    handle = comm.all_reduce(torch.ones(1000), role=Role.GRADIENT)
    time.sleep(0.3)  # compute as long as the modeled transfer
    handle.wait()
    overlapped = time.perf_counter() - begin
    return blocking, overlapped


@pytest.mark.slow
def test_real_clock_delays_and_overlaps_across_processes() -> None:
    cost = 2 * 1 * 0.150 + 4000 / 125e6  # two ranks: 2 (M-1) l + transfer
    for blocking, overlapped in spawn_workers(_real_allreduce_timing, 2):
        assert blocking >= cost
        assert blocking < cost + 2.0  # generous upper bound on a shared machine
        assert cost <= overlapped < 2 * cost  # total is the max, not the sum


def _settled_after_a_late_peer() -> tuple[float, float, float | None]:
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    clock = RealClock()
    comm = NetworkComm(raw, NetworkProfile(), clock)  # --network none: the model costs nothing
    raw.barrier().wait()
    if raw.rank == 1:
        time.sleep(0.5)  # the peer launches late: rank 0's data arrives 0.5 s after its launch
    launched = clock.now()
    handle = comm.all_reduce(torch.ones(1000), role=Role.GRADIENT)
    time.sleep(1.0)  # compute past the arrival
    settled = handle.settle()
    handle.wait()
    return launched, clock.now(), settled.finish_time


def test_a_settled_collective_on_the_real_clock_completes_when_its_data_arrived() -> None:
    """What CoCoDC reads as its sync time: with no modeled cost (--network none) the settled
    completion is the data's arrival, not the launch, and never after the settle."""
    (launched0, settled0, finish0), (launched1, settled1, finish1) = spawn_workers(
        _settled_after_a_late_peer, 2
    )
    assert finish0 is not None and finish1 is not None
    assert launched0 <= finish0 <= settled0 and launched1 <= finish1 <= settled1
    assert 0.4 <= finish0 - launched0 < 1.0  # rank 0's data waited for the late peer
    assert finish1 - launched1 < 0.4


def _raise_on_rank_one() -> None:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    if comm.rank == 1:
        raise RuntimeError("injected failure on purpose")
    comm.barrier().wait()  # rank 0 would wait here forever without the launcher


@pytest.mark.slow
def test_a_raising_worker_ends_the_run_with_its_error() -> None:
    begin = time.perf_counter()
    with pytest.raises(WorkerFailed, match="worker 1 failed: RuntimeError: injected failure"):
        spawn_workers(_raise_on_rank_one, 2, timeout_s=60)
    assert time.perf_counter() - begin < 50  # ended by the launcher, not the 60 s timeout


def _killed_rank_one() -> None:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier().wait()


@pytest.mark.slow
def test_a_killed_worker_ends_the_run() -> None:
    begin = time.perf_counter()
    with pytest.raises(WorkerFailed, match="worker 1 failed: killed by SIGKILL"):
        spawn_workers(_killed_rank_one, 2, timeout_s=60)
    assert time.perf_counter() - begin < 50
