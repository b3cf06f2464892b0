"""CoCoDC (docs/ALGORITHMS.md §4.5): compensated merge, fragment selection, adaptive transmission."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from _dist import closure_for, global_batch
from lowcomm.comm import LocalComm
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.strategies import MicroBatchResult, StrategyContext
from lowcomm.strategies.cocodc import CoCoDC, compensated_merge, select_fragment, syncs_per_period
from lowcomm.strategies.diloco import DiLoCoOptions


def test_merge_with_lambda_zero_is_new_global_plus_overlap_progress() -> None:
    torch.manual_seed(0)
    new_global, at_launch, now = torch.randn(10), torch.randn(10), torch.randn(10)
    merged = compensated_merge(
        new_global, at_launch, now, overlap_steps=5, compensation=0.0, sync_every=50
    )
    assert torch.allclose(merged, new_global + (now - at_launch), atol=1e-6)
    # The literal printed sign moves against the local progress.
    literal = compensated_merge(
        new_global, at_launch, now, overlap_steps=5, compensation=0.0, sync_every=50, sign="literal"
    )
    assert torch.allclose(literal, new_global - (now - at_launch), atol=1e-6)


def test_merge_extra_term_follows_the_formula() -> None:
    torch.manual_seed(1)
    new_global, at_launch, now = torch.randn(10), torch.randn(10), torch.randn(10)
    tau, lam, horizon = 4, 0.5, 20
    merged = compensated_merge(
        new_global, at_launch, now, overlap_steps=tau, compensation=lam, sync_every=horizon
    )
    g = (at_launch - now) / tau
    d = new_global - at_launch
    extra = -(tau * lam / horizon) * g * g * d
    assert torch.allclose(merged - (new_global + (now - at_launch)), extra, atol=1e-6)
    assert float(extra.abs().max()) > 1e-3  # the term is really there


def test_selector_on_a_scripted_history() -> None:
    horizon = 100
    # R_p starts at infinity: untouched fragments go first, by index.
    assert select_fragment(12, [0, 0, 0, 0], [math.inf] * 4, [], horizon) == 0
    assert select_fragment(24, [17, 0, 0, 0], [0.3, math.inf, math.inf, math.inf], [], horizon) == 1
    # Otherwise argmax R_p, excluding in-flight fragments.
    assert select_fragment(60, [17, 29, 41, 53], [0.3, 0.9, 0.5, 0.2], [], horizon) == 1
    assert select_fragment(60, [17, 29, 41, 53], [0.3, 0.9, 0.5, 0.2], [1], horizon) == 2
    # Staleness rule: t_g - t_{p,b} >= H wins over the rates; stalest first, ties by index.
    assert select_fragment(120, [17, 29, 41, 110], [0.1, 0.9, 0.5, 0.2], [], horizon) == 0
    assert select_fragment(130, [17, 17, 41, 110], [0.1, 0.9, 0.5, 0.2], [], horizon) == 0
    assert select_fragment(130, [17, 17, 41, 110], [0.1, 0.9, 0.5, 0.2], [0], horizon) == 1
    assert select_fragment(130, [1, 1], [1.0, 1.0], [0, 1], horizon) is None


def test_syncs_per_period_follows_eq_9() -> None:
    assert syncs_per_period(4, 0.4, 100, 0.1, 0.5) == 8  # floor(0.4 * 100 * 0.1 / 0.5)
    assert syncs_per_period(4, 0.4, 100, 0.1, 5.0) == 4  # never fewer than K
    assert syncs_per_period(4, 0.4, 100, 0.0, 5.0) == 4  # nothing measured yet


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=16, vocab_size=64))


def test_cocodc_round_robin_without_a_clock_and_rates_recorded() -> None:
    context = StrategyContext(
        optim=AdamWConfig(lr=3e-3),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0),
        total_steps=24,
        max_grad_norm=None,
    )
    strategy = CoCoDC(
        _model(), LocalComm(), context, DiLoCoOptions(sync_every=12, fragments=4, overlap_steps=2)
    )
    batch = global_batch(0, 1)

    def closure() -> MicroBatchResult:
        _, loss = strategy.model(*batch)
        assert loss is not None
        loss.backward()
        return MicroBatchResult(float(loss.detach()), 4, 64)

    chosen = []
    for _ in range(24):
        stats = strategy.step(closure)
        if "synced_fragment" in stats.extras:
            chosen.append((strategy.step_index, int(stats.extras["synced_fragment"])))
    strategy.finish()
    # No clock: N = K, h = H/K = 3; fresh fragments (R = inf) first; no launch within tau of the end.
    assert [t for t, _ in chosen] == [3, 6, 9, 12, 15, 18, 21]
    assert [p for _, p in chosen[:4]] == [0, 1, 2, 3]
    assert all(math.isfinite(r) and r > 0 for r in strategy.rates)
    assert strategy.syncs_per_h == 4 and strategy.in_flight == []


def test_selector_boundary_a_fragment_exactly_h_steps_stale_is_due() -> None:
    horizon = 12
    # Fragment 1 was last synced exactly H steps ago: due (t - t_b >= H), despite the rates.
    assert select_fragment(20, [15, 8, 14], [5.0, 0.1, 2.0], [], horizon) == 1
    # One step less stale: not due, so argmax R_p decides.
    assert select_fragment(19, [15, 8, 14], [5.0, 0.1, 2.0], [], horizon) == 0
    # Two fragments exactly H stale: the lower index; a staler one beats both.
    assert select_fragment(20, [15, 8, 8], [5.0, 0.1, 2.0], [], horizon) == 1
    assert select_fragment(20, [7, 8, 8], [5.0, 0.1, 2.0], [], horizon) == 0
    # An in-flight fragment is skipped even when it is due.
    assert select_fragment(20, [15, 8, 14], [5.0, 0.1, 2.0], [1], horizon) == 0


def _recorded_cocodc_run(
    steps: int, options: DiLoCoOptions
) -> tuple[CoCoDC, list[tuple[int, int, list[int]]], list[tuple[int, int, int, float]]]:
    """A CoCoDC run on one worker with a batch per step; returns the strategy, its launches
    (step, fragment, fragments in flight) and completions (fragment, launched at, completed at,
    norm of the averaged outer gradient), recorded around the strategy's own methods."""
    context = StrategyContext(
        optim=AdamWConfig(lr=1e-2),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0),
        total_steps=steps,
        max_grad_norm=None,
    )
    strategy = CoCoDC(_model(), LocalComm(), context, options)
    launches: list[tuple[int, int, list[int]]] = []
    completions: list[tuple[int, int, int, float]] = []
    original_launch, original_complete, original_outer = (
        strategy.launch_sync,
        strategy.complete,
        strategy.outer_step,
    )
    norms: list[float] = []

    def launch(p: int, extras: torch.Tensor | None = None) -> Any:
        launches.append((strategy.step_index, p, [s.fragment for s in strategy.in_flight]))
        return original_launch(p, extras)

    def outer_step(p: int, delta: torch.Tensor) -> None:
        norms.append(float(delta.norm()))
        original_outer(p, delta)

    def complete(sync: Any, t: int) -> None:
        original_complete(sync, t)
        completions.append((sync.fragment, sync.launched_at, t, norms[-1]))

    strategy.launch_sync = launch  # type: ignore[method-assign]
    strategy.outer_step = outer_step  # type: ignore[method-assign]
    strategy.complete = complete  # type: ignore[method-assign]
    batches = [global_batch(s, 1) for s in range(steps)]
    closure = closure_for(strategy, batches)
    for _ in range(steps):
        strategy.step(closure)
    strategy.finish()
    return strategy, launches, completions


