"""Local-update family (docs/ALGORITHMS.md §3): Local SGD/AdamW, Overlap-Local-SGD, SlowMo, CO2.

Unit tests against the update rules written out here, reductions to simpler methods, the
asynchronous all-reduce's launch/wait pattern and its overlap on the virtual clock, memory,
options, multi-process Gloo runs and the CLI.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _cli import SMALL, lowcomm
from _dist import flat_params, global_batch, tiny_gpt
from lowcomm.comm import (
    CollectiveKind,
    CompletedHandle,
    NetworkComm,
    NetworkProfile,
    RecordingComm,
    Role,
    VirtualClock,
)
from lowcomm.comm.base import Handle, ReduceOp
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.optim.schedule import learning_rate
from lowcomm.strategies import MicroBatchResult, StrategyContext, strategy_class
from lowcomm.strategies.base import Strategy
from lowcomm.strategies.co2 import (
    CO2,
    LocalAdamW,
    LocalOptions,
    LocalSGD,
    OverlapLocalSGD,
    SlowMo,
)

SGD_CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=0.05, weight_decay=0.0),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=100,
    max_grad_norm=None,
)


class _Vector(nn.Module):
    """A model that is one parameter vector; the loss <w, g> has gradient exactly g."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(values.clone())


def _linear_closure(strategy: Strategy, gradients: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    queue = list(gradients)

    def closure() -> MicroBatchResult:
        gradient = queue.pop(0)
        loss = (strategy.model.weight * gradient).sum()  # type: ignore[operator]
        loss.backward()
        return MicroBatchResult(float(loss.detach()), 1, 1)

    return closure


def _batch_closure(
    strategy: Strategy,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    clock: VirtualClock | None = None,
):  # type: ignore[no-untyped-def]
    queue = list(batches)

    def closure() -> MicroBatchResult:
        inputs, targets = queue.pop(0)
        _, loss = strategy.model(inputs, targets)
        assert loss is not None
        loss.backward()
        if clock is not None:
            clock.microbatch_done()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    return closure


# --- CO2: penalty, clipping, delayed-SlowMo reduction ----------------------------------


def test_co2_momentum_uses_the_outer_gradient_divided_by_lambda() -> None:
    torch.manual_seed(1)
    n, tau, rounds, lr = 6, 2, 5, SGD_CONTEXT.optim.lr
    alpha, beta, eps = 0.7, 0.5, 1e-12
    options = LocalOptions(
        sync_every=tau, inner_optimizer="sgd", outer_lr=alpha, outer_momentum=beta,
        gap_penalty=True, clip=False, penalty_epsilon=eps,
    )  # fmt: skip
    # Start at 0 so anchor differences keep their float32 precision (no cancellation).
    strategy = CO2(_Vector(torch.zeros(n)), RecordingComm(world_size=4), SGD_CONTEXT, options)
    # Coordinates with very different gradient sizes give a Lambda that varies element-wise.
    scales = torch.tensor([1e-3, 1e-2, 0.1, 1.0, 3.0, 10.0])
    gradients = [torch.randn(n) * scales for _ in range(tau * rounds)]
    closure = _linear_closure(strategy, gradients)
    anchors = [strategy.anchor.clone()]  # anchors[t] = x_{t,0}
    momenta = []  # momenta[t] = m_t (m_0 = 0: round 0 has no outer update)
    for _ in range(rounds):
        for _ in range(tau):
            strategy.step(closure)
        anchors.append(strategy.anchor.clone())
        momenta.append(strategy.momentum.clone())
    # The reference, straight from Alg. 1 (identical replicas: the all-reduce is the identity).
    lambdas = []
    for t in range(1, rounds):
        start = anchors[t - 1]  # x_{t-1,0}
        x = start.clone()
        first = None
        for k in range(tau):
            x = x - lr * gradients[(t - 1) * tau + k]
            if k == 0:
                first = x.clone()
        assert first is not None
        outer_gradient = start - x  # Delta_{t-1}
        displacement = first - start  # d_{t-1}
        lam = (anchors[t] - anchors[t - 1]).abs() / (tau * displacement.abs() + eps) + 1
        expected = beta * momenta[t - 1] + outer_gradient / lam
        assert torch.allclose(momenta[t], expected, rtol=1e-4, atol=1e-9), t
        assert torch.allclose(anchors[t + 1], anchors[t] - alpha * momenta[t], rtol=1e-6, atol=1e-7)
        lambdas.append(lam)
    assert torch.equal(lambdas[0], torch.ones(n))  # Lambda_1 = 1: the first round kept the anchor
    assert all(bool((lam > 1.05).any()) for lam in lambdas[1:])  # the penalty really acts
    assert float(lambdas[-1].max() / lambdas[-1].min()) > 1.05  # ... element-wise
    # Without the penalty the momentum differs.
    plain = CO2(_Vector(anchors[0]), RecordingComm(world_size=4), SGD_CONTEXT,
                LocalOptions(**{**options.__dict__, "gap_penalty": False}))  # fmt: skip
    plain_closure = _linear_closure(plain, gradients)
    for _ in range(tau * rounds):
        plain.step(plain_closure)
    assert not torch.allclose(plain.momentum, momenta[-1], rtol=1e-3)


@pytest.mark.parametrize("clip", [True, False])
def test_co2_clips_the_applied_outer_step_coordinate_wise(clip: bool) -> None:
    phi, lr = 0.01, 0.1
    options = LocalOptions(
        sync_every=1, inner_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0,
        gap_penalty=False, clip=clip, clip_threshold=phi,
    )  # fmt: skip
    context = StrategyContext(
        optim=AdamWConfig(lr=lr, weight_decay=0.0),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0), max_grad_norm=None,
    )  # fmt: skip
    gradient = torch.tensor([1.0, -1.0, 1e-3, -1e-3])  # |m| = lr |g|: two above phi, two below
    strategy = CO2(_Vector(torch.zeros(4)), RecordingComm(world_size=2), context, options)
    closure = _linear_closure(strategy, [gradient] * 2)
    strategy.step(closure)  # round 0: launch only, the anchor is kept
    assert torch.equal(strategy.anchor, torch.zeros(4))
    before = strategy.anchor.clone()
    stats = strategy.step(closure)  # round 1: m_1 = Delta_0 = lr g
    momentum = lr * gradient
    assert torch.allclose(strategy.momentum, momentum)
    applied = before - strategy.anchor
    if clip:
        expected = torch.tensor([phi, -phi, 1e-4, -1e-4])
        assert stats.extras["clipped_fraction"] == 0.5
    else:
        expected = momentum
        assert "clipped_fraction" not in stats.extras
    assert torch.allclose(applied, expected, rtol=1e-5, atol=1e-9)
    # Below phi the step is the momentum itself, above it exactly phi with the sign of m.
    assert torch.allclose(applied[2:], momentum[2:], rtol=1e-5)


