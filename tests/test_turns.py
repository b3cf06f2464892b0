"""Turns (lowcomm.comm.turns): at most ``slots`` worker threads run at once, a worker blocked in a
collective gives its turn to its peers, a wait nobody marked cannot hang the run, and the
numbers of a run do not depend on turns. Also what else costs per worker with many in one process:
the one-check finiteness test of flat buffers, and every worker's metrics kept as rows."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lowcomm.comm import Role
from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.comm.turns import Turns, TurnStall, blocking
from lowcomm.launch.inprocess import run_threads
from lowcomm.strategies.flat import FlatBuffers
from lowcomm.train.loop import NonFiniteLoss, _check_finite
from lowcomm.train.records import StepMetrics
from lowcomm.train.step_log import WorkerRows, all_finite, one_stretch, parameters_finite


class _Meter:
    """How many threads are inside :meth:`busy` at once, at most."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def busy(self, seconds: float) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(seconds)  # (a sleep lets any other thread run: only turns stop them)
        with self._lock:
            self.now -= 1


@pytest.mark.parametrize("slots", [1, 2])
def test_at_most_slots_workers_run_at_once(slots: int) -> None:
    turns, meter = Turns(slots), _Meter()
    run_threads(lambda rank: meter.busy(0.02), 8, (), turns=turns)
    assert meter.most == slots
    assert turns.opened == 0


def test_a_worker_waiting_in_a_collective_lets_its_peers_run() -> None:
    # One turn for 6 workers that all-reduce twice: each must give the turn away while it
    # waits, or the first to post would hold it and nobody else could post.
    group, turns, meter = InProcessGroup(6, timeout_s=30), Turns(1), _Meter()

    def work(rank: int) -> float:
        tensor = torch.tensor([float(rank)])
        for _ in range(2):
            meter.busy(0.005)
            group.comm(rank).all_reduce(tensor, op="sum", role=Role.OTHER).wait()
        return float(tensor)

    results = run_threads(work, 6, (group,), turns=turns)
    assert results == [6 * 15.0] * 6  # sum 0..5, then six times that
    assert meter.most == 1
    assert turns.opened == 0


def test_a_wait_that_keeps_its_turn_opens_a_slot_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Worker 0 waits for worker 1 on an event without marking the wait: with one turn, worker
    # 1 could never run. After the stall time one more slot opens and the run ends.
    monkeypatch.setattr(Turns, "STALL_S", 0.2)
    turns, ready = Turns(1), threading.Event()

    def work(rank: int) -> int:
        if rank == 0:
            assert ready.wait(20)  # not marked blocking(): keeps the turn
        else:
            ready.set()
        return rank

    started = time.monotonic()
    with pytest.warns(TurnStall, match="gave its turn away"):
        assert run_threads(work, 2, (), turns=turns) == [0, 1]
    assert time.monotonic() - started < 10
    assert turns.opened >= 1


def test_blocking_is_nothing_outside_a_worker() -> None:
    with blocking():  # (the main thread holds no turn: nothing to give or take)
        pass
    turns = Turns(1)
    with turns.worker():
        assert turns.free == 0
        with blocking(), blocking():  # (nested: gives the turn once, takes it back once)
            assert turns.free == 1  # the turn is free while blocked
        assert turns.free == 0  # held again after the wait
    assert turns.free == 1


def test_a_freed_turn_goes_to_the_waiting_worker_of_the_lowest_rank() -> None:
    # One turn, held by worker 9 while workers 5, 3, 7, 1 queue for it (in that order): they
    # run 1, 3, 5, 7, whatever order they asked in, and rank 0 of a run writes its records
    # first after a collective. Each waiter is queued before the next one asks.
    turns, order = Turns(1), []

    def work(rank: int) -> None:
        with turns.worker(rank):
            order.append(rank)

    with turns.worker(9):
        threads = []
        for rank in (5, 3, 7, 1):
            thread = threading.Thread(target=work, args=(rank,))
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 10
            while len(turns._waiting) < len(threads) and time.monotonic() < deadline:
                time.sleep(0.001)
        assert len(turns._waiting) == 4
    for thread in threads:
        thread.join(10)
    assert order == [1, 3, 5, 7]
    assert turns.free == 1 and turns.opened == 0


def test_one_stretch_joins_views_that_tile_a_storage() -> None:
    base = torch.arange(10.0)
    joined = one_stretch([base[3:7].view(2, 2), base[0:3], base[7:10]])
    assert joined is not None and torch.equal(joined, base)
    assert one_stretch([base[0:3], base[4:10]]) is None  # a gap
    assert one_stretch([base[0:4], base[2:6]]) is None  # an overlap
    assert one_stretch([base[0:3], torch.zeros(2)]) is None  # another storage
    assert one_stretch([base.view(2, 5).t()]) is None  # not contiguous
    assert one_stretch([]) is None


def test_parameters_finite_on_flat_buffers_sees_one_bad_element() -> None:
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(first, second)
    FlatBuffers(model)  # the parameters become views of one buffer
    assert one_stretch(list(model.parameters())) is not None
    assert bool(parameters_finite(model))
    with torch.no_grad():
        second.bias[1] = float("nan")
    assert not bool(parameters_finite(model))
    with torch.no_grad():
        second.bias[1] = 0.0
        first.weight[2, 3] = float("inf")
    assert not bool(parameters_finite(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_is_isfinite_all_without_overflow(dtype: torch.dtype) -> None:
    """all_finite agrees with isfinite(x).all() for one NaN, +inf or -inf anywhere, and says
    finite where every entry is the largest finite value (a plain sum would overflow)."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert bool(all_finite(x)) and bool(all_finite(torch.zeros(0, dtype=dtype)))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 500, 1000):
            y = x.clone()
            y[where] = bad
            assert not bool(all_finite(y)) and not bool(torch.isfinite(y).all())
    assert bool(all_finite(torch.full((1001,), torch.finfo(dtype).max, dtype=dtype)))
    assert bool(all_finite(-x.abs().to(dtype)))  # (negative zeros and values)


def test_parameters_finite_tensor_by_tensor_off_a_flat_buffer() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    assert one_stretch(list(model.parameters())) is None  # (each parameter its own storage)
    assert bool(parameters_finite(model))
    with torch.no_grad():
        model[1].weight[0, 2] = float("-inf")
    assert not bool(parameters_finite(model))


def _row(loss: float, finite: float) -> StepMetrics:
    return StepMetrics(loss, 1.0, 0.5, 10.0, 2.0, 1.0, 64.0, 1.0, finite)


def test_worker_rows_give_records_and_name_the_first_bad_worker() -> None:
    rows = [_row(2.0, 1.0), _row(3.0, 1.0), _row(float("nan"), 1.0), _row(4.0, 0.0)]
    table = torch.stack([row.to_tensor() for row in rows])
    everyone = WorkerRows(table)
    assert len(everyone) == 4 and everyone[1] == rows[1] and everyone.records()[3] == rows[3]
    assert torch.equal(everyone.column("loss")[:2], torch.tensor([2.0, 3.0], dtype=torch.float64))
    with pytest.raises(NonFiniteLoss, match=r"step 7: worker 2 reported a non-finite loss \(nan\)"):
        _check_finite(7, everyone)
    losses_finite = table[[0, 1, 1, 3]]  # (worker 3's parameters are the only bad value)
    with pytest.raises(NonFiniteLoss, match="step 7: worker 3 has non-finite parameters"):
        _check_finite(7, WorkerRows(losses_finite))
    _check_finite(7, WorkerRows(table[:2]))  # (all finite: no error)
