"""Network emulation in one process: virtual-clock arithmetic, link queueing, byte counters.

A :class:`RecordingComm` plays one rank of a group whose peers launch at the same moment, so
every modeled time here is exact. Multi-process behaviour is in test_comm_gloo.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from lowcomm.comm import (
    CollectiveKind,
    NetworkComm,
    NetworkProfile,
    RealClock,
    RecordingComm,
    Role,
    VirtualClock,
)
from lowcomm.comm.base import Charge

PROFILE = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=10.0)
WORLD = 4


def _declared(seconds: float = 0.1, factor: float = 1.0) -> VirtualClock:
    return VirtualClock(speed_factor=factor, seconds_per_microbatch=seconds)


def test_one_all_reduce_costs_the_formula_on_the_virtual_clock() -> None:
    clock = _declared()
    comm = NetworkComm(RecordingComm(world_size=WORLD), PROFILE, clock)
    tensor = torch.zeros(250_000)  # 1 MB of float32
    comm.all_reduce(tensor, role=Role.GRADIENT).wait()
    expected = 2 * 3 / 4 * 1e6 / 125e6 + 2 * 3 * 0.010
    assert clock.now() == pytest.approx(expected, rel=1e-12)
    assert clock.exposed_comm_s == pytest.approx(expected, rel=1e-12)
    assert clock.compute_s == 0.0


def test_overlap_costs_the_max_not_the_sum() -> None:
    tensor = torch.zeros(250_000)
    cost = PROFILE.collective_time(CollectiveKind.ALL_REDUCE, 1e6, WORLD)
    for compute in (cost / 2, cost * 2):
        clock = VirtualClock(seconds_per_microbatch=compute)
        comm = NetworkComm(RecordingComm(world_size=WORLD), PROFILE, clock)
        handle = comm.all_reduce(tensor, role=Role.GRADIENT)
        clock.microbatch_done()  # compute while the all-reduce is on the wire
        assert handle.done() == (compute >= cost)
        handle.wait()
        assert clock.now() == pytest.approx(max(cost, compute))
        assert clock.exposed_comm_s == pytest.approx(max(0.0, cost - compute))


def test_collectives_on_one_link_queue_behind_each_other() -> None:
    clock = _declared()
    comm = NetworkComm(RecordingComm(world_size=WORLD), PROFILE, clock)
    a, b = torch.zeros(250_000), torch.zeros(250_000)
    cost = PROFILE.collective_time(CollectiveKind.ALL_REDUCE, 1e6, WORLD)
    first = comm.all_reduce(a, role=Role.GRADIENT)
    second = comm.all_reduce(b, role=Role.PARAMETER)
    second.wait()
    assert clock.now() == pytest.approx(2 * cost)
    first.wait()  # already complete on the clock: waiting costs nothing more
    assert clock.now() == pytest.approx(2 * cost)


def test_straggler_speed_factor_scales_compute() -> None:
    slow = _declared(seconds=0.25, factor=3.0)
    slow.microbatch_done()
    slow.microbatch_done()
    assert slow.now() == pytest.approx(1.5)
    assert slow.compute_s == pytest.approx(1.5)


def test_measured_virtual_compute_uses_thread_cpu_time() -> None:
    clock = VirtualClock(speed_factor=2.0)
    begin_cpu = time.thread_time()
    total = 0
    while time.thread_time() - begin_cpu < 0.05:
        total += 1
    spent = time.thread_time() - begin_cpu
    now = clock.now()
    # Twice the CPU this thread spent (plus a hair for the loop's exit).
    assert 2 * spent <= now <= 2 * spent + 0.02
    time.sleep(0.05)  # sleeping burns no CPU, so the virtual clock does not move
    assert clock.now() - now < 0.01


def test_virtual_excluded_region_is_free() -> None:
    clock = VirtualClock()
    with clock.excluded():
        begin = time.thread_time()
        while time.thread_time() - begin < 0.03:
            pass
    assert clock.now() < 0.01


def test_byte_counters_equal_the_ring_formulas_by_role() -> None:
    clock = _declared()
    comm = NetworkComm(RecordingComm(world_size=WORLD), PROFILE, clock)
    grad = torch.zeros(1000)  # 4000 bytes
    comm.all_reduce(grad, role=Role.GRADIENT).wait()
    shard = torch.zeros(250)
    comm.reduce_scatter(shard, grad, role=Role.GRADIENT).wait()
    comm.all_gather(grad, shard, role=Role.PARAMETER).wait()
    comm.broadcast(torch.zeros(10, dtype=torch.bfloat16), src=0, role=Role.PSEUDO_GRADIENT).wait()
    assert comm.bytes_by_role[Role.GRADIENT] == pytest.approx(2 * 3 / 4 * 4000 + 3 / 4 * 4000)
    assert comm.bytes_by_role[Role.PARAMETER] == pytest.approx(3 / 4 * 4000)
    assert comm.bytes_by_role[Role.PSEUDO_GRADIENT] == pytest.approx(20)  # rank 0 = source
    assert comm.calls_by_kind[CollectiveKind.ALL_REDUCE] == 1
    assert comm.bytes_sent == pytest.approx(sum(comm.bytes_by_role.values()))


def test_real_clock_never_completes_before_the_model() -> None:
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=50.0)
    clock = RealClock()
    comm = NetworkComm(RecordingComm(world_size=2), profile, clock)
    cost = profile.collective_time(CollectiveKind.ALL_REDUCE, 400, 2)  # ~0.1 s of latency
    begin = time.perf_counter()
    handle = comm.all_reduce(torch.zeros(100), role=Role.GRADIENT)
    assert not handle.done()
    issued = time.perf_counter()
    handle.wait()
    elapsed = time.perf_counter() - begin
    assert elapsed >= cost
    assert elapsed < cost + 2.0  # generous: the machine is shared
    # The wait is exposed; what ran between the issue and the wait is compute, so the exposed
    # part alone is short of the cost by that gap (tens of microseconds under load).
    assert clock.exposed_comm_s >= cost - (issued - begin)
    assert clock.compute_s + clock.exposed_comm_s >= cost


def test_real_clock_overlap_hides_the_transfer() -> None:
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=100.0)
    clock = RealClock()
    comm = NetworkComm(RecordingComm(world_size=2), profile, clock)
    cost = profile.collective_time(CollectiveKind.ALL_REDUCE, 400, 2)  # 0.2 s
    begin = time.perf_counter()
    handle = comm.all_reduce(torch.zeros(100), role=Role.GRADIENT)
    time.sleep(cost)  # "compute" as long as the transfer
    handle.wait()
    elapsed = time.perf_counter() - begin
    assert cost <= elapsed < 2 * cost  # the max, not the sum (generous margin)
    assert clock.exposed_comm_s < cost / 2


def test_real_clock_reads_a_past_instant_across_later_excluded_regions() -> None:
    """``at(instant)`` subtracts only the excluded time before the instant: an evaluation
    between a collective's arrival and its settle does not move the arrival earlier."""
    clock = RealClock()
    before = time.perf_counter()
    reading = clock.at(before)
    entered = time.perf_counter()
    with clock.excluded():
        time.sleep(0.02)
        inside = time.perf_counter()
        time.sleep(0.02)
    left = time.perf_counter()
    assert clock.at(before) == pytest.approx(reading, abs=1e-9)
    # an instant inside the region reads as the region's start (its 0.02 s so far excluded)
    assert reading <= clock.at(inside) <= reading + (inside - before) - 0.02
    after = time.perf_counter()
    with clock.excluded():
        time.sleep(0.01)
    # only the first region (at least its 0.04 s of sleep, at most entered..left) is before
    elapsed = after - before
    assert reading + elapsed - (left - entered) <= clock.at(after) <= reading + elapsed - 0.04
    assert clock.at(before) == pytest.approx(reading, abs=1e-9)