def test_co2_without_penalty_and_clipping_is_slowmo_on_one_round_delayed_outer_gradients() -> None:
    tau, rounds, alpha, beta, lr, mu = 3, 4, 0.8, 0.6, 0.05, 0.9
    options = LocalOptions(
        sync_every=tau, inner_optimizer="sgd", sgd_momentum=mu, outer_lr=alpha,
        outer_momentum=beta, gap_penalty=False, clip_threshold=math.inf,
    )  # fmt: skip
    strategy = CO2(tiny_gpt(), RecordingComm(world_size=4), SGD_CONTEXT, options)
    batches = [global_batch(s, 1) for s in range(tau * rounds)]
    closure = _batch_closure(strategy, batches)
    for _ in range(tau * rounds):
        strategy.step(closure)
    strategy.finish()
    # Reference: torch's SGD inside, outer momentum on the previous round's outer gradient.
    model = tiny_gpt()
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=mu)
    anchor = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    momentum = torch.zeros_like(anchor)
    previous: torch.Tensor | None = None
    queue = list(batches)
    for _ in range(rounds):
        # clone(): vector_to_parameters makes the parameters views of the vector it is given.
        nn.utils.vector_to_parameters(anchor.clone(), model.parameters())
        for _ in range(tau):
            inner.zero_grad()
            inputs, targets = queue.pop(0)
            model(inputs, targets)[1].backward()
            inner.step()
        outer_gradient = anchor - nn.utils.parameters_to_vector(model.parameters()).detach()
        if previous is not None:
            momentum = beta * momentum + previous
            anchor = anchor - alpha * momentum
        previous = outer_gradient
    assert previous is not None
    momentum = beta * momentum + previous  # the drain at the end applies the last one
    anchor = anchor - alpha * momentum
    assert not torch.allclose(anchor, flat_params(tiny_gpt()), atol=1e-3)  # it trained
    assert torch.allclose(flat_params(strategy.model), anchor, atol=1e-5, rtol=0)


