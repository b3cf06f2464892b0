"""Decoupled DiLoCo's synchronizer merge (docs/ALGORITHMS.md, "Decoupled DiLoCo") against a
few lines written from its rules: the token weights, the minimum quorum, the grace window
(fixed and adaptive), a straggler past the window and its late fragment, and the reduction to
DiLoCo's mean and outer Nesterov step."""

from __future__ import annotations

import re

import pytest
import torch

from lowcomm.optim.outer import OuterNesterov
from lowcomm.strategies.decoupled_sync import (
    Contribution,
    FragmentSynchronizer,
    GraceRule,
    decide_merge,
    merged_outer_gradient,
    token_weight,
)

N = 8  # fragment length


def _delta(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def _c(
    learner: int, arrival: float, *, tokens: int = 64, steps: int = 4, base: int = 0
) -> Contribution:
    return Contribution(
        learner=learner,
        outer_gradient=_delta(100 * base + learner),
        tokens=tokens,
        steps=steps,
        arrival=arrival,
        base_version=base,
    )


def _sync(**kwargs: object) -> FragmentSynchronizer:
    theta = torch.randn(N, generator=torch.Generator().manual_seed(7))
    options: dict[str, object] = {"lr": 1.0, "momentum": 0.0}
    options.update(kwargs)
    return FragmentSynchronizer(theta, **options)  # type: ignore[arg-type]


def test_token_weight_is_tokens_times_tokens_per_step() -> None:
    # w = c_tok * (c_tok / c_steps)
    assert token_weight(100, 10) == 100 * (100 / 10)
    assert token_weight(96, 4) == 96 * 24
    assert token_weight(100, 10, "tokens") == 100.0
    assert token_weight(100, 10, "equal") == 1.0
    with pytest.raises(ValueError, match="steps: 0 must be at least 1"):
        token_weight(100, 0)
    with pytest.raises(ValueError, match="weighting: 'bogus' is unknown"):
        token_weight(100, 1, "bogus")  # type: ignore[arg-type]


def test_no_merge_below_the_minimum_quorum() -> None:
    sync = _sync(min_quorum=3, grace=GraceRule("none"))
    before = sync.params.clone()
    assert sync.submit(_c(0, 0.0)) == "fresh"
    assert sync.submit(_c(1, 0.1)) == "fresh"
    assert sync.decide(live=range(4), step_time=1.0, sync_time=0.0) is None
    assert sync.merge(live=range(4), step_time=1.0, sync_time=0.0, now=100.0) is None
    assert torch.equal(sync.params, before) and sync.version == 0
    sync.submit(_c(2, 0.2))
    result = sync.merge(live=range(4), step_time=1.0, sync_time=0.0, now=0.2)
    assert result is not None and sync.version == 1
    # No grace window: merge at the quorum's arrival, with the three that are in.
    assert result.decision.merge_time == 0.2
    assert [c.learner for c in result.decision.included] == [0, 1, 2]


def test_grace_window_waits_for_more_up_to_the_window() -> None:
    fixed = GraceRule("fixed", cap=1.0)
    arrivals = [0.0, 0.5, 0.9, 1.5]
    fresh = [_c(m, a) for m, a in enumerate(arrivals)]
    decision = decide_merge(
        fresh, min_quorum=1, live=range(5), grace=fixed, step_time=1.0, sync_time=0.0
    )
    assert decision is not None
    # t_q = a_1 = 0; t_merge = t_q + 1.0; in: arrivals <= 1.0; the one at 1.5 is left out.
    assert decision.merge_time == 1.0 and decision.window == 1.0
    assert [c.learner for c in decision.included] == [0, 1, 2]
    assert [c.learner for c in decision.left_out] == [3]
    # Once every live learner is in, nobody is left to wait for: t_merge = a_L.
    cut = decide_merge(
        fresh[:3], min_quorum=1, live=range(3), grace=fixed, step_time=1.0, sync_time=0.0
    )
    assert cut is not None and cut.merge_time == 0.9 and not cut.left_out
    # "Every live learner" is by id: a fragment sent before its learner crashed does not
    # stand in for a live learner still computing.
    dead = decide_merge(
        [_c(0, 0.0), _c(2, 0.1)],
        min_quorum=1,
        live={0, 1},
        grace=fixed,
        step_time=1.0,
        sync_time=0.0,
    )
    assert dead is not None and dead.merge_time == 1.0
    # Arrivals at the quorum's instant are in whatever the quorum (learners in lock-step).
    tied = [_c(m, 2.0) for m in range(4)]
    none = decide_merge(
        tied, min_quorum=1, live=range(6), grace=GraceRule("none"), step_time=1.0, sync_time=0.0
    )
    assert none is not None and len(none.included) == 4 and none.merge_time == 2.0


def test_adaptive_window_is_gamma_times_the_slack_clamped() -> None:
    rule = GraceRule("adaptive", gamma=0.5, overlap_steps=4)
    # xi_grace = max(0, gamma * (tau * xi_step - xi_quorum - xi_sync))
    assert rule.window(step_time=1.0, quorum_wait=0.5, sync_time=0.5) == 0.5 * (4 - 0.5 - 0.5)
    assert rule.window(step_time=0.1, quorum_wait=0.5, sync_time=0.5) == 0.0
    capped = GraceRule("adaptive", gamma=0.5, overlap_steps=4, cap=0.25)
    assert capped.window(step_time=1.0, quorum_wait=0.5, sync_time=0.5) == 0.25
    # xi_quorum is measured from the first fresh arrival to the quorum's: here 1.0 - 0.25.
    fresh = [_c(0, 0.25), _c(1, 1.0), _c(2, 2.0), _c(3, 3.0)]
    decision = decide_merge(
        fresh, min_quorum=2, live=range(4), grace=rule, step_time=1.0, sync_time=0.5
    )
    assert decision is not None
    window = 0.5 * (4 * 1.0 - 0.75 - 0.5)
    assert decision.window == window and decision.merge_time == 1.0 + window
    assert [c.learner for c in decision.included] == [0, 1, 2]
    # The window adapts: a slower quorum leaves less of the slack.
    slow = decide_merge(
        [_c(0, 0.0), _c(1, 2.0)],
        min_quorum=2,
        live=range(4),
        grace=rule,
        step_time=1.0,
        sync_time=0.5,
    )
    assert slow is not None and slow.window == 0.5 * (4 - 2.0 - 0.5) < window


def test_merge_weights_learners_by_tokens() -> None:
    sync = _sync(lr=0.7, min_quorum=3, grace=GraceRule("none"))
    theta0 = sync.params.clone()
    counts = [(64, 4), (32, 4), (48, 2)]  # (tokens, steps): full batch, half batch, slower
    fresh = [_c(m, 0.0, tokens=t, steps=s) for m, (t, s) in enumerate(counts)]
    for c in fresh:
        sync.submit(c)
    result = sync.merge(live=range(3), step_time=1.0, sync_time=0.0)
    assert result is not None
    w = [t * t / s for t, s in counts]
    expected = sum(wi * c.outer_gradient for wi, c in zip(w, fresh, strict=True)) / sum(w)
    assert isinstance(expected, torch.Tensor)
    torch.testing.assert_close(result.outer_gradient, expected, rtol=1e-6, atol=1e-7)
    assert result.decision.weights == pytest.approx([wi / sum(w) for wi in w])
    # No momentum: Theta <- Theta - eta_out * Delta.
    torch.testing.assert_close(sync.params, theta0 - 0.7 * expected, rtol=1e-6, atol=1e-7)
    assert result.committed_tokens == 64 + 32 + 48


def test_straggler_past_the_window_is_left_out_and_merged_into_the_next_merge() -> None:
    sync = _sync(min_quorum=1, grace=GraceRule("fixed", cap=1.0), late="next")
    theta0 = sync.params.clone()
    a, b = _c(0, 0.0), _c(1, 0.5)
    sync.submit(a)
    sync.submit(b)
    assert sync.merge(live=range(3), step_time=1.0, sync_time=0.0, now=0.9) is None  # inside window
    first = sync.merge(live=range(3), step_time=1.0, sync_time=0.0, now=1.0)
    assert first is not None and sync.version == 1
    theta1 = theta0 - (a.outer_gradient + b.outer_gradient) / 2  # equal tokens, eta_out 1
    torch.testing.assert_close(sync.params, theta1)
    # The straggler's fragment arrives after the merge, still on version 0: it is late.
    straggler = _c(2, 5.0, tokens=96, steps=4, base=0)
    assert sync.submit(straggler) == "late"
    torch.testing.assert_close(sync.params, theta1)  # an applied merge is never redone
    # A late fragment alone does not make a quorum.
    assert sync.decide(live=range(3), step_time=1.0, sync_time=0.0) is None
    fresh = _c(0, 10.0, tokens=64, steps=4, base=1)
    sync.submit(fresh)
    second = sync.merge(live=range(3), step_time=1.0, sync_time=0.0, now=11.0)
    assert second is not None and sync.version == 2
    assert [c.learner for c in second.decision.included] == [0, 2]
    w_fresh, w_late = 64 * 64 / 4, 96 * 96 / 4
    delta = (w_fresh * fresh.outer_gradient + w_late * straggler.outer_gradient) / (
        w_fresh + w_late
    )
    torch.testing.assert_close(sync.params, theta1 - delta, rtol=1e-6, atol=1e-7)
    assert second.committed_tokens == 64 + 96 and second.dropped == ()


def test_fresh_arrivals_after_the_merge_time_become_late() -> None:
    # On a modeled clock the caller may know later arrivals already: they are left out of
    # this merge and handled by the late rule.
    for late, kept in (("next", True), ("drop", False)):
        sync = _sync(min_quorum=1, grace=GraceRule("fixed", cap=1.0), late=late)
        for c in (_c(0, 0.0), _c(1, 0.5), _c(2, 5.0)):
            sync.submit(c)
        result = sync.merge(live=range(3), step_time=1.0, sync_time=0.0)
        assert result is not None
        assert [c.learner for c in result.decision.left_out] == [2]
        assert [c.learner for c in sync.carried] == ([2] if kept else [])
        assert [c.learner for c in result.dropped] == ([] if kept else [2])
        assert result.committed_tokens == 2 * 64


def test_drop_policy_discards_a_late_fragment_and_does_not_commit_its_tokens() -> None:
    sync = _sync(min_quorum=1, grace=GraceRule("none"), late="drop")
    sync.submit(_c(0, 0.0))
    assert sync.merge(live=range(2), step_time=1.0, sync_time=0.0, now=0.0) is not None
    theta1 = sync.params.clone()
    assert sync.submit(_c(1, 3.0, base=0)) == "dropped"
    fresh = _c(0, 4.0, base=1)
    sync.submit(fresh)
    result = sync.merge(live=range(2), step_time=1.0, sync_time=0.0, now=4.0)
    assert result is not None
    assert [c.learner for c in result.decision.included] == [0]
    assert [c.learner for c in result.dropped] == [1]
    assert result.committed_tokens == 64
    torch.testing.assert_close(sync.params, theta1 - fresh.outer_gradient)


@pytest.mark.parametrize("nesterov", [True, False])
def test_equal_tokens_and_a_quorum_of_all_is_diloco_mean_and_outer_step(nesterov: bool) -> None:
    """K_q = M, no grace window, equal tokens: every round merges the plain mean of the M
    outer gradients and takes DiLoCo's outer step, bit for bit."""
    workers, lr, mu = 4, 0.7, 0.9
    theta0 = torch.randn(N, generator=torch.Generator().manual_seed(3))
    sync = FragmentSynchronizer(
        theta0.clone(),
        lr=lr,
        momentum=mu,
        nesterov=nesterov,
        min_quorum=workers,
        grace=GraceRule("none"),
    )
    # DiLoCo's outer optimizer as diloco builds it, fed the in-process all-reduce's mean.
    diloco = OuterNesterov(theta0.clone(), lr=lr, momentum=mu, nesterov=nesterov)
    # The lines of docs/ALGORITHMS.md §0.3: b <- mu b + Delta; theta <- theta - lr (Delta + mu b).
    theta, buf = theta0.clone(), torch.zeros(N)
    for version in range(3):
        fresh = [_c(m, float(version), base=version) for m in range(workers)]
        for c in fresh:
            sync.submit(c)
        assert sync.decide(live=range(workers), step_time=1.0, sync_time=0.0) is not None
        result = sync.merge(live=range(workers), step_time=1.0, sync_time=0.0)
        assert result is not None and len(result.decision.included) == workers
        mean = fresh[0].outer_gradient.clone()
        for c in fresh[1:]:
            mean.add_(c.outer_gradient)
        mean.div_(workers)
        assert torch.equal(result.outer_gradient, mean)
        diloco.step(mean)
        assert torch.equal(sync.params, diloco.params)
        assert torch.equal(sync.outer.momentum_buffer, diloco.momentum_buffer)
        delta = torch.stack([c.outer_gradient for c in fresh]).mean(0)
        buf = mu * buf + delta
        theta = theta - lr * ((delta + mu * buf) if nesterov else buf)
        torch.testing.assert_close(sync.params, theta, rtol=1e-6, atol=1e-6)


def test_bad_input_names_the_field_and_the_rule() -> None:
    with pytest.raises(ValueError, match=re.escape("--decoupled.grace-seconds: None")):
        GraceRule("fixed")
    with pytest.raises(
        ValueError, match=re.escape("--decoupled.grace-gamma: 1.0 must lie in [0, 1)")
    ):
        GraceRule(gamma=1.0)
    with pytest.raises(ValueError, match=re.escape("--decoupled.min-quorum: 0 must be at least 1")):
        _sync(min_quorum=0)
    with pytest.raises(ValueError, match=re.escape("--decoupled.late: 'later' is unknown")):
        _sync(late="later")
    sync = _sync()
    with pytest.raises(ValueError, match="base version 1 is ahead of the fragment's 0"):
        sync.submit(_c(0, 0.0, base=1))
    with pytest.raises(ValueError, match="a learner appears twice"):
        decide_merge(
            [_c(0, 0.0), _c(0, 1.0)],
            min_quorum=1,
            live=range(2),
            grace=GraceRule("none"),
            step_time=1.0,
            sync_time=0.0,
        )
    with pytest.raises(ValueError, match="need at least one"):
        merged_outer_gradient([], [])