def test_real_clock_straggler_sleeps_on_compute() -> None:
    clock = RealClock(speed_factor=3.0)
    begin = time.perf_counter()
    while time.perf_counter() - begin < 0.05:
        pass
    clock.mark()
    assert time.perf_counter() - begin >= 0.15
    assert clock.compute_s >= 0.15
    assert clock.exposed_comm_s == 0.0


def test_real_clock_says_how_much_of_its_compute_ran_on_a_core() -> None:
    """On a CPU the real clock also keeps its thread's CPU time over the compute regions:
    time the thread spends off a core (here a sleep standing in for a preemption) is compute
    on the wall but not on the thread; blocked and excluded regions count in neither."""
    clock = RealClock()
    begin = time.thread_time()
    while time.thread_time() - begin < 0.05:
        pass
    time.sleep(0.2)
    clock.mark()
    assert clock.compute_cpu_s >= 0.05
    assert clock.compute_s - clock.compute_cpu_s >= 0.2 - 0.01
    before = clock.compute_cpu_s
    for region in (clock.blocked, clock.excluded):
        with region():
            begin = time.thread_time()
            while time.thread_time() - begin < 0.05:
                pass
    clock.mark()
    assert clock.compute_cpu_s - before < 0.01
    described = clock.describe_compute()
    assert described["model"] == "wall"
    assert described["on_core"] == pytest.approx(clock.compute_cpu_s / clock.compute_s)
    assert described["waiting_s"] == pytest.approx(clock.compute_s - clock.compute_cpu_s)
    resumed = RealClock()
    resumed.load_state_dict(clock.state_dict())
    assert resumed.compute_cpu_s == clock.compute_cpu_s
    older = {k: v for k, v in clock.state_dict().items() if k != "compute_cpu_s"}
    resumed.load_state_dict(older)  # a checkpoint without it: the share is unknown
    assert resumed.describe_compute() == {"model": "wall"}