def _reference_choices(
    launches: list[tuple[int, int, list[int]]],
    completions: list[tuple[int, int, int, float]],
    fragments: int,
    horizon: int,
    *,
    divide: bool = True,
) -> list[int]:
    """ALGORITHMS.md §4.5 steps 3-4 replayed on the run's own events: on completing fragment p
    (launched at t_p, completed at t_l), R_p = ||mean Delta_p|| / (t_p - t_{p,b}), then
    t_{p,b} = t_l; at each launch the stalest fragment with t - t_{p,b} >= H, else argmax R_p,
    in-flight fragments excluded, ties by index."""
    rates = [math.inf] * fragments
    last = [0] * fragments
    pending = sorted(completions, key=lambda c: c[2])
    choices = []
    for step, _, in_flight in launches:
        while pending and pending[0][2] <= step:
            p, launched_at, completed_at, norm = pending.pop(0)
            rates[p] = norm / (launched_at - last[p]) if divide else norm
            last[p] = completed_at
        free = [p for p in range(fragments) if p not in in_flight]
        due = [p for p in free if step - last[p] >= horizon]
        if due:
            choices.append(max(due, key=lambda p: (step - last[p], -p)))
        else:
            choices.append(max(free, key=lambda p: (rates[p], -p)))
    return choices


