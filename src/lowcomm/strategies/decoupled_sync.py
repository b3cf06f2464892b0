"""Decoupled DiLoCo's synchronizer merge for one fragment (docs/ALGORITHMS.md, "Decoupled
DiLoCo", reconstructed): pure tensors, no communicator, no clock.

Learners send a fragment's outer gradient with their counters; the synchronizer merges once a
minimum quorum is in, waits a grace window for more, weights each learner by its tokens and
applies the fragment's outer Nesterov step. Symbols (the paper writes K for the quorum; lowcomm
keeps K for fragments)::

    K_q                   min_quorum: fresh contributions needed before any merge
    c^tok, c^steps        Contribution.tokens, Contribution.steps (since the learner last sent)
    w = c_tok^2 / c_steps token_weight(..., "paper"): quantity x tokens per step
    Delta_{m,p}           Contribution.outer_gradient = Theta_p^(b) - theta_{m,p}
    b, v                  Contribution.base_version, FragmentSynchronizer.version
    xi_step, xi_quorum,   GraceRule.window arguments: inner-step time, quorum wait, merge +
    xi_sync               return transfer
    gamma, tau            GraceRule.gamma, GraceRule.overlap_steps

    t_q     = arrival of the K_q-th fresh contribution
    xi_grace = GraceRule.window(xi_step, t_q - a_1, xi_sync)
    t_merge = min(t_q + xi_grace, arrival of the last live learner)  (once all live are in)
    S       = fresh arrived by t_merge + late ones carried from the previous merge
    Delta_p = sum_S w_m Delta_m / sum_S w_m;   Theta_p <- OuterNesterov_p(Theta_p, Delta_p)

A contribution is fresh when its base is the current version and late when older; late ones go
to the next merge (``late="next"``, not counted toward its quorum) or are dropped
(``late="drop"``). Times are seconds on whatever clock the caller runs; the module only
compares and subtracts them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lowcomm.optim.outer import OuterNesterov

Weighting = Literal["paper", "tokens", "equal"]
GraceKind = Literal["adaptive", "fixed", "none"]
LatePolicy = Literal["next", "drop"]

WEIGHTINGS: tuple[Weighting, ...] = ("paper", "tokens", "equal")
GRACE_KINDS: tuple[GraceKind, ...] = ("adaptive", "fixed", "none")
LATE_POLICIES: tuple[LatePolicy, ...] = ("next", "drop")


@dataclass(frozen=True)
class Contribution:
    """One learner's fragment as it reaches the synchronizer.

    Attributes:
        learner: the learner's id m.
        outer_gradient: Delta_{m,p} = Theta_p^(b) - theta_{m,p}, 1-D, the fragment's length.
        tokens: c^tok, tokens the learner trained on since it last sent this fragment.
        steps: c^steps, its inner steps over the same span (at least 1).
        arrival: when it reached the synchronizer, in seconds on the caller's clock.
        base_version: b, the version of Theta_p the learner last took (Delta is against it).
    """

    learner: int
    outer_gradient: torch.Tensor
    tokens: int
    steps: int
    arrival: float
    base_version: int


def token_weight(tokens: int, steps: int, weighting: Weighting = "paper") -> float:
    """A contribution's unnormalised weight w.

    ``paper``: c_tok * (c_tok / c_steps), the tokens times the tokens per step (each step's
    batch: a learner that lost chips runs smaller, noisier batches). ``tokens``: c_tok.
    ``equal``: 1.
    """
    if steps < 1:
        raise ValueError(
            f"contribution steps: {steps} must be at least 1; a learner sends a fragment "
            "only after an inner step"
        )
    if tokens < 0:
        raise ValueError(f"contribution tokens: {tokens} must be non-negative")
    if weighting == "paper":
        return float(tokens) * (float(tokens) / float(steps))
    if weighting == "tokens":
        return float(tokens)
    if weighting == "equal":
        return 1.0
    raise ValueError(f"weighting: {weighting!r} is unknown; choose one of {', '.join(WEIGHTINGS)}")


@dataclass(frozen=True)
class GraceRule:
    """How long the synchronizer waits for more contributions once the quorum is in.

    ``adaptive`` (the paper's Eq. 3): xi_grace = max(0, gamma (tau xi_step - xi_quorum -
    xi_sync)), at most ``cap`` seconds when a cap is set: the learner that sent first keeps
    computing tau steps before it needs the fragment back, and the window spends at most the
    share gamma of what the quorum and the merge left of that time. ``fixed``: ``cap``
    seconds. ``none``: 0, merge as soon as the quorum is in.

    Attributes:
        kind: adaptive, fixed or none.
        gamma: the safety share gamma, in [0, 1).
        overlap_steps: tau, the inner steps a learner computes between sending and needing
            the reply.
        cap: seconds; the fixed window, or the adaptive window's upper bound (None: none).
    """

    kind: GraceKind = "adaptive"
    gamma: float = 0.5
    overlap_steps: int = 1
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRACE_KINDS:
            raise ValueError(
                f"--decoupled.grace: {self.kind!r} is unknown; choose one of "
                f"{', '.join(GRACE_KINDS)}"
            )
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(
                f"--decoupled.grace-gamma: {self.gamma} must lie in [0, 1) so the window "
                "leaves a margin inside the slack; try 0.5"
            )
        if self.overlap_steps < 0:
            raise ValueError(
                f"--diloco.overlap-steps: {self.overlap_steps} must be non-negative; try 1"
            )
        if self.cap is not None and not (self.cap >= 0 and math.isfinite(self.cap)):
            raise ValueError(
                f"--decoupled.grace-seconds: {self.cap} must be a finite non-negative number "
                "of seconds, or None"
            )
        if self.kind == "fixed" and self.cap is None:
            raise ValueError(
                "--decoupled.grace-seconds: None, but --decoupled.grace fixed needs the "
                "window's length; give it in seconds, e.g. 0.5"
            )

    def window(self, *, step_time: float, quorum_wait: float, sync_time: float) -> float:
        """xi_grace in seconds, from xi_step, xi_quorum and xi_sync."""
        if self.kind == "none":
            return 0.0
        if self.kind == "fixed":
            assert self.cap is not None  # checked in __post_init__
            return self.cap
        slack = self.overlap_steps * step_time - (quorum_wait + sync_time)
        grace = max(0.0, self.gamma * slack)
        return grace if self.cap is None else min(grace, self.cap)


@dataclass(frozen=True)
class MergeDecision:
    """When a fragment merges and with whom.

    Attributes:
        merge_time: t_merge, seconds on the caller's clock.
        window: xi_grace granted after the quorum.
        included: the contributions merged: the fresh ones in by t_merge (arrival order),
            then the carried late ones.
        weights: their normalised weights, aligned with ``included`` (sum 1).
        left_out: fresh contributions that arrived after t_merge; they become late.
    """

    merge_time: float
    window: float
    included: tuple[Contribution, ...]
    weights: tuple[float, ...]
    left_out: tuple[Contribution, ...]


def decide_merge(
    fresh: Sequence[Contribution],
    *,
    carried: Sequence[Contribution] = (),
    min_quorum: int,
    live: Collection[int],
    grace: GraceRule,
    step_time: float,
    sync_time: float,
    weighting: Weighting = "paper",
) -> MergeDecision | None:
    """The merge of one fragment's round, or None while fewer than ``min_quorum`` fresh
    contributions are in.

    ``fresh`` are the contributions on the current version known so far (a caller on a real
    clock passes those arrived; one on a modeled clock may pass later arrivals too, which
    land in ``left_out``). ``carried`` are late ones merged here without counting toward the
    quorum. ``live`` are the ids of the live learners: once each has a fresh contribution in,
    nobody is left to wait for. Arrivals at the quorum's instant are in, whatever ``min_quorum``.
    """
    if min_quorum < 1:
        raise ValueError(
            f"--decoupled.min-quorum: {min_quorum} must be at least 1; 1 merges as soon as "
            "any learner's fragment is in"
        )
    ordered = sorted(fresh, key=lambda c: c.arrival)
    if len({c.learner for c in ordered}) != len(ordered):
        raise ValueError(
            "fresh contributions: a learner appears twice on one version; a learner sends a "
            "fragment again only after it took the reply to its previous send"
        )
    if len(ordered) < min_quorum:
        return None
    quorum_time = ordered[min_quorum - 1].arrival
    window = grace.window(
        step_time=step_time, quorum_wait=quorum_time - ordered[0].arrival, sync_time=sync_time
    )
    merge_time = quorum_time + window
    live_in = [c.arrival for c in ordered if c.learner in live]
    if live and len(live_in) == len(set(live)):
        # Every live learner is in: waiting longer cannot bring anyone else.
        merge_time = min(merge_time, max(quorum_time, max(live_in)))
    included = tuple(c for c in ordered if c.arrival <= merge_time) + tuple(carried)
    left_out = tuple(c for c in ordered if c.arrival > merge_time)
    raw = [token_weight(c.tokens, c.steps, weighting) for c in included]
    total = sum(raw)
    if total <= 0.0:
        # Only zero-token contributions: nothing to prefer, weigh them alike.
        raw = [1.0] * len(included)
        total = float(len(included))
    return MergeDecision(
        merge_time=merge_time,
        window=window,
        included=included,
        weights=tuple(w / total for w in raw),
        left_out=left_out,
    )


def merged_outer_gradient(
    contributions: Sequence[Contribution], weights: Sequence[float]
) -> torch.Tensor:
    """Delta_p = sum_m w_m Delta_m / sum_m w_m, in fp32.

    Equal weights take the plain mean, summed in the given order and divided by the count, as
    the in-process all-reduce computes it: that is what makes the reduction to diloco exact.
    """
    if not contributions or len(contributions) != len(weights):
        raise ValueError(
            f"merge: {len(contributions)} contributions and {len(weights)} weights; need at "
            "least one and one weight each"
        )
    if all(w == weights[0] for w in weights):
        total = contributions[0].outer_gradient.float().clone()
        for c in contributions[1:]:
            total.add_(c.outer_gradient.float())
        return total.div_(len(contributions))
    weight_sum = float(sum(weights))
    total = torch.zeros_like(contributions[0].outer_gradient, dtype=torch.float32)
    for c, w in zip(contributions, weights, strict=True):
        total.add_(c.outer_gradient.float(), alpha=w / weight_sum)
    return total


@dataclass(frozen=True)
class MergeResult:
    """One applied merge.

    Attributes:
        version: the fragment's new version v + 1.
        decision: who was merged, when, with which weights.
        outer_gradient: the merged Delta_p the outer step took.
        committed_tokens: the tokens of the merged contributions.
        dropped: late contributions discarded since the previous merge, this merge's
            stragglers included (``late="drop"``); their tokens are not committed.
    """

    version: int
    decision: MergeDecision
    outer_gradient: torch.Tensor
    committed_tokens: int
    dropped: tuple[Contribution, ...]


class FragmentSynchronizer:
    """The synchronizer's state for one fragment p: Theta_p, its outer optimizer, the version
    v, the fresh contributions of this round and the late ones carried to the next merge.

    Args:
        params: Theta_p, 1-D float32, updated in place by the outer step.
        lr, momentum, nesterov: the outer Nesterov step (``lowcomm.optim.outer``, §0.3).
        min_quorum: K_q.
        grace: the grace-window rule.
        weighting: the token weighting.
        late: what a late contribution does: ``next`` (merged into the next merge) or
            ``drop``.
    """

    def __init__(
        self,
        params: torch.Tensor,
        *,
        lr: float,
        momentum: float,
        nesterov: bool = True,
        min_quorum: int = 1,
        grace: GraceRule | None = None,
        weighting: Weighting = "paper",
        late: LatePolicy = "next",
    ) -> None:
        if min_quorum < 1:
            raise ValueError(
                f"--decoupled.min-quorum: {min_quorum} must be at least 1; 1 merges as soon "
                "as any learner's fragment is in"
            )
        if weighting not in WEIGHTINGS:
            raise ValueError(
                f"--decoupled.weighting: {weighting!r} is unknown; choose one of "
                f"{', '.join(WEIGHTINGS)}"
            )
        if late not in LATE_POLICIES:
            raise ValueError(
                f"--decoupled.late: {late!r} is unknown; choose one of {', '.join(LATE_POLICIES)}"
            )
        self.params = params
        self.outer = OuterNesterov(params, lr=lr, momentum=momentum, nesterov=nesterov)
        self.min_quorum = min_quorum
        self.grace = grace if grace is not None else GraceRule()
        self.weighting: Weighting = weighting
        self.late: LatePolicy = late
        self.version = 0
        self.fresh: list[Contribution] = []
        self.carried: list[Contribution] = []
        self.dropped: list[Contribution] = []

    def submit(self, contribution: Contribution) -> Literal["fresh", "late", "dropped"]:
        """Take a contribution in: fresh on the current version, otherwise late (carried to
        the next merge, or dropped)."""
        if contribution.outer_gradient.shape != self.params.shape:
            raise ValueError(
                f"contribution of learner {contribution.learner}: outer gradient of shape "
                f"{tuple(contribution.outer_gradient.shape)}, the fragment has "
                f"{tuple(self.params.shape)}"
            )
        if contribution.base_version > self.version:
            raise ValueError(
                f"contribution of learner {contribution.learner}: base version "
                f"{contribution.base_version} is ahead of the fragment's {self.version}; a "
                "learner can only have taken a version the synchronizer made"
            )
        if contribution.base_version == self.version:
            self.fresh.append(contribution)
            return "fresh"
        return self._late(contribution)

    def _late(self, contribution: Contribution) -> Literal["late", "dropped"]:
        if self.late == "next":
            self.carried.append(contribution)
            return "late"
        self.dropped.append(contribution)
        return "dropped"

    def decide(
        self, *, live: Collection[int], step_time: float, sync_time: float
    ) -> MergeDecision | None:
        """The pending merge (:func:`decide_merge`) of the contributions submitted so far."""
        return decide_merge(
            self.fresh,
            carried=self.carried,
            min_quorum=self.min_quorum,
            live=live,
            grace=self.grace,
            step_time=step_time,
            sync_time=sync_time,
            weighting=self.weighting,
        )

    def merge(
        self,
        *,
        live: Collection[int],
        step_time: float,
        sync_time: float,
        now: float | None = None,
    ) -> MergeResult | None:
        """Apply the merge if it is due: the quorum is in and, when ``now`` is given, the clock
        has reached t_merge. Fresh contributions that arrived after t_merge become late."""
        decision = self.decide(live=live, step_time=step_time, sync_time=sync_time)
        if decision is None or (now is not None and now < decision.merge_time):
            return None
        delta = merged_outer_gradient(decision.included, decision.weights)
        self.outer.step(delta)
        self.version += 1
        self.fresh = []
        self.carried = []
        for contribution in decision.left_out:
            self._late(contribution)
        dropped = tuple(self.dropped)
        self.dropped = []
        return MergeResult(
            version=self.version,
            decision=decision,
            outer_gradient=delta,
            committed_tokens=sum(c.tokens for c in decision.included),
            dropped=dropped,
        )