def test_a_stragglers_emulated_slowdown_is_not_a_wait_for_a_core() -> None:
    clock = RealClock(speed_factor=3.0)
    begin = time.thread_time()
    while time.thread_time() - begin < 0.05:
        pass
    clock.mark()  # sleeps 2 x the compute: slowdown, charged to compute
    described = clock.describe_compute()
    assert clock.slowdown_s >= 0.1
    assert described["slowdown_s"] == clock.slowdown_s
    assert described["waiting_s"] == pytest.approx(
        max(0.0, clock.compute_s - clock.slowdown_s - clock.compute_cpu_s)
    )
    measured = clock.compute_s - clock.slowdown_s
    assert described["on_core"] == pytest.approx(min(1.0, clock.compute_cpu_s / measured))


def test_real_clock_keeps_the_passes_it_paid() -> None:
    """On a CPU every micro-batch's wall and thread CPU time is kept: the summary gives their
    least, median and mean (the calibrated cost is set against them), and prints them."""
    from lowcomm.train.metrics import _compute_model_rows

    clock = RealClock()
    for pause in (0.03, 0.01, 0.02):
        with clock.microbatch():
            time.sleep(pause)
    passes = clock.describe_compute()["microbatch_wall_s"]
    assert isinstance(passes, dict)
    assert passes["count"] == 3
    assert passes["min"] >= 0.01 and passes["median"] >= 0.02 and passes["mean"] >= 0.02
    assert passes["min"] <= passes["median"] <= max(clock.pass_wall_s)
    cpu = clock.describe_compute()["microbatch_cpu_s"]
    assert isinstance(cpu, dict) and cpu["count"] == 3
    assert all(c <= w + 1e-3 for c, w in zip(clock.pass_cpu_s, clock.pass_wall_s, strict=True))
    rows = dict(_compute_model_rows({"compute_model": clock.describe_compute()}))
    assert rows["micro-batch"].startswith(f"median {passes['median'] * 1e3:.1f} ms, least ")
    assert rows["micro-batch"].endswith("(rank 0's 3, wall)")
    assert "compute on a core" in rows

    # Not checkpointed: a resumed clock's passes are those since the resume, and say so.
    resumed = RealClock()
    resumed.load_state_dict(clock.state_dict())
    with resumed.microbatch():
        time.sleep(0.01)
    rows = dict(_compute_model_rows({"compute_model": resumed.describe_compute()}))
    assert rows["micro-batch"].endswith("(rank 0's 1 since the resume, wall)")


def test_virtual_clock_reads_its_owner_threads_cpu_from_another_thread() -> None:
    import threading

    clock = VirtualClock()
    begin = time.thread_time()
    while time.thread_time() - begin < 0.05:
        pass
    owner_cpu = time.thread_time() - begin
    seen: list[float] = []
    helper = threading.Thread(target=lambda: seen.append(clock.now()))
    helper.start()
    helper.join()
    # The helper thread burned almost no CPU; the clock still shows the owner's compute.
    assert owner_cpu - 0.005 <= seen[0] <= owner_cpu + 0.02


