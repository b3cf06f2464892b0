"""The in-process comm (``--workers-per-process``): the semantics TorchComm has on Gloo
(test_comm_gloo.py's cases), asynchronous handles, determinism, a failing member that
aborts its group instead of leaving its peers hanging, and the one scheduler that runs every
member's communication chains."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from lowcomm.comm import CollectiveKind, NetworkComm, NetworkProfile, Role, VirtualClock
from lowcomm.comm.base import CollectiveTimeout
from lowcomm.comm.inprocess import GroupAborted, InProcessComm, InProcessGroup
from lowcomm.comm.overlap import Chain, ChainLane, ChainScheduler, CommThread, Steps, chain_runner
from lowcomm.launch import WorkerFailed
from lowcomm.launch.inprocess import run_threads
from test_comm_gloo import check_three_ranks, collectives_on

T = TypeVar("T")


def on_members(group: InProcessGroup, fn: Callable[[InProcessComm], T]) -> list[T]:
    """``fn`` on every member of ``group``, each on its own thread (as the workers run)."""
    return run_threads(lambda rank: fn(group.comm(rank)), group.size, (group,))


def test_collectives_on_three_members_match_torch_comms() -> None:
    check_three_ranks(on_members(InProcessGroup(3), collectives_on))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_to_all_hands_chunk_j_to_member_j(world: int) -> None:
    def exchange(comm: InProcessComm) -> torch.Tensor:
        sent = torch.arange(2.0 * world) + 100 * comm.rank  # chunk j: elements 2j, 2j+1
        received = torch.empty(2 * world)
        comm.all_to_all(received, sent, role=Role.GRADIENT).wait()
        return received

    for rank, received in enumerate(on_members(InProcessGroup(world), exchange)):
        want = torch.cat(
            [torch.tensor([2.0 * rank, 2.0 * rank + 1]) + 100 * i for i in range(world)]
        )
        assert torch.equal(received, want)


def test_a_sum_of_two_members_is_bitwise_a_plus_b_and_a_scatter_sum_is_stacked() -> None:
    """The two reductions whose order matters for bit equality with Gloo: two members' sum
    is a + b (whatever thread comes last), and a reduce-scatter sums stacked chunks, as
    TorchComm's exchange does."""
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def reduce(comm: InProcessComm) -> tuple[torch.Tensor, torch.Tensor]:
        summed = inputs[comm.rank].clone()
        comm.all_reduce(summed, op="sum", role=Role.GRADIENT).wait()
        shard = torch.empty(500)
        comm.reduce_scatter(shard, inputs[comm.rank].clone(), op="mean", role=Role.GRADIENT).wait()
        return summed, shard

    for rank, (summed, shard) in enumerate(on_members(InProcessGroup(2), reduce)):
        assert torch.equal(summed, inputs[0] + inputs[1])
        chunks = [inputs[r][rank * 500 : (rank + 1) * 500] for r in range(2)]
        assert torch.equal(shard, torch.stack(chunks).sum(dim=0).div_(2))


def test_posting_never_blocks_and_the_handle_completes_with_the_last_member() -> None:
    group = InProcessGroup(2)
    first, second = group.comm(0), group.comm(1)
    a, b = torch.ones(3), torch.full((3,), 3.0)
    handle = first.all_reduce(a, op="mean", role=Role.GRADIENT)
    barrier = first.barrier()  # a second collective before anyone else posted
    assert not handle.done() and not barrier.done()
    other = second.all_reduce(b, op="mean", role=Role.GRADIENT)
    assert handle.done() and other.done() and not barrier.done()
    handle.wait()
    assert torch.equal(a, torch.full((3,), 2.0)) and torch.equal(b, a)
    second.barrier().wait()
    barrier.wait()


def test_members_issuing_different_collectives_fail_with_both_named() -> None:
    group = InProcessGroup(2)
    group.comm(0).all_reduce(torch.ones(4), role=Role.GRADIENT)
    handle = group.comm(1).all_reduce(torch.ones(5), role=Role.GRADIENT)
    with pytest.raises(GroupAborted, match="member 1; every member must issue the same"):
        handle.wait()
    with pytest.raises(GroupAborted):
        group.comm(0).barrier()  # the group is over


