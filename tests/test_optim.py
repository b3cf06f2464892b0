"""The flat optimizers (lowcomm.optim: AdamW, ADOPT, SGD) against their equations and the
protocol every strategy relies on (docs/ALGORITHMS.md §0.3)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lowcomm.comm import Role
from lowcomm.optim import AdamWConfig, AdoptConfig, FlatAdamW, FlatAdopt, FlatOptimizer, FlatSGD

LR, WD = 0.01, 0.1

#: One of each optimizer and form, every one with weight decay WD.
FACTORIES: dict[str, Callable[[torch.Tensor], FlatOptimizer]] = {
    "adamw": lambda x: FlatAdamW(
        x, AdamWConfig(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    ),
    "adopt": lambda x: FlatAdopt(x, AdoptConfig(betas=(0.9, 0.9999), eps=1e-6, weight_decay=WD)),
    "sgd": lambda x: FlatSGD(x, weight_decay=WD),
    "sgd-momentum": lambda x: FlatSGD(x, weight_decay=WD, momentum=0.9),
    "sgd-ema": lambda x: FlatSGD(x, weight_decay=WD, momentum=0.9, dampening="ema"),
}


def _grads(count: int, numel: int = 40) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(numel) for _ in range(count)]


def test_sgd_with_pytorch_momentum_follows_its_equations_and_torch() -> None:
    x0, grads = torch.randn(40), _grads(5)
    optimizer = FlatSGD(x0.clone(), weight_decay=WD, momentum=0.9)
    # docs/ALGORITHMS.md §0.3: theta <- theta (1 - eta lambda); b <- mu b + g (b = g first);
    # theta <- theta - eta b.
    x, b = x0.clone(), torch.zeros(40)
    for t, g in enumerate(grads):
        optimizer.step(g, lr=LR)
        x = x * (1 - LR * WD)
        b = g.clone() if t == 0 else 0.9 * b + g
        x = x - LR * b
    assert torch.allclose(optimizer.master, x, atol=1e-6)
    # Without weight decay it is torch.optim.SGD(momentum=0.9, dampening=0).
    plain = FlatSGD(x0.clone(), weight_decay=0.0, momentum=0.9)
    p = torch.nn.Parameter(x0.clone())
    torch_opt = torch.optim.SGD([p], lr=LR, momentum=0.9, dampening=0.0)
    for g in grads:
        plain.step(g, lr=LR)
        p.grad = g.clone()
        torch_opt.step()
    assert torch.allclose(plain.master, p.detach(), atol=1e-6)


def test_sgd_with_ema_momentum_follows_its_equations() -> None:
    x0, grads = torch.randn(40), _grads(5)
    optimizer = FlatSGD(x0.clone(), weight_decay=WD, momentum=0.9, dampening="ema")
    # DES-LOC's SGDM: u <- beta u + (1 - beta) g from u = 0; x <- x (1 - eta lambda) - eta u.
    x, u = x0.clone(), torch.zeros(40)
    for g in grads:
        optimizer.step(g, lr=LR)
        u = 0.9 * u + 0.1 * g
        x = x * (1 - LR * WD) - LR * u
    assert torch.allclose(optimizer.master, x, atol=1e-6)
    assert torch.allclose(optimizer.states()[Role.FIRST_MOMENT], u, atol=1e-7)


def test_plain_sgd_holds_no_state() -> None:
    optimizer = FlatSGD(torch.ones(4), weight_decay=0.0)
    optimizer.step(torch.full((4,), 2.0), lr=0.5)
    assert torch.equal(optimizer.master, torch.zeros(4))
    assert optimizer.states() == {} and optimizer.state_bytes() == 0
    with pytest.raises(ValueError, match="sgd dampening: unknown 'torch'"):
        FlatSGD(torch.ones(4), weight_decay=0.0, dampening="torch")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_weight_decay_is_decoupled_the_same_way_in_every_optimizer(name: str) -> None:
    # With a zero gradient every update direction is zero after the state has started, so a
    # step is theta <- theta (1 - eta lambda) exactly (ADOPT's first step only seeds v).
    x0 = torch.randn(40)
    optimizer = FACTORIES[name](x0.clone())
    optimizer.step(torch.zeros(40), lr=LR)
    start = optimizer.master.clone()
    optimizer.step(torch.zeros(40), lr=LR)
    assert torch.allclose(optimizer.master, start * (1 - LR * WD), atol=1e-7)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_lookahead_equals_a_step_and_writes_nothing_back(name: str) -> None:
    grads = _grads(4)
    optimizer = FACTORIES[name](torch.randn(40))
    for g in grads[:3]:
        optimizer.step(g, lr=LR)
    before = optimizer.state_dict()
    out = optimizer.lookahead(grads[3], lr=LR, out=torch.empty(40))
    after = optimizer.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert (
            torch.equal(after[key], value)
            if isinstance(value, torch.Tensor)
            else after[key] == value
        ), key
    optimizer.step(grads[3], lr=LR)
    assert torch.equal(out, optimizer.master)  # bit for bit


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_round_trip_and_reset(name: str) -> None:
    grads = _grads(4)
    optimizer = FACTORIES[name](torch.randn(40))
    for g in grads[:2]:
        optimizer.step(g, lr=LR)
    saved = optimizer.state_dict()
    copy = FACTORIES[name](torch.zeros(40))
    copy.load_state_dict(saved)
    for g in grads[2:]:
        optimizer.step(g, lr=LR)
        copy.step(g, lr=LR)
    assert torch.equal(copy.master, optimizer.master)
    assert optimizer.state_bytes() == sum(4 * s.numel() for s in optimizer.states().values())
    master = optimizer.master.clone()
    optimizer.reset()
    assert torch.equal(optimizer.master, master)  # reset keeps the parameters
    assert all(float(s.abs().max()) == 0.0 for s in optimizer.states().values())
    # A reset optimizer steps like a fresh one.
    fresh = FACTORIES[name](master.clone())
    optimizer.step(grads[0], lr=LR)
    fresh.step(grads[0], lr=LR)
    assert torch.equal(optimizer.master, fresh.master)


def test_adamw_keeps_one_bias_correction_counter_per_moment() -> None:
    # docs/ALGORITHMS.md §5.1: averaging a moment sets its counter to the global step.
    x0, grads = torch.randn(40), _grads(3)
    optimizer = FlatAdamW(
        x0.clone(), AdamWConfig(lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=WD)
    )
    optimizer.step(grads[0], lr=LR)
    optimizer.on_states_averaged([Role.PARAMETER, Role.FIRST_MOMENT], global_step=5)
    assert (optimizer.first_moment_steps, optimizer.second_moment_steps) == (5, 1)
    m, v = optimizer.exp_avg.clone(), optimizer.exp_avg_sq.clone()
    x = optimizer.master.clone()
    optimizer.step(grads[1], lr=LR)
    x = x * (1 - LR * WD)
    m = 0.9 * m + 0.1 * grads[1]
    v = 0.99 * v + 0.01 * grads[1] ** 2
    x = x - LR * (m / (1 - 0.9**6)) / ((v / (1 - 0.99**2)).sqrt() + 1e-8)
    assert torch.allclose(optimizer.master, x, atol=1e-6)
    assert optimizer.state_dict()["second_moment_steps"] == 2