def test_fused_segments_charge_each_role_its_share() -> None:
    clock = _declared()
    recording = RecordingComm(world_size=WORLD)
    comm = NetworkComm(recording, PROFILE, clock)
    fused = torch.zeros(300)  # 100 parameter + 200 first-moment elements, float32
    cost_before = clock.now()
    comm.all_reduce(
        fused, role=Role.PARAMETER, segments=[(Role.PARAMETER, 100), (Role.FIRST_MOMENT, 200)]
    ).wait()
    ring = 2 * 3 / 4
    assert comm.bytes_by_role[Role.PARAMETER] == pytest.approx(ring * 400)
    assert comm.bytes_by_role[Role.FIRST_MOMENT] == pytest.approx(ring * 800)
    # One collective: one latency, the whole payload's transfer time.
    assert clock.now() - cost_before == pytest.approx(
        PROFILE.collective_time(CollectiveKind.ALL_REDUCE, 1200, WORLD)
    )
    fused_call = next(c for c in recording.calls if c.role is Role.PARAMETER)
    assert fused_call.segments == ((Role.PARAMETER, 100), (Role.FIRST_MOMENT, 200))
    with pytest.raises(ValueError, match="segments cover 250 elements"):
        comm.all_reduce(fused, role=Role.PARAMETER, segments=[(Role.PARAMETER, 250)])


def test_a_group_that_declares_its_device_refuses_a_tensor_on_another() -> None:
    meta = torch.device("meta")
    recording = RecordingComm(world_size=WORLD, device=meta)
    comm = NetworkComm(recording, PROFILE, _declared(), device=meta)
    with pytest.raises(ValueError, match=r"all_reduce: the tensor is on cpu but the group's"):
        comm.all_reduce(torch.zeros(4), role=Role.GRADIENT)
    with pytest.raises(ValueError, match=r"all_gather: the tensor is on cpu"):
        comm.all_gather(torch.zeros(4 * WORLD, device=meta), torch.zeros(4), role=Role.PARAMETER)
    with pytest.raises(ValueError, match=r"broadcast: the tensor is on cpu"):
        recording.broadcast(torch.zeros(4), src=0, role=Role.PARAMETER)
    assert recording.calls == []  # refused before anything moved or was counted
    assert comm.bytes_sent == 0
    # On the group's device it runs.
    comm.all_reduce(torch.zeros(4, device=meta), op="sum", role=Role.GRADIENT)
    assert recording.calls[-1].kind is CollectiveKind.ALL_REDUCE and recording.calls[-1].numel == 4


def test_a_bookkeeping_group_agrees_on_launch_times_as_host_floats() -> None:
    """On the virtual clock every launch agrees on its start with the other ranks. With a
    bookkeeping group (Gloo) it is a host float there: the payload's group sees only the
    payload, and reading the agreed start reads no device value (``meta`` stands in for the
    GPU, whose values cannot be read at all)."""
    from _host import HostTraffic

    meta = torch.device("meta")
    raw = RecordingComm(world_size=WORLD, device=meta)
    books = RecordingComm(world_size=WORLD, device=torch.device("cpu"))
    clock = _declared()
    comm = NetworkComm(raw, PROFILE, clock, device=meta, bookkeeping=books)
    with HostTraffic() as traffic:
        comm.all_reduce(torch.zeros(250_000, device=meta), role=Role.GRADIENT).wait()
        comm.charge_many([Charge(CollectiveKind.ALL_GATHER, Role.PARAMETER, 4000)] * 2)[-1].wait()
    assert traffic.reads == [] and traffic.copies == []
    assert [call.kind for call in raw.calls] == [CollectiveKind.ALL_REDUCE]
    assert [(call.kind, call.role) for call in books.calls] == [
        (CollectiveKind.ALL_REDUCE, Role.OTHER)
    ] * 2  # one per launch, one per batch of charges
    assert clock.now() == pytest.approx(comm.modeled_comm_s, rel=1e-12)


def test_a_group_on_a_gpu_takes_a_tensor_on_any_gpu_and_refuses_one_on_the_host() -> None:
    from lowcomm.comm.base import check_device

    check_device(torch.device("cuda", 1), torch.device("cuda", 0), "all_reduce")
    check_device(torch.device("cuda", 0), torch.device("cuda"), "all_reduce")
    with pytest.raises(ValueError, match=r"broadcast: the tensor is on cpu but the group's"):
        check_device(torch.device("cpu"), torch.device("cuda", 0), "broadcast")
