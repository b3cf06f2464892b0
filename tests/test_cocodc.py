"""CoCoDC (docs/ALGORITHMS.md §4.5): compensated merge, fragment selection, adaptive transmission."""

from __future__ import annotations

import math

import pytest
import torch

from _dist import global_batch
from lowcomm.comm import LocalComm
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.strategies import MicroBatchResult, StrategyContext
from lowcomm.strategies.cocodc import CoCoDC, compensated_merge, select_fragment, syncs_per_period
from lowcomm.strategies.diloco import DiLoCoOptions


def test_merge_with_lambda_zero_is_new_global_plus_overlap_progress() -> None:
    torch.manual_seed(0)
    new_global, at_launch, now = torch.randn(10), torch.randn(10), torch.randn(10)
    merged = compensated_merge(new_global, at_launch, now, overlap_steps=5, compensation=0.0, sync_every=50)
    assert torch.allclose(merged, new_global + (now - at_launch), atol=1e-6)
    # The literal printed sign moves against the local progress.
    literal = compensated_merge(new_global, at_launch, now, overlap_steps=5, compensation=0.0, sync_every=50, sign="literal")
    assert torch.allclose(literal, new_global - (now - at_launch), atol=1e-6)


def test_merge_extra_term_follows_the_formula() -> None:
    torch.manual_seed(1)
    new_global, at_launch, now = torch.randn(10), torch.randn(10), torch.randn(10)
    tau, lam, horizon = 4, 0.5, 20
    merged = compensated_merge(new_global, at_launch, now, overlap_steps=tau, compensation=lam, sync_every=horizon)
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
    context = StrategyContext(optim=AdamWConfig(lr=3e-3), schedule=ScheduleConfig(kind="constant", warmup_steps=0), total_steps=24, max_grad_norm=None)
    strategy = CoCoDC(_model(), LocalComm(), context, DiLoCoOptions(sync_every=12, fragments=4, overlap_steps=2))
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
    strategy = CoCoDC(_model(), comm, context, DiLoCoOptions(sync_every=40, fragments=4, overlap_steps=2, transmission_gamma=1.0))
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
    return chosen, strategy.rates, strategy.syncs_per_h, strategy.agreed_step_seconds, strategy.agreed_sync_seconds


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