def test_rate_is_the_outer_gradient_norm_per_step_since_the_last_sync() -> None:
    # No clock: N = K, h = H / K = 2 >= tau = 1, so one sync in flight at a time.
    options = DiLoCoOptions(sync_every=8, fragments=4, overlap_steps=1, compensation=0.0)
    strategy, launches, completions = _recorded_cocodc_run(60, options)
    chosen = [p for _, p, _ in launches]
    assert len(chosen) >= 25 and len(set(chosen)) == 4
    assert chosen == _reference_choices(launches, completions, 4, 8)
    # The run is one where the division matters: undivided norms choose differently.
    assert chosen != _reference_choices(launches, completions, 4, 8, divide=False)
    # The final R_p are the last completion's norm / interval of each fragment.
    for p in range(4):
        mine = [c for c in completions if c[0] == p]
        previous = mine[-2][2] if len(mine) > 1 else 0
        assert strategy.rates[p] == pytest.approx(mine[-1][3] / (mine[-1][1] - previous), rel=1e-12)


def test_completed_sync_merges_against_the_snapshot_taken_at_launch() -> None:
    tau, lam, horizon = 2, 0.5, 12
    options = DiLoCoOptions(sync_every=horizon, fragments=4, overlap_steps=tau, compensation=lam)
    context = StrategyContext(
        optim=AdamWConfig(lr=1e-2),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0),
        total_steps=30,
        max_grad_norm=None,
    )
    strategy = CoCoDC(_model(), LocalComm(), context, options)
    snapshots: dict[int, torch.Tensor] = {}
    checked: list[int] = []
    original_launch, original_complete = strategy.launch_sync, strategy.complete

    def launch(p: int, extras: torch.Tensor | None = None) -> Any:
        snapshots[strategy.step_index] = strategy.local_fragment(p).clone()  # theta_{t_p}
        return original_launch(p, extras)

    def complete(sync: Any, t: int) -> None:
        p = sync.fragment
        at_launch = snapshots.pop(sync.launched_at)
        now = strategy.local_fragment(p).clone()  # theta_{t_l}
        progress = now - at_launch
        assert float(progress.norm()) > 1e-4  # tau local steps moved the fragment
        original_complete(sync, t)
        new_global = strategy.globals_[p]
        # Sign-fixed Eq. 8 with Eq. 4 and Eq. 7 against the launch snapshot (lambda > 0)...
        rate = (at_launch - now) / tau
        corrected = rate + lam * rate * rate * (new_global - at_launch) / horizon
        assert torch.allclose(strategy.local_fragment(p), new_global - tau * corrected, atol=1e-6)
        # ...which keeps the local progress made during the overlap.
        assert torch.allclose(strategy.local_fragment(p), new_global + progress, atol=1e-5)
        checked.append(p)

    strategy.launch_sync = launch  # type: ignore[method-assign]
    strategy.complete = complete  # type: ignore[method-assign]
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(30)])
    for _ in range(30):
        strategy.step(closure)
    strategy.finish()
    assert len(checked) >= 8 and snapshots == {}


# --- multi-process: identical choices, measured T_c and T_s ---------------------------------


