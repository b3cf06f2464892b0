"""Naive delayed and eager outer steps (docs/ALGORITHMS.md §4.3-4.4) with hand-set outer gradients."""

from __future__ import annotations

import pytest
import torch

from _dist import flat_params, tiny_gpt
from lowcomm.comm.base import CompletedHandle, Handle, ReduceOp, Role
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.strategies import MicroBatchResult, StrategyContext
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.eager import DiLoCoDelayed, Eager, PendingSync, eager_outer_gradient

WORLD = 3
CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=1.0, weight_decay=0.0),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=10,
    max_grad_norm=None,
)


class ScriptedComm:
    """Rank 0 of 3; the other two workers' outer gradients for round r are ``others[r]``.

    A mean all-reduce returns (own + sum of the others' scripted tensors) / 3.
    """

    def __init__(self, others: list[list[torch.Tensor]]) -> None:
        self.others = others
        self.calls = 0

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return WORLD

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = "mean", role: Role) -> Handle:
        assert op == "mean" and role is Role.PSEUDO_GRADIENT
        tensor.add_(sum(self.others[self.calls])).div_(WORLD)
        self.calls += 1
        return CompletedHandle()

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        raise AssertionError("not used")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        raise AssertionError("not used")

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        raise AssertionError("not used")

    def barrier(self) -> Handle:
        raise AssertionError("not used")


def _scripted(rounds: int, numel: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(7)
    own = [torch.randn(numel, generator=generator) * 0.01 for _ in range(rounds)]
    others = [
        [torch.randn(numel, generator=generator) * 0.01 for _ in range(WORLD - 1)]
        for _ in range(rounds)
    ]
    return own, others


def _run(
    cls: type, rounds: int, delay: int, momentum: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]], torch.Tensor]:
    """H=1, inner SGD with lr 1 and a closure that sets the gradient to the scripted own Delta:
    each round's local parameters are phi - own[r], so Delta_m^(r) = own[r] exactly."""
    model = tiny_gpt()
    start = flat_params(model)
    own, others = _scripted(rounds, start.numel())
    options = DiLoCoOptions(
        sync_every=1,
        inner_optimizer="sgd",
        outer_lr=0.8,
        outer_momentum=momentum,
        outer_delay=delay,
    )
    strategy = cls(model, ScriptedComm(others), CONTEXT, options)
    round_index = [0]

    def closure() -> MicroBatchResult:
        gradient = own[round_index[0]]
        offset = 0
        for p in strategy.model.parameters():
            n = p.numel()
            assert p.grad is not None
            p.grad.copy_(gradient[offset : offset + n].view_as(p))
            offset += n
        round_index[0] += 1
        return MicroBatchResult(0.0, 1, 1)

    phis = []
    for _ in range(rounds):
        strategy.step(closure)
        phis.append(strategy.globals_[0].clone())
        assert torch.equal(flat_params(strategy.model), phis[-1])  # next phase starts from phi
    return phis, own, others, start


def _reference_nesterov(
    start: torch.Tensor, updates: list[torch.Tensor | None], momentum: float
) -> list[torch.Tensor]:
    phi, b, out = start.clone(), torch.zeros_like(start), []
    for update in updates:
        if update is not None:
            b = momentum * b + update
            phi = phi - 0.8 * (update + momentum * b)
        out.append(phi.clone())
    return out


def test_eager_formula_is_fresh_own_plus_stale_others_over_m() -> None:
    torch.manual_seed(0)
    fresh, stale_own = torch.randn(5), torch.randn(5)
    stale_others = [torch.randn(5), torch.randn(5)]
    stale_mean = (stale_own + sum(stale_others)) / 3
    result = eager_outer_gradient(stale_mean, fresh, stale_own, 3)
    assert torch.allclose(result, (fresh + sum(stale_others)) / 3, atol=1e-7)