def test_a_failing_member_aborts_its_peers_waits_and_the_run_names_it() -> None:
    group = InProcessGroup(3)
    waited: list[str] = []

    def member(comm: InProcessComm) -> None:
        if comm.rank == 1:
            raise RuntimeError("injected failure on purpose")
        try:
            comm.barrier().wait()  # would wait forever without the abort
        except GroupAborted as error:
            waited.append(str(error))
            raise

    with pytest.raises(WorkerFailed, match="worker 1 failed: RuntimeError: injected failure"):
        on_members(group, member)
    assert len(waited) == 2 and all("worker 1 failed" in line for line in waited)


def test_a_member_that_stops_issuing_times_out() -> None:
    group = InProcessGroup(2, timeout_s=0.05)
    handle = group.comm(0).barrier()
    with pytest.raises(CollectiveTimeout, match="rank 0: barrier did not complete"):
        handle.wait()


def test_the_emulation_prices_in_process_collectives_as_gloos() -> None:
    """test_comm_gloo's staggered launch on the in-process comm: the collective starts when
    the last member launches, and every member agrees on its completion."""
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=20.0)
    lock = threading.Lock()
    counted: list[float] = []

    def staggered(raw: InProcessComm) -> tuple[float, float]:
        clock = VirtualClock(seconds_per_microbatch=1.0, speed_factor=float(raw.rank + 1))
        comm = NetworkComm(raw, profile, clock)
        clock.microbatch_done()
        launch = clock.now()
        comm.all_reduce(torch.ones(250_000), role=Role.GRADIENT).wait()
        with lock:
            counted.append(comm.bytes_sent)
        return launch, clock.now()

    results = on_members(InProcessGroup(3), staggered)
    cost = profile.collective_time(CollectiveKind.ALL_REDUCE, 1e6, 3)
    assert [launch for launch, _ in results] == pytest.approx([1.0, 2.0, 3.0])
    assert all(end == pytest.approx(3.0 + cost) for _, end in results)
    assert counted == pytest.approx([2 * 2 / 3 * 1e6] * 3)  # a ring all-reduce's, per rank


def test_the_member_that_completes_a_collective_is_charged_none_of_its_arithmetic() -> None:
    """The last member to post reduces every member's tensors; on the calibrated clock that
    is the collective's work, not the worker's (a worker process waiting for Gloo writes
    nothing either), so its element counter sees none of it, and sees its own work still."""
    from lowcomm.comm.calibration import ElementCounter

    group = InProcessGroup(2)
    group.comm(0).reduce_scatter(torch.empty(500), torch.ones(1000), role=Role.GRADIENT)
    output, input, own = torch.empty(500), torch.ones(1000), torch.ones(7)
    counter = ElementCounter()
    with counter:
        group.comm(1).reduce_scatter(output, input, role=Role.GRADIENT).wait()
        own.mul_(2)
    assert counter.elements == 7  # its own mul_ only
    assert torch.equal(output, torch.full((500,), 2.0))


# --- communication chains: one scheduler for every member (lowcomm.comm.overlap) -------------


def _chain(comm: InProcessComm, seen: list[str], rounds: int) -> Steps[torch.Tensor]:
    """A chain of ``rounds`` all-reduces with compute between them (as ACCO's: sum, step,
    gather), recording the thread that runs each part."""
    value = torch.full((4,), float(comm.rank + 1))
    for _ in range(rounds):
        seen.append(threading.current_thread().name)
        handle = comm.all_reduce(value, op="sum", role=Role.GRADIENT)
        yield handle
        handle.wait()
        value.mul_(0.5)
    gathered = torch.empty(4 * comm.world_size)
    handle = comm.all_gather(gathered, value, role=Role.PARAMETER)
    yield handle
    handle.wait()
    return gathered