# --- the other methods against their equations -----------------------------------------


def test_overlap_local_sgd_pulls_toward_the_stale_anchor() -> None:
    torch.manual_seed(2)
    tau, rounds, pull, lr = 2, 4, 0.3, SGD_CONTEXT.optim.lr
    start = torch.randn(5)
    gradients = [torch.randn(5) for _ in range(tau * rounds)]
    strategy = OverlapLocalSGD(
        _Vector(start), RecordingComm(world_size=3), SGD_CONTEXT,
        LocalOptions(sync_every=tau, inner_optimizer="sgd", pull=pull),
    )  # fmt: skip
    closure = _linear_closure(strategy, gradients)
    x, anchor = start.clone(), None
    for t in range(rounds):
        for k in range(tau):
            strategy.step(closure)
            x = x - lr * gradients[t * tau + k]
        if anchor is not None:  # no anchor at the first boundary: no pull
            x = x - pull * (x - anchor)
        anchor = x.clone()  # identical replicas: the all-reduce of x is x
        assert torch.allclose(strategy.flat.params, x, atol=1e-6), t


def test_slowmo_follows_the_slow_momentum_equations() -> None:
    torch.manual_seed(3)
    tau, rounds, alpha, beta = 2, 3, 0.9, 0.5
    context = StrategyContext(
        optim=AdamWConfig(lr=0.05, weight_decay=0.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=1), total_steps=tau * rounds,
        max_grad_norm=None,
    )  # fmt: skip
    start = torch.randn(4)
    gradients = [torch.randn(4) for _ in range(tau * rounds)]
    strategy = SlowMo(
        _Vector(start), RecordingComm(world_size=2), context,
        LocalOptions(sync_every=tau, inner_optimizer="sgd", outer_lr=alpha, outer_momentum=beta),
    )  # fmt: skip
    closure = _linear_closure(strategy, gradients)
    anchor, u, step = start.clone(), torch.zeros(4), 0
    for _ in range(rounds):
        x = anchor.clone()
        for _ in range(tau):
            gamma = learning_rate(context.schedule, 0.05, step, context.total_steps)
            x = x - gamma * gradients[step]
            strategy.step(closure)
            step += 1
        u = beta * u + (anchor - x) / gamma
        anchor = anchor - alpha * gamma * u
        assert torch.allclose(strategy.anchor, anchor, atol=1e-6)
        assert torch.allclose(strategy.flat.params, anchor)  # every worker restarts there


def test_local_sgd_inner_state_is_persistent_and_never_averaged() -> None:
    strategy = LocalSGD(
        tiny_gpt(), RecordingComm(world_size=4), SGD_CONTEXT,
        LocalOptions(sync_every=2, sgd_momentum=0.9),
    )  # fmt: skip
    closure = _batch_closure(strategy, [global_batch(s, 1) for s in range(4)])
    strategy.step(closure)
    assert strategy.comm.calls == []  # type: ignore[attr-defined]
    stats = strategy.step(closure)
    assert stats.extras["synced"] == 1.0
    buffer = strategy.inner.momentum_buffer
    assert buffer is not None and float(buffer.abs().sum()) > 0
    calls = strategy.comm.calls  # type: ignore[attr-defined]
    assert [(c.kind, c.role, c.numel) for c in calls] == [
        (CollectiveKind.ALL_REDUCE, Role.PARAMETER, strategy.flat.padded_numel)
    ]
    kept = buffer.clone()
    strategy.step(closure)
    assert not torch.equal(buffer, 0.9 * kept)  # it kept accumulating from the old state
    assert strategy.step(closure).extras["synced"] == 1.0


# --- reductions ----------------------------------------------------------------------


def test_slowmo_with_alpha_one_beta_zero_equals_local_adamw() -> None:
    context = StrategyContext(
        optim=AdamWConfig(lr=3e-3), schedule=ScheduleConfig(kind="cosine", warmup_steps=2),
        total_steps=9,
    )  # fmt: skip
    options = LocalOptions(sync_every=3, outer_lr=1.0, outer_momentum=0.0)
    local = LocalAdamW(tiny_gpt(), RecordingComm(world_size=4), context, options)
    slow = SlowMo(tiny_gpt(), RecordingComm(world_size=4), context, options)
    batches = [global_batch(s, 1) for s in range(9)]
    for strategy in (local, slow):
        closure = _batch_closure(strategy, batches)
        for _ in range(9):
            strategy.step(closure)
    assert not torch.allclose(flat_params(local.model), flat_params(tiny_gpt()), atol=1e-3)
    assert torch.allclose(flat_params(local.model), flat_params(slow.model), atol=1e-6, rtol=0)