def _cocodc_worker(steps: int) -> tuple[list[int], list[float], int, float, float]:
    from lowcomm.comm.clock import make_clock
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    clock = make_clock("virtual", seconds_per_microbatch=0.05 * (1 + raw.rank))
    comm = NetworkComm(raw, NetworkProfile.from_preset("wan"), clock)
    context = StrategyContext(optim=AdamWConfig(lr=3e-3), total_steps=steps, max_grad_norm=None)
    strategy = CoCoDC(
        _model(),
        comm,
        context,
        DiLoCoOptions(sync_every=40, fragments=4, overlap_steps=2, transmission_gamma=1.0),
    )
    x, y = global_batch(0, raw.world_size)
    mine = (x[4 * raw.rank : 4 * raw.rank + 4], y[4 * raw.rank : 4 * raw.rank + 4])

    def closure() -> MicroBatchResult:
        _, loss = strategy.model(*mine)
        assert loss is not None
        loss.backward()
        clock.microbatch_done()
        return MicroBatchResult(float(loss.detach()), 4, 64)

    chosen = []
    for _ in range(steps):
        stats = strategy.step(closure)
        if "synced_fragment" in stats.extras:
            chosen.append(int(stats.extras["synced_fragment"]))
    strategy.finish()
    return (
        chosen,
        strategy.rates,
        strategy.syncs_per_h,
        strategy.agreed_step_seconds,
        strategy.agreed_sync_seconds,
    )


@pytest.mark.slow
def test_cocodc_choices_identical_on_workers_with_measured_times() -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_cocodc_worker, 2, (60,))
    (chosen_a, rates_a, n_a, tc_a, ts_a), (chosen_b, rates_b, n_b, tc_b, ts_b) = results
    assert chosen_a == chosen_b and rates_a == rates_b and n_a == n_b
    assert (tc_a, ts_a) == (tc_b, ts_b)
    # T_c: mean of the declared per-step costs 0.05 and 0.10 s (an EMA of constants).
    assert tc_a == pytest.approx(0.075, rel=1e-4)
    assert ts_a > 0.02  # at least the wan latency of a 2-worker all-reduce (2 x 10 ms)
    assert n_a == syncs_per_period(4, 1.0, 40, tc_a, ts_a) and n_a > 4


def test_the_timings_a_sharded_workers_ranks_average_are_made_on_the_groups_device() -> None:
    """A sharded worker's ranks average [T_c, T_s] over the worker's group before a launch:
    the tensor must be made on the group's device (NCCL refuses a host tensor). The group is
    a recording one declaring ``meta`` as its device, and the flat buffer says it lives there
    (a stand-in for a GPU on a machine without one)."""
    from lowcomm.comm.base import Role
    from lowcomm.comm.fake import RecordingComm

    meta = torch.device("meta")
    ranks = RecordingComm(world_size=2, device=meta)
    context = StrategyContext(
        optim=AdamWConfig(lr=3e-3),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0),
        total_steps=12,
        max_grad_norm=None,
    )
    strategy = CoCoDC(
        _model(), LocalComm(), context, DiLoCoOptions(sync_every=12, fragments=4, overlap_steps=2)
    )
    averaged: list[torch.Tensor] = []

    def average_over_ranks(tensor: torch.Tensor) -> None:
        ranks.all_reduce(tensor, op="mean", role=Role.OTHER).wait()
        averaged.append(tensor)

    strategy.flat.device = meta
    strategy.flat.average_over_ranks = average_over_ranks  # type: ignore[attr-defined]
    launched: list[torch.Tensor | None] = []
    strategy.launch_sync = lambda p, extras=None: launched.append(extras)  # type: ignore[assignment, method-assign, misc, return-value]
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(3)])
    for _ in range(3):  # the first launch is at step 3 (h = H / K)
        strategy.step(closure)
    assert len(averaged) == 1 and averaged[0].device == meta and averaged[0].shape == (2,)
    assert launched[0] is averaged[0]  # the averaged timings ride along the exchange
    assert ranks.calls[0].numel == 2
