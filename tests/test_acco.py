"""ACCO, DPU and weight prediction (docs/ALGORITHMS.md §2): equations, reductions, overlap, memory.

The reference trajectories below are written straight from docs/ALGORITHMS.md §2 (Prop. 3.2 for
ACCO with SGD, the DPU and WP rules, the §2.3 loop with per-worker counts) on a linear
least-squares model whose micro-batches are fixed by (rank, call index), so every gradient is
known exactly.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _cli import SMALL, lowcomm
from _dist import global_batch, tiny_gpt
from lowcomm.comm import (
    CollectiveKind,
    LocalComm,
    NetworkComm,
    NetworkProfile,
    RealClock,
    RecordingComm,
    Role,
    VirtualClock,
)
from lowcomm.comm.base import Comm, Handle, Settled
from lowcomm.comm.calibration import CalibratedClock, Calibration, ElementCounter
from lowcomm.config import CommConfig, PlacementConfig, RunConfig
from lowcomm.optim import AdamWConfig, FlatAdamW, ScheduleConfig
from lowcomm.optim.schedule import learning_rate
from lowcomm.strategies import MicroBatchResult, StrategyContext, ZeRO1, strategy_class
from lowcomm.strategies.acco import ACCO, DPU, WP, AccoOptions
from lowcomm.strategies.base import Strategy
from lowcomm.train.context import strategy_context

DIM = 5
LR = 0.05
CONSTANT = ScheduleConfig(kind="constant", warmup_steps=0)
ADAMW = AdamWConfig(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SGD = AdamWConfig(lr=LR, weight_decay=0.0)


# --- a linear model with known gradients ------------------------------------------------


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(DIM, 1, bias=False)


def _batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * rank + index)
    inputs = torch.randn(4, DIM, generator=generator)
    targets = torch.randn(4, 1, generator=generator)
    return inputs, targets


def _gradient(theta: torch.Tensor, rank: int, index: int) -> torch.Tensor:
    """grad of 0.5 mean((X theta - y)^2), in float64 (the reference)."""
    inputs, targets = _batch(rank, index)
    x, y = inputs.double(), targets.double().reshape(-1)
    return x.T @ (x @ theta - y) / x.shape[0]


def _linear_closure(
    strategy: Strategy, rank: int, points: list[torch.Tensor], clock: Any = None
) -> Callable[[], MicroBatchResult]:
    """Runs micro-batch (rank, call index) and records the parameters it was evaluated at."""
    calls = [0]

    def closure() -> MicroBatchResult:
        inputs, targets = _batch(rank, calls[0])
        calls[0] += 1
        model = strategy.model
        points.append(next(model.parameters()).detach().reshape(-1).double().clone())
        prediction = model(inputs)
        loss = 0.5 * (prediction - targets).square().mean()
        loss.backward()
        if clock is not None:
            clock.microbatch_done()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    return closure


def _params(strategy: Strategy) -> torch.Tensor:
    return next(strategy.model.parameters()).detach().reshape(-1).double().clone()


def _context(optim: AdamWConfig, steps: int = 10) -> StrategyContext:
    return StrategyContext(optim=optim, schedule=CONSTANT, total_steps=steps, max_grad_norm=None)


# --- reference optimizers, from docs/ALGORITHMS.md §0.3 ---------------------------------------

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # theta, m, v, s


def _adamw(state: State, g: torch.Tensor, lr: float = LR) -> State:
    theta, m, v, s = state
    beta1, beta2 = ADAMW.betas
    s = s + 1
    theta = theta * (1 - lr * ADAMW.weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    theta = theta - lr * (m / (1 - beta1**s)) / ((v / (1 - beta2**s)).sqrt() + ADAMW.eps)
    return theta, m, v, s


def _sgd(state: State, g: torch.Tensor, lr: float = LR) -> State:
    theta, m, v, s = state
    return theta - lr * g, m, v, s + 1


def _start(theta: torch.Tensor) -> State:
    return theta.clone(), torch.zeros_like(theta), torch.zeros_like(theta), 0


# --- reference trajectories ----------------------------------------------------------------


def _acco_reference(
    theta0: torch.Tensor, steps: int, counts: list[int], opt: Callable[[State, torch.Tensor], State]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """docs/ALGORITHMS.md §2.3 with worker r taking counts[r] micro-batches per phase (and at init).

    theta~(t+1) = Opt_lookahead(theta(t), sum_r G~_r / sum_r N~_r);
    theta(t+1)  = Opt_step(theta(t), sum_r (G_r + G~_r) / sum_r (N_r + N~_r)).
    Worker r's call j is micro-batch (r, j); block b = j // counts[r] is g~(0) at theta(0)
    for b = 0, g(t) at theta(t) for b = 2t+1, g~(t+1) at theta~(t+1) for b = 2t+2.
    Returns the committed thetas and the estimates theta~(1..steps).
    """
    state = _start(theta0)
    estimate = theta0.clone()
    thetas, estimates = [], []
    total = sum(counts)

    def block_sum(point: torch.Tensor, block: int) -> torch.Tensor:
        return sum(
            (_gradient(point, r, block * k + i) for r, k in enumerate(counts) for i in range(k)),
            torch.zeros_like(theta0),
        )

    for t in range(steps):
        tilde = block_sum(estimate, 2 * t)
        plain = block_sum(state[0], 2 * t + 1)
        estimate = opt(state, tilde / total)[0]  # the lookahead: state is not replaced
        state = opt(state, (tilde + plain) / (2 * total))
        thetas.append(state[0])
        estimates.append(estimate)
    return thetas, estimates


def _dpu_reference(
    theta0: torch.Tensor, steps: int, counts: list[int], opt: Callable[[State, torch.Tensor], State]
) -> list[torch.Tensor]:
    """theta(t+1) = Opt(theta(t), g(theta(t-1))), theta(-1) = theta(0); block t of worker r is
    taken at theta(t-1) (block 0 at theta(0))."""
    state = _start(theta0)
    previous = theta0.clone()
    total = sum(counts)
    thetas = []
    for t in range(steps):
        g = sum(
            (_gradient(previous, r, t * k + i) for r, k in enumerate(counts) for i in range(k)),
            torch.zeros_like(theta0),
        )
        previous = state[0]
        state = opt(state, g / total)
        thetas.append(state[0])
    return thetas


def _wp_reference(
    theta0: torch.Tensor, steps: int, opt: Callable[[State, torch.Tensor], State]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """theta(t+1) = Opt(theta(t), g(t)); theta~(t+1) = Opt_lookahead(theta(t+1), g(t));
    g(t+1) = grad at theta~(t) (theta~(0) = theta(0)); one worker, one micro-batch per phase."""
    state = _start(theta0)
    prediction = theta0.clone()
    g = _gradient(theta0, 0, 0)
    thetas, predictions = [], []
    for t in range(steps):
        next_g = _gradient(prediction, 0, t + 1)
        state = opt(state, g)
        prediction = opt(state, g)[0]
        thetas.append(state[0])
        predictions.append(prediction)
        g = next_g
    return thetas, predictions


# --- options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"microbatches_per_phase": 0}, "--acco.microbatches-per-phase: 0 must be >= 1"),
        ({"dpu_warmup_steps": -1}, "--acco.dpu-warmup-steps: -1 must be >= 0"),
        ({"optimizer": "lion"}, "--acco.optimizer: unknown optimizer 'lion'"),
    ],
)
def test_bad_options_name_the_flag_the_value_and_the_rule(
    kwargs: dict[str, Any], flag: str
) -> None:
    with pytest.raises(ValueError, match=flag):
        AccoOptions(**kwargs)


def test_methods_are_selectable_by_name() -> None:
    assert strategy_class("acco") is ACCO
    assert strategy_class("dpu") is DPU
    assert strategy_class("wp") is WP
    assert {ACCO.options_field, DPU.options_field, WP.options_field} == {"acco"}


# --- equations --------------------------------------------------------------------------------


def test_acco_with_sgd_follows_prop_3_2() -> None:
    # One worker (the recording fake), one micro-batch per phase, SGD:
    #   theta(t+1) = theta(t) - lr/2 (g_t + g~_t),  theta~(t+1) = theta(t) - lr g~_t,
    # g_t at theta(t), g~_t at theta~(t), theta~(0) = theta(0).
    steps = 6
    strategy = ACCO(_linear(), RecordingComm(rank=0, world_size=1), _context(SGD, steps),
                    AccoOptions(microbatches_per_phase=1, optimizer="sgd"))  # fmt: skip
    theta = _params(strategy)
    points: list[torch.Tensor] = []
    closure = _linear_closure(strategy, 0, points)
    estimate = theta.clone()
    for t in range(steps):
        strategy.step(closure)
        assert torch.allclose(points[2 * t], estimate, atol=1e-6)  # g~_t at theta~(t)
        assert torch.allclose(points[2 * t + 1], theta, atol=1e-6)  # g_t at theta(t)
        g_tilde = _gradient(estimate, 0, 2 * t)
        g = _gradient(theta, 0, 2 * t + 1)
        theta, estimate = theta - LR / 2 * (g + g_tilde), theta - LR * g_tilde
        assert torch.allclose(_params(strategy), theta, atol=1e-6)
    assert torch.allclose(points[2 * steps], estimate, atol=1e-6)  # the last UPD phase's point
    assert len(points) == 2 * steps + 1
    assert not torch.allclose(theta, points[0], atol=1e-3)  # it moved


def test_acco_with_adamw_never_commits_the_estimate() -> None:
    steps = 5
    # The fake's all-gather tiles this rank's shard, so value tests use a group of one;
    # the summed counts of several workers are checked on Gloo below.
    comm = RecordingComm(rank=0, world_size=1)
    strategy = ACCO(_linear(), comm, _context(ADAMW, steps), AccoOptions(microbatches_per_phase=1))
    assert isinstance(strategy.optimizer, FlatAdamW)
    theta0 = _params(strategy)
    points: list[torch.Tensor] = []
    closure = _linear_closure(strategy, 0, points)
    thetas, estimates = _acco_reference(theta0, steps, [1], _adamw)
    for t in range(steps):
        strategy.step(closure)
        # One committed AdamW step per ACCO step: the estimate left s, m, v untouched.
        assert strategy.optimizer.step_count == t + 1
        assert torch.allclose(_params(strategy), thetas[t], atol=1e-6)
        if t + 1 < steps:
            # the UPD phase's micro-batch was taken at theta~(t+1)
            assert torch.allclose(points[2 * t + 2], estimates[t], atol=1e-6)
    # Moments equal a reference fed only the committed (full-batch) gradients.
    reference = _start(theta0)
    estimate = theta0.clone()
    for t in range(steps):
        tilde = _gradient(estimate, 0, 2 * t)
        plain = _gradient(reference[0], 0, 2 * t + 1)
        estimate = _adamw(reference, tilde)[0]
        reference = _adamw(reference, (tilde + plain) / 2)
    assert torch.allclose(strategy.optimizer.exp_avg.double(), reference[1], atol=1e-7)
    assert torch.allclose(strategy.optimizer.exp_avg_sq.double(), reference[2], atol=1e-9)
    assert comm.count(CollectiveKind.REDUCE_SCATTER, Role.GRADIENT) == 2 * steps
    assert comm.count(CollectiveKind.ALL_GATHER, Role.PARAMETER) == 2 * steps


def test_adamw_lookahead_equals_a_step_and_writes_nothing_back() -> None:
    torch.manual_seed(1)
    optimizer = FlatAdamW(torch.randn(64), ADAMW)
    for _ in range(3):
        optimizer.step(torch.randn(64), lr=LR)
    before = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in optimizer.state_dict().items()
    }
    grad = torch.randn(64)
    out = optimizer.lookahead(grad, lr=LR, out=torch.empty(64))
    after = optimizer.state_dict()
    assert after["step_count"] == before["step_count"] == 3
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(after[name], before[name]), name  # type: ignore[arg-type]
    optimizer.step(grad, lr=LR)
    assert torch.equal(out, optimizer.master)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_dpu_applies_the_previous_gradient(optim: str) -> None:
    steps = 6
    config, reference_opt = (SGD, _sgd) if optim == "sgd" else (ADAMW, _adamw)
    strategy = DPU(_linear(), LocalComm(), _context(config, steps),
                   AccoOptions(microbatches_per_phase=1, optimizer=optim))  # type: ignore[arg-type]  # fmt: skip
    thetas = _dpu_reference(_params(strategy), steps, [1], reference_opt)
    closure = _linear_closure(strategy, 0, [])
    for t in range(steps):
        strategy.step(closure)
        assert torch.allclose(_params(strategy), thetas[t], atol=1e-6), t


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_wp_commits_once_and_predicts_with_the_same_gradient(optim: str) -> None:
    steps = 6
    config, reference_opt = (SGD, _sgd) if optim == "sgd" else (ADAMW, _adamw)
    strategy = WP(_linear(), LocalComm(), _context(config, steps),
                  AccoOptions(microbatches_per_phase=1, optimizer=optim))  # type: ignore[arg-type]  # fmt: skip
    thetas, predictions = _wp_reference(_params(strategy), steps, reference_opt)
    closure = _linear_closure(strategy, 0, [])
    for t in range(steps):
        strategy.step(closure)
        assert strategy.optimizer.step_count == t + 1  # the lookahead never commits
        assert torch.allclose(_params(strategy), predictions[t], atol=1e-6), t  # compute copy
        with strategy.deployed() as model:
            deployed = next(model.parameters()).detach().reshape(-1).double()
            assert torch.allclose(deployed, thetas[t], atol=1e-6), t  # committed theta
        assert torch.allclose(_params(strategy), predictions[t], atol=1e-6)  # restored


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_wp_predicts_with_the_learning_rate_of_the_step_after_the_commit(optim: str) -> None:
    # Warm-up then cosine: the LR changes from every step to the next (but one, at the peak).
    steps = 7
    schedule = ScheduleConfig(kind="cosine", warmup_steps=3, min_lr_ratio=0.1)
    config, reference_opt = (SGD, _sgd) if optim == "sgd" else (ADAMW, _adamw)
    context = StrategyContext(
        optim=config, schedule=schedule, total_steps=steps, max_grad_norm=None
    )
    strategy = WP(_linear(), LocalComm(), context,
                  AccoOptions(microbatches_per_phase=1, optimizer=optim))  # type: ignore[arg-type]  # fmt: skip

    def lr(step: int) -> float:
        return learning_rate(schedule, LR, step, steps)

    assert sum(lr(t) != lr(t + 1) for t in range(steps)) >= steps - 1
    # theta(t+1) = Opt(theta(t), g(t), lr_t); theta~(t+1) = Opt_lookahead(theta(t+1), g(t), lr_{t+1}).
    state = _start(_params(strategy))
    prediction, g = state[0].clone(), _gradient(state[0], 0, 0)
    closure = _linear_closure(strategy, 0, [])
    for t in range(steps):
        next_g = _gradient(prediction, 0, t + 1)
        state = reference_opt(state, g, lr(t))
        prediction = reference_opt(state, g, lr(t + 1))[0]
        g = next_g
        stats = strategy.step(closure)
        assert stats.lr == lr(t)  # the commit's LR
        assert torch.allclose(_params(strategy), prediction, atol=1e-7), t
        with strategy.deployed() as model:
            committed = next(model.parameters()).detach().reshape(-1).double()
            assert torch.allclose(committed, state[0], atol=1e-7), t


# --- reductions -------------------------------------------------------------------------------


def _gpt_closure(strategy: Strategy, clock: Any = None) -> Callable[[], MicroBatchResult]:
    calls = [0]

    def closure() -> MicroBatchResult:
        inputs, targets = global_batch(calls[0], 1)
        calls[0] += 1
        _, loss = strategy.model(inputs, targets)
        assert loss is not None
        loss.backward()
        if clock is not None:
            clock.microbatch_done()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    return closure


def test_dpu_with_warmup_covering_the_run_equals_zero1() -> None:
    context = StrategyContext(
        optim=AdamWConfig(lr=3e-3), schedule=ScheduleConfig(kind="cosine", warmup_steps=2),
        total_steps=5, microbatches_per_step=2,
    )  # fmt: skip
    zero = ZeRO1(tiny_gpt(), RecordingComm(world_size=1), context)
    dpu = DPU(tiny_gpt(), RecordingComm(world_size=1), context,
              AccoOptions(dpu_warmup_steps=5))  # fmt: skip
    zero_closure, dpu_closure = _gpt_closure(zero), _gpt_closure(dpu)
    for _ in range(5):
        zero_stats = zero.step(zero_closure)
        dpu_stats = dpu.step(dpu_closure)
        assert dpu_stats.lr == zero_stats.lr and dpu_stats.microbatches == 2
    assert torch.allclose(dpu.flat.params, zero.flat.params, atol=1e-6)
    assert torch.allclose(dpu.optimizer.master, zero.optimizer.master, atol=1e-6)


# --- accounting on the virtual clock ---------------------------------------------------------


def _emulated(
    strategy_factory: Callable[[Comm], Strategy], profile: NetworkProfile, seconds: float
) -> tuple[Strategy, NetworkComm, VirtualClock]:
    clock = VirtualClock(seconds_per_microbatch=seconds)
    comm = NetworkComm(RecordingComm(rank=0, world_size=2), profile, clock)
    return strategy_factory(comm), comm, clock


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("name", ["acco", "dpu", "wp"])
def test_the_clock_is_charged_for_exactly_the_collectives_the_thread_issues(
    name: str, max_grad_norm: float | None
) -> None:
    # The chain is declared once (acco._ChainRun.links): the thread issues it on the inner
    # communicator, the NetworkComm accounts for it. Same collectives, kinds, roles, bytes.
    from lowcomm.comm.network import bytes_sent

    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=1.0)
    context = StrategyContext(optim=ADAMW, total_steps=3, max_grad_norm=max_grad_norm)
    cls = strategy_class(name)
    strategy, comm, clock = _emulated(
        lambda c: cls(tiny_gpt(), c, context, AccoOptions(dpu_warmup_steps=1)), profile, 0.01
    )  # type: ignore[call-arg]
    closure = _gpt_closure(strategy, clock)
    for _ in range(3):
        strategy.step(closure)
    strategy.finish()
    recording = comm.raw
    assert isinstance(recording, RecordingComm)
    # The launch-time agreement (a max all-reduce before each chain) is uncharged by design.
    chain_calls = [call for call in recording.calls if call.op != "max"]
    issued: dict[str, float] = {}
    for call in chain_calls:
        assert call.role is not None
        issued[call.role.value] = issued.get(call.role.value, 0.0) + bytes_sent(
            call.kind, call.payload_bytes, 2, 0
        )
    assert {role: value for role, value in comm.counters().items() if value} == issued
    chains = 2 * 3 if name == "acco" else 3
    assert len(chain_calls) == chains * (4 if max_grad_norm is not None else 3)


@pytest.mark.parametrize("name", ["acco", "dpu"])
def test_the_chains_compute_is_charged_to_the_worker_on_the_calibrated_clock(name: str) -> None:
    """The chain's arithmetic (averaging, the sharded optimizer step) runs on the
    communication thread, which shares the worker's device: every chain's elements are folded
    into the worker's clock once it is joined, so its compute is the micro-batches' calibrated
    cost plus every element written on either thread."""
    calibration = Calibration(
        seconds_per_microbatch=0.01, seconds_per_element=1e-9, micro_batch_size=1,
        block_size=8, num_params=1,
    )  # fmt: skip
    clock = CalibratedClock(calibration)
    comm = NetworkComm(
        RecordingComm(rank=0, world_size=2), NetworkProfile(name="t", bandwidth_gbps=1.0), clock
    )
    strategy = strategy_class(name)(
        tiny_gpt(), comm, StrategyContext(optim=ADAMW, total_steps=3), AccoOptions()
    )  # type: ignore[call-arg]
    folded: list[float] = []
    fold = clock.fold
    clock.fold = lambda meter: (folded.append(meter.seconds()), fold(meter))[-1]  # type: ignore[method-assign]
    inputs, targets = global_batch(0, 1)

    def closure() -> MicroBatchResult:
        with clock.microbatch():
            _, loss = strategy.model(inputs, targets)
            assert loss is not None
            loss.backward()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    microbatches = 0
    with clock.training():
        for _ in range(3):
            microbatches += strategy.step(closure).microbatches
        strategy.finish()
        clock.mark()
    assert len(folded) == (2 * 3 if name == "acco" else 3)  # one fold per chain
    # Each chain at least runs AdamW over this worker's shard.
    counter = ElementCounter()
    shard = torch.zeros(strategy.shard_numel)  # type: ignore[attr-defined]
    with counter:
        FlatAdamW(shard.clone(), ADAMW).step(torch.ones_like(shard), lr=LR)
    assert min(folded) >= counter.elements * 1e-9 > 0
    helper_elements = round(sum(folded) / 1e-9)
    assert clock.compute_s == pytest.approx(
        microbatches * 0.01 + (clock.counter.elements + helper_elements) * 1e-9, rel=1e-12
    )


def test_acco_moves_twice_zero1_bytes_per_committed_step() -> None:
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=1.0)
    context = StrategyContext(optim=ADAMW, total_steps=4)
    counters = {}
    for name in ("zero1", "dpu", "wp", "acco"):
        cls = strategy_class(name)
        factory: Callable[[Comm], Strategy] = (
            (lambda comm, cls=cls: cls(tiny_gpt(), comm, context))  # type: ignore[misc]
            if name == "zero1"
            else (lambda comm, cls=cls: cls(tiny_gpt(), comm, context, AccoOptions()))  # type: ignore[misc]
        )
        strategy, comm, clock = _emulated(factory, profile, 0.01)
        closure = _gpt_closure(strategy, clock)
        committed = sum(strategy.step(closure).committed_steps for _ in range(4))
        assert committed == 4
        counters[name] = comm.counters()
    for role in ("gradient", "parameter"):
        assert counters["zero1"][role] > 0
        assert counters["acco"][role] == 2 * counters["zero1"][role]
        assert counters["dpu"][role] == counters["zero1"][role]
        assert counters["wp"][role] == counters["zero1"][role]


def test_acco_hides_communication_that_zero1_exposes() -> None:
    # One phase's communication (RS + AG of the padded fp32 gradient, two workers) costs three
    # micro-batches of declared compute: bandwidth = payload / (3 x seconds per micro-batch).
    seconds = 0.01
    padded = ZeRO1(tiny_gpt(), RecordingComm(world_size=2), StrategyContext()).flat.padded_numel
    bandwidth_gbps = 4 * padded / (3 * seconds) * 8 / 1e9
    profile = NetworkProfile(name="t", bandwidth_gbps=bandwidth_gbps, latency_ms=0.0)
    context = StrategyContext(optim=ADAMW, total_steps=8)
    acco, _, acco_clock = _emulated(lambda comm: ACCO(tiny_gpt(), comm, context), profile, seconds)
    closure = _gpt_closure(acco, acco_clock)
    per_phase = []
    for _ in range(8):
        extras = acco.step(closure).extras
        per_phase += [extras["microbatches_estimate"], extras["microbatches_update"]]
    zero, _, zero_clock = _emulated(lambda comm: ZeRO1(tiny_gpt(), comm, context), profile, seconds)
    zero_closure = _gpt_closure(zero, zero_clock)
    for _ in range(8):
        zero.step(zero_closure)
    assert acco_clock.utilization > 0.85
    assert sum(per_phase) / len(per_phase) > 2
    assert zero_clock.utilization < 0.4
    # and the counts follow the clock: comm slightly above 3 micro-batches -> 4 per phase
    assert set(per_phase) == {4.0}


def test_acco_on_the_real_clock_accumulates_while_the_thread_communicates() -> None:
    # Modeled phase: ~0.1 s on the link; a linear micro-batch takes well under a millisecond,
    # so every phase runs several micro-batches before the modeled time passes.
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=25.0)
    clock = RealClock()
    comm = NetworkComm(RecordingComm(rank=0, world_size=2), profile, clock)
    strategy = ACCO(_linear(), comm, _context(SGD, 3), AccoOptions(optimizer="sgd"))
    closure = _linear_closure(strategy, 0, [])
    counts = []
    for _ in range(3):
        extras = strategy.step(closure).extras
        counts += [extras["microbatches_estimate"], extras["microbatches_update"]]
    assert min(counts) > 1
    # replicas: C = 2 x (this worker's count of the committed buffer)
    assert strategy.committed_gradients % 2 == 0 and strategy.committed_gradients > 6
    strategy.finish()


def test_state_bytes_against_table_1() -> None:
    world = 4
    strategy = ACCO(tiny_gpt(), RecordingComm(world_size=world), StrategyContext())
    psi = strategy.flat.numel
    padded = strategy.flat.padded_numel
    # fp32 working copy: (4 + 4 + 4 + 12/M) Psi, the formula in the precision used
    assert strategy.formula_state_bytes() == round((12 + 12 / world) * psi)
    # measured: params, G, B (4 each) + master, m, v (12) + RS shard (4) + lookahead shard (4)
    # per owned element; the extra two shards are the 8/M above Table 1.
    assert strategy.state_bytes() == 12 * padded + (12 + 4 + 4) * padded // world
    dpu = DPU(tiny_gpt(), RecordingComm(world_size=world), StrategyContext())
    assert dpu.state_bytes() == 12 * padded + (12 + 4) * padded // world
    assert dpu.formula_state_bytes() == strategy.formula_state_bytes()


# --- multi-process -------------------------------------------------------------------------


def _calibrated_acco(raw: Comm, model: nn.Module) -> dict[str, Any]:
    """ACCO on the calibrated clock over ``raw`` (worker r is 1 + r times slower; the link
    takes about three fast micro-batches per phase): what the clock and the model end at."""
    calibration = Calibration(
        seconds_per_microbatch=0.01, seconds_per_element=1e-9, micro_batch_size=1,
        block_size=8, num_params=1,
    )  # fmt: skip
    clock = CalibratedClock(calibration, speed_factor=1.0 + raw.rank)
    numel = sum(p.numel() for p in model.parameters())
    profile = NetworkProfile(name="t", bandwidth_gbps=4 * numel / 0.03 * 8 / 1e9)
    strategy = ACCO(model, NetworkComm(raw, profile, clock),
                    StrategyContext(optim=ADAMW, total_steps=3))  # fmt: skip
    calls = [0]

    def closure() -> MicroBatchResult:
        inputs, targets = global_batch(calls[0], raw.world_size)
        rows = slice(4 * raw.rank, 4 * raw.rank + 4)
        calls[0] += 1
        with clock.microbatch():
            _, loss = strategy.model(inputs[rows], targets[rows])
            assert loss is not None
            loss.backward()
        return MicroBatchResult(float(loss.detach()), 4, inputs[rows].numel())

    with clock.training():
        counts = [strategy.step(closure).microbatches for _ in range(3)]
        strategy.finish()
        now = clock.now()
    return {"now": now, "compute": clock.compute_s, "counts": counts,
            "params": strategy.flat.params.clone()}  # fmt: skip


def _gloo_equations() -> dict[str, Any]:
    """On each rank: ACCO (SGD, rank r forced to r+1 micro-batches per phase), ACCO (AdamW,
    one per phase), DPU (SGD, r+1 per phase), all through the threaded chain on Gloo; and
    ACCO on the calibrated clock (:func:`_calibrated_acco`)."""
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank = comm.rank
    out: dict[str, Any] = {"calibrated": _calibrated_acco(comm, tiny_gpt())}
    runs = [
        ("acco_sgd", ACCO, "sgd", rank + 1, SGD),
        ("acco_adamw", ACCO, "adamw", 1, ADAMW),
        ("dpu_sgd", DPU, "sgd", rank + 1, SGD),
    ]
    for key, cls, optim, count, config in runs:
        strategy = cls(_linear(), comm, _context(config, 4),
                       AccoOptions(microbatches_per_phase=count, optimizer=optim))  # type: ignore[arg-type]  # fmt: skip
        closure = _linear_closure(strategy, rank, [])
        trajectory = []
        for _ in range(4):
            strategy.step(closure)
            trajectory.append(_params(strategy))
        strategy.finish()
        out[key] = trajectory
    return out


def test_threaded_chain_on_two_gloo_ranks_follows_the_equations_as_in_one_process() -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_gloo_equations, 2)
    theta0 = _params(ACCO(_linear(), LocalComm(), _context(SGD)))
    expected = {
        "acco_sgd": _acco_reference(theta0, 4, [1, 2], _sgd)[0],
        "acco_adamw": _acco_reference(theta0, 4, [1, 1], _adamw)[0],
        "dpu_sgd": _dpu_reference(theta0, 4, [1, 2], _sgd),
    }
    for key, thetas in expected.items():
        for t in range(4):
            # every worker holds identical parameters after every committed step ...
            assert torch.equal(results[0][key][t], results[1][key][t]), (key, t)
            # ... equal to the equations, normalised by the summed counts of both workers
            assert torch.allclose(results[0][key][t], thetas[t], atol=1e-6), (key, t)
    # The two workers as threads of this process: their chains run on the group's one
    # scheduler, each measured by its own worker's meter, and the collectives' arithmetic is
    # charged to no one (as Gloo's): the same clocks, micro-batch counts and parameters.
    from lowcomm.comm.inprocess import InProcessGroup
    from lowcomm.launch.inprocess import run_threads

    group, models = InProcessGroup(2), [tiny_gpt(), tiny_gpt()]  # (the global RNG: not in threads)
    threads = run_threads(
        lambda rank: _calibrated_acco(group.comm(rank), models[rank]), 2, (group,)
    )
    for processes, inprocess in zip((r["calibrated"] for r in results), threads, strict=True):
        assert inprocess["counts"] == processes["counts"] and len(set(processes["counts"])) > 1
        assert abs(inprocess["now"] - processes["now"]) <= 1e-9
        assert abs(inprocess["compute"] - processes["compute"]) <= 1e-9
        assert torch.equal(inprocess["params"], processes["params"])


def _heterogeneous(
    factors: tuple[float, ...], seconds: float, bandwidth_gbps: float
) -> dict[str, Any]:
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    profile = NetworkProfile(name="t", bandwidth_gbps=bandwidth_gbps, latency_ms=0.0,
                             speed_factors=factors)  # fmt: skip
    clock = VirtualClock(
        speed_factor=profile.speed_factor(raw.rank), seconds_per_microbatch=seconds
    )
    comm = NetworkComm(raw, profile, clock)
    strategy = ACCO(tiny_gpt(), comm, StrategyContext(optim=ADAMW, total_steps=4))
    closure = _gpt_closure(strategy, clock)
    estimate, update, committed = [], [], []
    for _ in range(4):
        extras = strategy.step(closure).extras
        estimate.append(extras["microbatches_estimate"])
        update.append(extras["microbatches_update"])
        committed.append(extras["global_microbatches_committed"])
    strategy.finish()
    return {
        "estimate": estimate,
        "update": update,
        "committed": committed,
        "exposed": clock.exposed_comm_s,
        "compute": clock.compute_s,
        "params": strategy.flat.params.clone(),
    }


@pytest.mark.slow
def test_heterogeneous_workers_accumulate_different_counts_and_never_idle() -> None:
    from lowcomm.launch import spawn_workers

    seconds = 0.01
    padded = ZeRO1(tiny_gpt(), RecordingComm(world_size=2), StrategyContext()).flat.padded_numel
    bandwidth_gbps = 4 * padded / (3 * seconds) * 8 / 1e9  # one phase ~ 3 fast micro-batches
    fast, slow = spawn_workers(_heterogeneous, 2, ((1.0, 3.0), seconds, bandwidth_gbps))
    assert torch.equal(fast["params"], slow["params"])
    # the slow worker contributes fewer micro-batches per phase, and neither waits on the wire
    assert sum(fast["estimate"] + fast["update"]) > 2 * sum(slow["estimate"] + slow["update"])
    assert min(slow["estimate"] + slow["update"]) >= 1
    assert fast["exposed"] == 0.0 and slow["exposed"] == 0.0
    # C counts both workers' micro-batches: the committed buffer holds the previous update
    # phase's (or the initial) gradients plus this estimate phase's, on each worker.
    for worker in (fast, slow):
        assert worker["committed"] == slow["committed"]
    previous = {"fast": 1.0, "slow": 1.0}  # the initial gradient g~(0)
    for t in range(4):
        expected = (previous["fast"] + fast["estimate"][t]) + (
            previous["slow"] + slow["estimate"][t]
        )
        assert fast["committed"][t] == expected
        previous = {"fast": fast["update"][t], "slow": slow["update"][t]}


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", ["acco", "dpu", "wp"])
def test_cli_trains_and_writes_the_summary(tmp_path: Path, method: str) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--method", method, "--steps", "3", "--out", str(out),
                     "--acco.microbatches-per-phase", "1", *SMALL)  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["steps"] == 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    # fp32 gradient payload; RS + AG on two workers sends one payload per phase.
    payload = 4 * summary["num_params"]
    phases = 2 if method == "acco" else 1
    assert summary["bytes_by_role"]["gradient"] == pytest.approx(3 * phases * payload / 2, rel=0.01)
    assert summary["bytes_by_role"]["parameter"] == pytest.approx(
        3 * phases * payload / 2, rel=0.01
    )
    assert summary["final_val_loss"] < 10


#: Cycles of a spin kernel that the GPU variant of the overlap test times (~0.1-0.2 s).
_SPIN_CYCLES = 300_000_000


def _spin_on_current_stream() -> tuple[Any, Any]:
    """A spin kernel on the current CUDA stream between two timing events."""
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(_SPIN_CYCLES)
    end.record()
    return begin, end


class _GatedComm(RecordingComm):
    """A recording comm whose all-gather (the chain's last collective) completes only once the
    main thread has seen the chain in flight: the chain cannot finish before the backward pass
    it overlaps with, however fast the device (on an H200 it did, and the test failed)."""

    def __init__(self, *, world_size: int) -> None:
        super().__init__(world_size=world_size)
        self.seen_in_flight = threading.Event()
        self.spans: list[tuple[Any, Any]] = []  # on a GPU: the chain's device work, timed

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        done = super().all_gather(output, input, role=role)
        if output.is_cuda:  # device work of the chain's, on the stream it issues on
            self.spans.append(_spin_on_current_stream())
        gate = self.seen_in_flight

        class _Gated:
            def wait(self) -> None:
                assert gate.wait(timeout=60), "the main thread never saw the chain in flight"
                gate.clear()
                done.wait()

            def done(self) -> bool:
                return gate.is_set()

            def settle(self) -> Settled:
                self.wait()
                return Settled()

        return _Gated()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
        )),
    ],
)  # fmt: skip
def test_the_main_thread_computes_while_the_chain_runs_on_a_side_stream(device: str) -> None:
    model = tiny_gpt().to(device)
    comm = _GatedComm(world_size=2)
    strategy = ACCO(model, comm, StrategyContext(optim=ADAMW, total_steps=3),
                    AccoOptions(microbatches_per_phase=2))  # fmt: skip
    calls = [0]
    overlapped = []
    computed: list[tuple[Any, Any]] = []

    def closure() -> MicroBatchResult:
        inputs, targets = global_batch(calls[0], 1)
        calls[0] += 1
        _, loss = strategy.model(inputs.to(device), targets.to(device))
        assert loss is not None
        loss.backward()
        in_flight = strategy.runner is not None and strategy.runner.busy
        overlapped.append(in_flight)
        if in_flight:
            if device == "cuda":  # device work of the main thread's, on its stream
                computed.append(_spin_on_current_stream())
            comm.seen_in_flight.set()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    for _ in range(3):
        strategy.step(closure)
    strategy.finish()
    # The main thread ran a backward pass while each chain was in flight (6 chains, 12 phase
    # micro-batches after the first, priming one).
    assert sum(overlapped) >= 6
    if device == "cuda":
        assert strategy.last_chain_stream is not None
        assert strategy.last_chain_stream != torch.cuda.default_stream(torch.device(device))
        # The overlap is the device's: some of the chain's device work ran while the main
        # stream's did (their timing events' intervals intersect), not only the host's calls.
        torch.cuda.synchronize()
        assert computed and comm.spans
        assert any(
            main_begin.elapsed_time(chain_end) > 0 and chain_begin.elapsed_time(main_end) > 0
            for main_begin, main_end in computed
            for chain_begin, chain_end in comm.spans
        )
    else:
        assert strategy.last_chain_stream is None


def test_a_long_phase_is_announced_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Compute declared far cheaper than the link: a phase runs many micro-batches, and the
    # run would look hung without a word. Rank 0 says why, once.
    import lowcomm.strategies.acco as acco_module

    monkeypatch.setattr(acco_module, "LONG_PHASE_MICROBATCHES", 20)
    monkeypatch.setattr(acco_module, "LONG_PHASE_SECONDS", 0.0)
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=30.0)
    context = StrategyContext(optim=ADAMW, total_steps=3)
    strategy, _, clock = _emulated(
        lambda c: ACCO(tiny_gpt(), c, context, AccoOptions()), profile, 0.001
    )
    closure = _gpt_closure(strategy, clock)
    counts = [strategy.step(closure).microbatches for _ in range(3)]
    strategy.finish()
    assert max(counts) > 20  # the phases really were long
    said = capsys.readouterr().err
    assert said.count("in one phase and its communication is still running") == 1
    assert "--acco.microbatches-per-phase" in said


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3)])  # (the same padded length)
def test_an_elastic_resume_keeps_the_schedule_step_reached(old: int, new: int) -> None:
    """The schedule is indexed by committed samples per synchronous step, which depends on the
    worker count: after a resume on another count it goes on from the step reached, at the
    new count's rate, instead of jumping (indexed by the new count's rate alone, 3 -> 2
    workers would go from step 10 to 15)."""
    context = _context(SGD, 100)

    def acco(workers: int) -> ACCO:
        return ACCO(_linear(), RecordingComm(rank=0, world_size=workers), context, AccoOptions())

    before = acco(old)
    per_step = {m: 2 * m * context.microbatches_per_step for m in (old, new)}  # 2 phases
    before.committed_gradients = 10 * per_step[old] + 1
    assert before.schedule_step() == 10
    state = {**before.state_dict(), "optimizer": acco(new).optimizer.state_dict()}

    after = acco(new)
    after.load_state_dict(state)
    assert after.schedule_step() == 10
    committed = after.committed_gradients
    assert after.schedule_step(committed + per_step[new] - 1) == 10
    assert after.schedule_step(committed + per_step[new]) == 11
    assert after.schedule_step(committed + 5 * per_step[new]) == 15
    # And a second change goes on from there.
    again = acco(old)
    again.load_state_dict({**after.state_dict(), "optimizer": before.optimizer.state_dict()})
    assert again.schedule_step() == 10

    # The same count resumes exactly as before.
    same = acco(old)
    same.load_state_dict({**before.state_dict()})
    assert same.schedule_base == (0, 0) and same.schedule_step() == 10


@pytest.mark.parametrize("name", ["acco", "dpu", "wp"])
def test_a_token_budget_commits_exactly_the_budget(name: str) -> None:
    """With a token budget the run ends when the committed micro-batches reach it: a worker
    whose share is computed runs no more micro-batches (a phase may then run none), so the
    last commit never takes more than the budget, wherever the share ends in a step (not
    one micro-batch per worker too many)."""
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=20.0)
    outcomes = []  # (budget, committed, this worker's micro-batches)
    for budget in range(4, 41, 2):  # 2 workers: shares of 2 to 20 micro-batches
        context = StrategyContext(
            optim=ADAMW, total_steps=40, max_grad_norm=None, microbatch_budget=budget
        )
        strategy, _, clock = _emulated(
            lambda c, context=context: strategy_class(name)(tiny_gpt(), c, context),
            profile,
            0.01,
        )
        assert isinstance(strategy, ACCO | DPU | WP)
        closure = _gpt_closure(strategy, clock)
        computed = 0
        while strategy.committed_gradients < budget:
            computed += strategy.step(closure).microbatches
        strategy.finish()
        outcomes.append((budget, strategy.committed_gradients, computed))
    assert outcomes == [(budget, budget, budget // 2) for budget, _, _ in outcomes]


def test_budget_shares_follow_the_workers_speeds() -> None:
    from lowcomm.config import TrainConfig
    from lowcomm.strategies.base import budget_shares

    # One of 4 workers 4x slower: 13 micro-batches per slow one, as in ACCO's straggler claim.
    assert budget_shares(384, [1, 1, 1, 4]) == (118, 118, 118, 30)
    assert budget_shares(10, [1, 1, 1]) == (4, 3, 3)  # the remainder to the lower ranks
    assert budget_shares(7, [1, 2]) == (5, 2)
    assert budget_shares(3, [1, 1, 100]) == (1, 1, 1)  # at least one each while it allows
    for budget in range(1, 60):
        for factors in ([1.0], [1, 3], [2, 1, 1.5], [1, 1, 1, 4]):
            shares = budget_shares(budget, factors)
            assert sum(shares) == budget and min(shares) >= (1 if budget >= len(factors) else 0)

    config = TrainConfig(
        method="acco",
        placement=PlacementConfig(workers=4),
        comm=CommConfig(speed_factors=(1, 1, 1, 4)),
        run=RunConfig(token_budget=98304),
    )
    context = strategy_context(config)
    assert context.microbatch_budget == 98304 // config.tokens_per_microbatch()
    assert context.microbatch_shares == budget_shares(context.microbatch_budget, [1, 1, 1, 4])
    assert strategy_context(TrainConfig(method="acco")).microbatch_shares is None


def test_a_worker_stops_at_its_own_share() -> None:
    context = StrategyContext(
        optim=ADAMW, total_steps=10, max_grad_norm=None, microbatch_budget=8,
        microbatch_shares=(6, 2),
    )  # fmt: skip
    fast = ACCO(_linear(), RecordingComm(rank=0, world_size=2), context, AccoOptions())
    slow = ACCO(_linear(), RecordingComm(rank=1, world_size=2), context, AccoOptions())
    fast.computed = slow.computed = 2
    assert not fast._share_spent() and slow._share_spent()
    fast.computed = 6
    assert fast._share_spent()


class _ThreadStreams:
    """A stand-in for ``torch.cuda``'s events: each thread's current stream is its own;
    ``waits`` notes (stream the event was recorded on, stream made to wait for it)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.waits: list[tuple[str, str]] = []

    def current_stream(self, device: torch.device) -> str:
        return self.names[threading.get_ident()]

    def Event(self) -> Any:
        streams = self

        class _Event:
            stream = ""

            def record(self, stream: str) -> None:
                self.stream = stream

            def wait(self, stream: str) -> None:
                streams.waits.append((self.stream, stream))

        return _Event()


def test_the_launch_agreement_is_handed_between_threads_streams_by_events() -> None:
    """The launch-time tensor is filled on the main thread's stream, all-reduced on the
    communication thread's and read back on the main thread's: each hand-over is ordered by
    an event, not by both threads happening to use one stream. ``meta`` stands in for the GPU."""
    from lowcomm.comm.fake import RecordingComm
    from lowcomm.comm.overlap import LaunchAgreement

    names = {threading.get_ident(): "main"}
    cuda = _ThreadStreams(names)
    meta = torch.device("meta")
    agreement = LaunchAgreement(1.5, exchange=True, device=meta, cuda=cuda)
    assert cuda.waits == []

    def communicate() -> None:
        names[threading.get_ident()] = "comm"
        agreement.run(RecordingComm(world_size=2, device=meta))

    thread = threading.Thread(target=communicate)
    thread.start()
    thread.join()
    agreement.wait()
    assert cuda.waits == [("main", "comm"), ("comm", "main")]