# --- asynchrony: launch in one step, wait tau steps later; utilisation -------------------


class _TracedHandle:
    def __init__(self, owner: _TracingComm, index: int) -> None:
        self.owner, self.index = owner, index

    def wait(self) -> None:
        if self.owner.waits[self.index] is None:
            self.owner.waits[self.index] = self.owner.now

    def done(self) -> bool:
        return True


class _TracingComm(RecordingComm):
    """Records at which step each all-reduce was launched and first waited for."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size=world_size)
        self.now = 0
        self.launches: list[int] = []
        self.waits: list[int | None] = []

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = "mean", role: Role) -> Handle:
        super().all_reduce(tensor, op=op, role=role)
        self.launches.append(self.now)
        self.waits.append(None)
        return _TracedHandle(self, len(self.launches) - 1)


@pytest.mark.parametrize(
    ("method", "delay"), [("co2", 3), ("overlap_local_sgd", 3), ("slowmo", 0), ("local_adamw", 0)]
)
def test_asynchronous_all_reduce_is_waited_for_tau_steps_later(method: str, delay: int) -> None:
    tau, rounds = 3, 4
    comm = _TracingComm(world_size=4)
    strategy = strategy_class(method)(
        tiny_gpt(), comm, SGD_CONTEXT, options=LocalOptions(sync_every=tau)
    )  # type: ignore[call-arg]
    closure = _batch_closure(strategy, [global_batch(s, 1) for s in range(tau * rounds)])
    for _ in range(tau * rounds):
        strategy.step(closure)
        comm.now += 1
    assert comm.launches == [tau * (r + 1) - 1 for r in range(rounds)]
    if delay:  # the last one is still in flight until finish() drains it
        assert comm.waits[:-1] == [t + delay for t in comm.launches[:-1]]
        assert comm.waits[-1] is None
    else:
        assert comm.waits == comm.launches
    strategy.finish()
    assert None not in comm.waits
    if method == "co2":
        assert {c.role for c in comm.calls} == {Role.PSEUDO_GRADIENT}
        # Shared d: the outer gradient and the first-step displacement in one payload.
        assert comm.calls[0].numel == 2 * strategy.flat.padded_numel  # type: ignore[attr-defined]


def _utilisation(method: str, tau: int, rounds: int) -> float:
    seconds = 0.1
    model = tiny_gpt()
    psi_bytes = 4 * sum(p.numel() for p in model.parameters())
    world = 4
    # A parameter-sized all-reduce (2 (M-1)/M S / B) costs 0.45 tau micro-batches.
    bandwidth = 2 * (world - 1) / world * psi_bytes / (0.45 * tau * seconds)
    profile = NetworkProfile(name="custom", bandwidth_gbps=bandwidth * 8 / 1e9, latency_ms=0.0)
    clock = VirtualClock(seconds_per_microbatch=seconds)
    comm = NetworkComm(RecordingComm(world_size=world), profile, clock)
    strategy = strategy_class(method)(
        model, comm, SGD_CONTEXT, options=LocalOptions(sync_every=tau)
    )  # type: ignore[call-arg]
    batch = global_batch(0, 1)
    closure = _batch_closure(strategy, [batch] * (tau * rounds), clock)
    for _ in range(tau * rounds):
        strategy.step(closure)
    strategy.finish()
    assert clock.compute_s == pytest.approx(tau * rounds * seconds)
    return clock.utilization


def test_co2_hides_the_all_reduce_on_the_virtual_clock() -> None:
    tau, rounds = 4, 30
    co2 = _utilisation("co2", tau, rounds)
    slowmo = _utilisation("slowmo", tau, rounds)
    assert co2 > 0.95
    assert slowmo == pytest.approx(1 / 1.45, rel=1e-3)  # fully exposed, every round
    assert co2 > slowmo


# --- memory, options, deployment ------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "options", "bytes_per_parameter"),
    [
        ("local_sgd", {}, 8),  # params + grads; plain SGD holds no state
        ("local_sgd", {"sgd_momentum": 0.9}, 12),
        ("local_adamw", {}, 16),  # as DDP
        ("overlap_local_sgd", {}, 20),  # + one buffer (anchor and buffer share it)
        ("slowmo", {}, 24),  # + anchor + slow momentum (ACCO Table 1: +2 copies)
        ("co2", {}, 36),  # + anchor, m, d and a two-copy buffer (shared d)
        ("co2", {"shared_displacement": False}, 36),  # + anchor, m, buffer, d_t, d_{t-1}
        ("co2", {"gap_penalty": False}, 28),  # + anchor, m, buffer
    ],
)
def test_state_bytes_count_the_real_tensors(
    method: str, options: dict[str, Any], bytes_per_parameter: int
) -> None:
    strategy = strategy_class(method)(
        tiny_gpt(), RecordingComm(world_size=2), SGD_CONTEXT, options=LocalOptions(**options)
    )  # type: ignore[call-arg]
    assert strategy.state_bytes() == bytes_per_parameter * strategy.flat.padded_numel  # type: ignore[attr-defined]


def test_co2_state_bytes_in_bf16_follow_the_acco_convention() -> None:
    model = tiny_gpt().to(torch.bfloat16)
    strategy = CO2(
        model, RecordingComm(world_size=2), SGD_CONTEXT, LocalOptions(shared_displacement=False)
    )
    psi = strategy.flat.padded_numel
    # bf16 params 2 + grads 2 + fp32 master and moments K = 12 + five extra copies at 2 bytes.
    assert strategy.state_bytes() == (2 + 2 + 12 + 5 * 2) * psi


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("sync_every", 0, "--local.sync-every"),
        ("pull", 0.0, "--local.pull"),
        ("pull", 1.5, "--local.pull"),
        ("outer_momentum", 1.0, "--local.outer-momentum"),
        ("outer_lr", -1.0, "--local.outer-lr"),
        ("clip_threshold", 0.0, "--local.clip-threshold"),
        ("penalty_epsilon", 0.0, "--local.penalty-epsilon"),
        ("sgd_momentum", -0.1, "--local.sgd-momentum"),
        ("inner_optimizer", "lion", "--local.inner-optimizer"),
    ],
)
def test_bad_options_name_the_flag_and_the_fix(field: str, value: object, flag: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag}: ") as error:
        LocalOptions(**{field: value})  # type: ignore[arg-type]
    assert "must" in str(error.value) or "choose" in str(error.value)


def test_deployed_gives_the_anchor_and_restores_the_local_model() -> None:
    strategy = CO2(tiny_gpt(), RecordingComm(world_size=2), SGD_CONTEXT, LocalOptions(sync_every=4))
    closure = _batch_closure(strategy, [global_batch(s, 1) for s in range(2)])
    strategy.step(closure)
    strategy.step(closure)
    local = strategy.flat.params.clone()
    assert not torch.equal(local, strategy.anchor)
    with strategy.deployed() as model:
        assert torch.equal(flat_params(model), strategy.anchor)
    assert torch.equal(strategy.flat.params, local)


def test_co2_state_dict_resumes_exactly() -> None:
    options = LocalOptions(sync_every=2)
    context = StrategyContext(optim=AdamWConfig(lr=3e-3), total_steps=8)
    batches = [global_batch(s, 1) for s in range(8)]
    straight = CO2(tiny_gpt(), RecordingComm(world_size=2), context, options)
    closure = _batch_closure(straight, batches)
    for _ in range(8):
        straight.step(closure)
    first = CO2(tiny_gpt(), RecordingComm(world_size=2), context, options)
    closure = _batch_closure(first, batches[:5])
    for _ in range(5):
        first.step(closure)
    state = copy.deepcopy(first.state_dict())
    resumed = CO2(tiny_gpt(seed=7), RecordingComm(world_size=2), context, options)
    resumed.load_state_dict(state)
    assert isinstance(resumed.handle, CompletedHandle)  # the in-flight result was saved
    closure = _batch_closure(resumed, batches[5:])
    for _ in range(3):
        resumed.step(closure)
    assert torch.equal(resumed.flat.params, straight.flat.params)
    assert torch.equal(resumed.momentum, straight.momentum)


# --- multi-process ---------------------------------------------------------------------


def _gloo_runs(steps: int) -> dict[str, Any]:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size
    context = StrategyContext(
        optim=AdamWConfig(lr=0.05, weight_decay=0.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=2), total_steps=steps,
        max_grad_norm=None,
    )  # fmt: skip
    mine = []
    for step in range(steps):
        x, y = global_batch(step, world)
        mine.append((x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
    results: dict[str, Any] = {}

    def run(strategy: Strategy) -> torch.Tensor:
        closure = _batch_closure(strategy, mine)
        for _ in range(steps):
            strategy.step(closure)
        strategy.finish()
        return flat_params(strategy.model)

    # DDP with SGD, written out: average the gradients, step with the schedule's lr.
    model = tiny_gpt()
    for step, (inputs, targets) in enumerate(mine):
        model.zero_grad()
        model(inputs, targets)[1].backward()
        lr = learning_rate(context.schedule, context.optim.lr, step, steps)
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                comm.all_reduce(p.grad, op="mean", role=Role.GRADIENT).wait()
                p -= lr * p.grad
    results["ddp_sgd"] = flat_params(model)
    results["local_sgd_tau1"] = run(LocalSGD(tiny_gpt(), comm, context, LocalOptions(sync_every=1)))
    momentum = LocalOptions(sync_every=3, inner_optimizer="sgd", sgd_momentum=0.9,
                            outer_lr=1.0, outer_momentum=0.0)  # fmt: skip
    results["local_sgd_tau3"] = run(LocalSGD(tiny_gpt(), comm, context, momentum))
    results["slowmo_plain"] = run(SlowMo(tiny_gpt(), comm, context, momentum))

    adamw = StrategyContext(optim=AdamWConfig(lr=3e-3), total_steps=steps)
    for shared in (True, False):
        options = LocalOptions(sync_every=2, shared_displacement=shared)
        strategy = CO2(tiny_gpt(), comm, adamw, options)
        closure = _batch_closure(strategy, mine)
        anchors = []
        for _ in range(steps):
            stats = strategy.step(closure)
            if stats.extras.get("outer_step"):
                anchors.append(strategy.anchor.clone())
        strategy.finish()
        anchors.append(strategy.anchor.clone())
        results[f"co2_anchors_shared_{shared}"] = anchors
    return results


@pytest.mark.slow
def test_local_methods_on_three_gloo_ranks() -> None:
    from lowcomm.launch import spawn_workers

    steps = 12
    results = spawn_workers(_gloo_runs, 3, (steps,))
    start = flat_params(tiny_gpt())
    for result in results:
        # Local SGD with tau = 1 is DDP with SGD.
        assert not torch.allclose(result["ddp_sgd"], start, atol=1e-3)
        assert torch.allclose(result["local_sgd_tau1"], result["ddp_sgd"], atol=1e-5, rtol=0)
        # SlowMo with alpha = 1, beta = 0 is Local SGD (real averaging over different data).
        assert torch.allclose(result["slowmo_plain"], result["local_sgd_tau3"], atol=1e-5, rtol=0)
        assert not torch.allclose(result["local_sgd_tau3"], result["local_sgd_tau1"], atol=1e-4)
    # Shared d: every worker's anchor is identical after every outer step.
    shared = [r["co2_anchors_shared_True"] for r in results]
    assert len(shared[0]) == steps // 2  # outer steps from round 1 on, plus the drain
    for anchors in shared[1:]:
        assert all(torch.equal(a, b) for a, b in zip(anchors, shared[0], strict=True))
    assert not torch.equal(shared[0][-1], shared[0][0])
    # Local d: Lambda differs per worker, so the anchors drift apart.
    local = [r["co2_anchors_shared_False"] for r in results]
    assert not torch.equal(local[0][-1], local[1][-1])


# --- CLI ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "role"),
    # Two methods (each CLI run spawns workers); the other three share the same code path.
    [("local_sgd", "parameter"), ("co2", "pseudo_gradient")],
)
def test_cli_trains_each_method(tmp_path: Path, method: str, role: str) -> None:
    out = tmp_path / method
    result = lowcomm(
        "train", "--method", method, "--steps", "5", "--local.sync-every", "2",
        "--out", str(out), *SMALL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["steps"] == 5
    assert math.isfinite(summary["final_val_loss"])
    assert summary["bytes_by_role"][role] > 0
    assert summary["bytes_by_role"]["gradient"] == 0
    assert summary["state_bytes_per_worker"] > 0


@pytest.mark.slow
def test_cli_rejects_a_bad_local_option() -> None:
    result = lowcomm("train", "--method", "co2", "--local.sync-every", "0", timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lowcomm: error: --local.sync-every: 0 must be an integer >= 1")