def test_the_chains_of_every_member_run_on_one_thread_of_the_group() -> None:
    """Each member submits its chain from its own thread, at its own time; one scheduler
    thread carries all of them (a collective completes once every member's chain posted it,
    so the scheduler resumes whichever chain can go on), and each gets its own result."""
    import time

    members, rounds = 4, 3
    group = InProcessGroup(members)
    seen: list[str] = []

    def member(comm: InProcessComm) -> torch.Tensor:
        runner = chain_runner(comm)
        assert isinstance(runner, ChainLane)
        time.sleep(0.02 * comm.rank)  # (the others' chains wait for this one's posts)
        future = runner.submit_chain(Chain(_chain(comm, seen, rounds)))
        with pytest.raises(RuntimeError, match="previous one is still running"):
            runner.submit_chain(Chain(_chain(comm, seen, rounds)))
        result = future.result()
        runner.close()
        return result

    results = on_members(group, member)
    total = 0.5 * sum(range(1, members + 1))  # the first round's sum, halved
    for _ in range(rounds - 1):
        total = 0.5 * members * total
    for result in results:
        assert torch.equal(result, torch.full((4 * members,), total))
    assert set(seen) == {"lowcomm-chains-group"} and len(seen) == members * rounds


def test_each_chain_is_measured_by_its_own_meter() -> None:
    """The scheduler interleaves the chains; each resumption runs in its own chain's meter,
    so every worker is charged exactly its own chain's elements (and none of the
    collectives' arithmetic)."""
    from lowcomm.comm.calibration import ElementMeter

    group = InProcessGroup(3)

    def member(comm: InProcessComm) -> float:
        meter = ElementMeter(seconds_per_element=1.0)

        def steps() -> Steps[None]:
            for size in (10, 100):
                own = torch.zeros(size * (comm.rank + 1))
                own.add_(1)  # written: size x (rank + 1), twice (zeros, add_)
                handle = comm.all_reduce(own[:size], op="sum", role=Role.GRADIENT)
                yield handle
                handle.wait()

        chain_runner(comm).submit_chain(Chain(steps(), meter)).wait()
        return meter.seconds()

    for rank, charged in enumerate(on_members(group, member)):
        assert charged == 2 * (10 + 100) * (rank + 1)


def test_a_failing_member_ends_the_chains_its_peers_wait_on() -> None:
    group = InProcessGroup(3)

    def member(comm: InProcessComm) -> None:
        if comm.rank == 2:
            raise RuntimeError("injected failure on purpose")
        runner = chain_runner(comm)
        runner.submit_chain(Chain(_chain(comm, [], rounds=2))).wait()  # never completes

    with pytest.raises(WorkerFailed, match="worker 2 failed: RuntimeError: injected failure"):
        on_members(group, member)


def test_the_scheduler_thread_ends_once_idle_and_starts_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    monkeypatch.setattr(ChainScheduler, "IDLE_S", 0.05)
    group = InProcessGroup(1, name="idle")

    def alive() -> bool:
        return any(t.name == "lowcomm-chains-idle" for t in threading.enumerate())

    for _ in range(2):
        chain_runner(group.comm(0)).submit_chain(Chain(_chain(group.comm(0), [], 1))).wait()
        deadline = time.monotonic() + 5
        while alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive()


def test_a_worker_process_keeps_a_communication_thread_of_its_own() -> None:
    from lowcomm.comm import RecordingComm

    runner = chain_runner(RecordingComm(world_size=2))
    assert isinstance(runner, CommThread)
    runner.close()


def test_a_failing_scheduler_ends_its_chains_and_the_next_chain_starts_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the scheduler's own loop fails every chain it holds (none waits forever), and
    the next chain runs on a new thread."""
    group = InProcessGroup(2, name="broken")
    sleep = ChainScheduler._sleep
    failed: list[bool] = []

    def broken(self: ChainScheduler, active: list[object]) -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("a scheduler bug, on purpose")
        sleep(self, active)  # type: ignore[arg-type]

    monkeypatch.setattr(ChainScheduler, "_sleep", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (the thread's traceback)
    waiting = chain_runner(group.comm(0)).submit_chain(Chain(_chain(group.comm(0), [], 1)))
    with pytest.raises(RuntimeError, match="a scheduler bug, on purpose"):
        waiting.wait()  # (member 1 never posts: the scheduler went to sleep, and failed)

    def nothing_to_issue() -> Steps[int]:
        return 5
        yield  # (a generator)

    assert chain_runner(group.comm(1)).submit_chain(Chain(nothing_to_issue())).result() == 5