@pytest.mark.parametrize("delay", [1, 2])
def test_eager_applies_fresh_own_plus_others_from_n_rounds_back(delay: int) -> None:
    rounds = 5
    phis, own, others, start = _run(Eager, rounds, delay, momentum=0.5)
    updates: list[torch.Tensor | None] = []
    for r in range(rounds):
        stale_others = sum(others[r - delay]) if r >= delay else torch.zeros_like(start)
        updates.append((own[r] + stale_others) / WORLD)
    for got, want in zip(phis, _reference_nesterov(start, updates, 0.5), strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_eager_finish_applies_the_others_part_of_the_drained_rounds() -> None:
    rounds = 3
    # The scripted gradients and start point (the helper's run itself stops before finish()).
    _, own, others, start = _run(Eager, rounds, 1, momentum=0.0)
    model = tiny_gpt()
    strategy = Eager(
        model,
        ScriptedComm(others),
        CONTEXT,
        DiLoCoOptions(sync_every=1, inner_optimizer="sgd", outer_lr=0.8, outer_momentum=0.0),
    )
    index = [0]

    def closure() -> MicroBatchResult:
        offset = 0
        for p in strategy.model.parameters():
            assert p.grad is not None
            p.grad.copy_(own[index[0]][offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        index[0] += 1
        return MicroBatchResult(0.0, 1, 1)

    for _ in range(rounds):
        strategy.step(closure)
    strategy.finish()
    # Every worker's contribution of every round entered phi exactly once.
    total = sum(own[r] + sum(others[r]) for r in range(rounds)) / WORLD
    assert torch.allclose(strategy.globals_[0], start - 0.8 * total, atol=1e-6)


def test_delayed_applies_outer_nesterov_to_the_previous_rounds_average() -> None:
    rounds = 5
    phis, own, others, start = _run(DiLoCoDelayed, rounds, 1, momentum=0.9)
    updates: list[torch.Tensor | None] = [None]  # first round: no update
    for r in range(1, rounds):
        updates.append((own[r - 1] + sum(others[r - 1])) / WORLD)
    for got, want in zip(phis, _reference_nesterov(start, updates, 0.9), strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_a_checkpoint_keeps_an_exchange_in_flights_weight() -> None:
    """An exchange launched over workers 0, 1 and 2 whose mean divided by 2 (one healed in
    that round sat it out): resumed, the others' part it applies divides its own by 2."""
    options = DiLoCoOptions(sync_every=2)
    saver, resumed = (Eager(tiny_gpt(), ScriptedComm([]), CONTEXT, options) for _ in range(2))
    numel = saver.globals_[0].numel()
    generator = torch.Generator().manual_seed(3)
    mean, own = (torch.randn(numel, generator=generator) for _ in range(2))
    exchange = saver.received_exchange(mean.clone(), own.clone())
    saver.pending[0].append(PendingSync(exchange, 4, (0, 1, 2), size=2))
    resumed.load_state_dict(saver.state_dict())
    (sync,) = resumed.pending[0]
    assert sync.members == (0, 1, 2) and sync.launched_at == 4 and sync.weight == 2
    before = resumed.globals_[0].clone()
    saver.finish()
    resumed.finish()
    assert torch.equal(resumed.globals_[0], saver.globals_[0])
    # (outer SGD-Nesterov's first step on the others' part, mean - own / 2)
    assert not torch.equal(resumed.globals_[0], before)


def test_a_checkpoint_without_weights_resumes_with_the_members_count() -> None:
    options = DiLoCoOptions(sync_every=2)
    saver, resumed = (Eager(tiny_gpt(), ScriptedComm([]), CONTEXT, options) for _ in range(2))
    numel = saver.globals_[0].numel()
    for members in ((0, 2), (0, 1, 2)):
        exchange = saver.received_exchange(torch.ones(numel), torch.zeros(numel))
        saver.pending[0].append(PendingSync(exchange, 4, members))
    state = saver.state_dict()
    first, second = state["in_flight"][0]
    del first["size"]  # a checkpoint from before the weight was saved: its quorum's count
    del second["size"], second["members"]  # and from before the quorum was: every worker
    resumed.load_state_dict(state)
    assert [sync.weight for sync in resumed.pending[0]] == [2, WORLD]
