"""One decode of an all-gather for the in-process workers that received it
(lowcomm.comm.gathered): computed once, each worker's result its own tensor with the same bits,
each worker charged what computing it costs, and nothing shared where it would change a number
(another input, a modified buffer, a clock that charges time)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lowcomm.comm import Role
from lowcomm.comm import gathered as shared
from lowcomm.comm.calibration import ElementCounter
from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.config import CommConfig, PlacementConfig, RunConfig, TrainConfig
from lowcomm.data import DataConfig
from lowcomm.launch.inprocess import run_threads
from lowcomm.models import ModelConfig
from lowcomm.optim import AdamWConfig
from lowcomm.optim.sparse import SparseCodec
from lowcomm.strategies.demo import DeMoCodec
from lowcomm.strategies.sparseloco import SparseLoCoOptions

MEMBERS = 4


def _gather_all(
    use: Callable[[int, torch.Tensor], torch.Tensor], members: int = MEMBERS
) -> list[torch.Tensor]:
    """Each of ``members`` threads all-gathers a payload of its own, then returns
    ``use(rank, gathered)``."""
    group = InProcessGroup(members, timeout_s=30)

    def work(rank: int) -> torch.Tensor:
        payload = torch.arange(6, dtype=torch.float32) + 10 * rank
        out = torch.empty(members * 6)
        group.comm(rank).all_gather(out, payload, role=Role.OTHER).wait()
        return use(rank, out)

    return run_threads(work, members, (group,))


class _Calls:
    """A decode that counts how often it ran (thread-safe)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def decode(self, gathered: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self.count += 1
        return gathered.view(MEMBERS, -1).cumsum(0).sin()


@pytest.mark.parametrize("compute_model", [None, "declared", "calibrated"])
def test_the_first_worker_decodes_and_every_worker_gets_the_bits_in_a_tensor_of_its_own(
    compute_model: str | None,
) -> None:
    calls = _Calls()

    def use(rank: int, out: torch.Tensor) -> torch.Tensor:
        result = shared.once_per_gather(
            out, "k", lambda: calls.decode(out), compute_model=compute_model
        )
        expected = calls.decode(out.clone())  # (a gather of another tensor: computed)
        assert torch.equal(result, expected)
        result.add_(rank)  # (a worker's own: its peers' results do not change)
        return result

    results = _gather_all(use)
    assert calls.count == 1 + MEMBERS  # one shared decode, and each worker's check
    want = torch.cat([torch.arange(6.0) + 10 * r for r in range(MEMBERS)])
    for rank, result in enumerate(results):
        assert torch.equal(result, want.view(MEMBERS, -1).cumsum(0).sin() + rank)


@pytest.mark.parametrize("compute_model", ["cpu-time", "wall"])
def test_a_clock_that_charges_time_has_every_worker_decode(compute_model: str) -> None:
    calls = _Calls()
    _gather_all(
        lambda rank, out: shared.once_per_gather(
            out, "k", lambda: calls.decode(out), compute_model=compute_model
        )
    )
    assert calls.count == MEMBERS


def test_a_gathered_tensor_written_since_is_decoded_by_its_worker() -> None:
    calls = _Calls()

    def use(rank: int, out: torch.Tensor) -> torch.Tensor:
        if rank % 2:
            out[0] += 0.0  # (same bits, but written: no longer the gather's)
        return shared.once_per_gather(out, "k", lambda: calls.decode(out), compute_model="declared")

    _gather_all(use)
    assert calls.count == 1 + MEMBERS // 2


def test_each_key_is_computed_once_and_results_fill_the_given_tensor() -> None:
    calls = {"a": 0, "b": 0}
    lock = threading.Lock()

    def decode(key: str, out: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        with lock:
            calls[key] += 1
        return into.copy_(out.view(MEMBERS, -1).sum(0) * (2 if key == "b" else 1))

    def use(rank: int, out: torch.Tensor) -> torch.Tensor:
        into = torch.full((6,), -1.0)
        a = shared.once_per_gather(
            out, "a", lambda: decode("a", out, into), compute_model=None, out=into
        )
        assert a is into
        b = shared.once_per_gather(
            out, "b", lambda: decode("b", out, torch.empty(6)), compute_model=None
        )
        return torch.stack([a, b])

    results = _gather_all(use)
    assert calls == {"a": 1, "b": 1}
    column = torch.arange(6.0) * MEMBERS + 10 * sum(range(MEMBERS))
    for result in results:
        assert torch.equal(result, torch.stack([column, 2 * column]))


def test_a_worker_handed_the_result_is_charged_what_computing_it_counts() -> None:
    # On the calibrated clock each worker counts the elements its operations write: a worker
    # handed the decode counts what the decode counted, as if it had run it (the copy: 0).
    def decode(out: torch.Tensor) -> torch.Tensor:
        return out.view(MEMBERS, -1).cumsum(0).sin().mul(2)

    zeros = torch.zeros(MEMBERS * 6)
    with ElementCounter() as alone:
        decode(zeros)

    def use(rank: int, out: torch.Tensor) -> torch.Tensor:
        with ElementCounter() as counter:
            shared.once_per_gather(out, "k", lambda: decode(out), compute_model="calibrated")
        return torch.tensor(counter.elements)

    counts = _gather_all(use)
    assert alone.elements > 0
    assert [int(c) for c in counts] == [alone.elements] * MEMBERS


def _stacked_decodes() -> list[tuple[int, torch.Tensor]]:
    """One of 2 processes of 2 worker threads (a stacked group): each worker all-gathers its
    payload and asks for the shared decode; (the process's decodes, the worker's result)."""
    from lowcomm.comm.stacked import StackedGroup
    from lowcomm.comm.torch_comm import TorchComm

    group, calls = StackedGroup(2, TorchComm(), name="test"), _Calls()

    def work(member: int) -> torch.Tensor:
        comm = group.comm(member)
        out = torch.empty(MEMBERS * 6)
        payload = torch.arange(6, dtype=torch.float32) + 10 * comm.rank
        comm.all_gather(out, payload, role=Role.OTHER).wait()
        return shared.once_per_gather(out, "k", lambda: calls.decode(out), compute_model="declared")

    try:
        results = run_threads(work, 2, (group,), first_rank=group.first_rank)
    finally:
        group.close()
    return [(calls.count, result) for result in results]


def test_the_stacked_all_gather_is_decoded_once_per_process() -> None:
    # M = P x K: the K workers of each process gathered every worker's payload (through
    # torch.distributed between the processes); each process decodes once.
    from lowcomm.launch import spawn_workers

    got = [row for process in spawn_workers(_stacked_decodes, 2) for row in process]
    want = torch.cat([torch.arange(6.0) + 10 * r for r in range(MEMBERS)])
    assert [count for count, _ in got] == [1] * MEMBERS
    for _, result in got:
        assert torch.equal(result, want.view(MEMBERS, -1).cumsum(0).sin())


def _decode_counter(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (a decode) in a list's length."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(self: object, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize(
    ("method", "owner", "name", "exchanges"),
    [("demo", DeMoCodec, "mean", 4), ("sparseloco", SparseCodec, "decode_sum", 2)],
)
def test_a_run_in_one_process_decodes_each_gather_once_with_the_same_numbers(
    method: str,
    owner: type,
    name: str,
    exchanges: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The calibrated clock (from one file: both runs charge alike): the metrics, the final
    # parameters and the modeled time of a run whose workers share each decode equal those of
    # the run in which every worker decodes for itself.
    from lowcomm.launch.inprocess import train_in_process

    def run(out: str, steps: int = 4) -> tuple[list[str], list[torch.Tensor]]:
        """The run's metrics lines and final parameters."""
        config = TrainConfig(
            method=method,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            optim=AdamWConfig(lr=3e-3),
            sparseloco=SparseLoCoOptions(sync_every=2),
            placement=PlacementConfig(workers=MEMBERS, workers_per_process=MEMBERS),
            run=RunConfig(
                steps=steps,
                seed=0,
                eval_every=2,
                eval_batches=1,
                progress=False,
                plot=False,
                out=str(tmp_path / out),
            ),
            comm=CommConfig(network="wan", calibration=str(tmp_path / "calibration.json")),
        )
        config.validate()
        summaries = train_in_process(config, keep_parameters=True)
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return lines, [s.parameters for s in summaries if s.parameters is not None]

    run("calibrating", steps=1)  # (measures the calibration and writes it: both runs read it)
    monkeypatch.setattr(shared, "_gather_of", lambda tensor: None)  # (nothing shared)
    calls = _decode_counter(monkeypatch, owner, name)
    each, each_params = run("each")
    assert len(calls) == MEMBERS * exchanges
    monkeypatch.undo()
    calls = _decode_counter(monkeypatch, owner, name)
    once, once_params = run("once")
    assert len(calls) == exchanges
    assert once == each
    assert len(once_params) == len(each_params) > 0
    for a, b in zip(once_params, each_params, strict=True):
        assert torch.equal(a, b)
