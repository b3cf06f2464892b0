"""Local-update family: Local SGD / Local AdamW, Overlap-Local-SGD, SlowMo and CO2.

docs/ALGORITHMS.md §3.1-3.4. Every worker takes ``tau`` (``--local.sync-every``) inner optimizer
steps on its own data with its own, persistent inner optimizer state (never averaged), then
the workers' parameters are combined:

* ``local_sgd`` / ``local_adamw`` (§3.1, Stich 2019): a blocking all-reduce (mean) of the
  parameters every ``tau`` steps.
* ``overlap_local_sgd`` (§3.2, Wang, Liang & Joshi 2020): at a boundary the local model is
  pulled toward the stale anchor ``z`` (``x <- x - alpha (x - z)``, alpha = ``--local.pull``)
  and a non-blocking all-reduce of it starts; its result is the anchor of the next boundary,
  so the transfer overlaps the next ``tau`` local steps.
* ``slowmo`` (§3.3, Wang et al. 2020): blocking average, then slow momentum
  ``u <- beta u + (x_anchor - x_avg) / gamma``, ``x_anchor <- x_anchor - alpha gamma u``.
* ``co2`` (§3.4, Sun et al., ICLR 2024, Alg. 1): the round's outer gradient goes through an
  asynchronous all-reduce that overlaps the whole next round; the outer momentum is one round
  stale, divided element-wise by the staleness gap penalty Lambda, and the applied outer step
  is clipped coordinate-wise at phi.

Every method stands on :class:`~lowcomm.strategies.local_update.LocalUpdate` and writes its
own ``step()`` in the order of its paper. One ``step()`` call is one inner step;
``extras["synced"] = 1.0`` marks the step that ended a round (and ``extras["outer_step"] =
1.0`` one that moved the anchor).

Communication is only through ``self.comm``; role ``parameter`` for parameter averages,
``pseudo_gradient`` for CO2's outer gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lowcomm.comm.base import Comm, Handle, Role
from lowcomm.comm.runtime import pending_state
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, Transfer
from lowcomm.strategies.local_update import InnerOptimizerKind, LocalUpdate, RoundOptions
from lowcomm.strategies.sharded_flat import whole_mean


@dataclass(kw_only=True)
class LocalOptions(RoundOptions):
    """Options of local_sgd, local_adamw, overlap_local_sgd, slowmo and co2."""

    group: ClassVar[str] = "local"
    # An outer step of 0 would leave slowmo's and co2's anchor at the initial model forever.
    zero_outer_lr: ClassVar[bool] = False

    sync_every: int = 6
    """tau: inner (local) steps per round; the parameters are combined after each round."""

    inner_optimizer: Literal["adamw", "sgd"] = "adamw"
    """Inner optimizer of overlap_local_sgd, slowmo and co2: adamw (--optim.*) or sgd
    (--optim.lr, --optim.weight-decay, --local.sgd-momentum). local_sgd always uses sgd and
    local_adamw always adamw."""

    outer_lr: float = 1.0
    """slowmo and co2: alpha, the outer learning rate."""

    outer_momentum: float = 0.5
    """slowmo and co2: beta, the outer (slow) momentum factor, in [0, 1)."""

    outer_nesterov: bool = False
    """slowmo and co2 take only False: their papers' slow momentum is heavy ball."""

    pull: float = 0.5
    """overlap_local_sgd: alpha, the pull toward the stale anchor at each boundary, in (0, 1]."""

    gap_penalty: bool = True
    """co2: divide the outer gradient element-wise by the staleness gap penalty Lambda."""

    penalty_epsilon: float = 1e-12
    """co2: epsilon in Lambda's denominator tau |d| + epsilon (guards d = 0)."""

    clip: bool = True
    """co2: clip the outer momentum coordinate-wise at --local.clip-threshold before applying it."""

    clip_threshold: float = 1.0
    """co2: phi, the coordinate-wise clipping threshold (inf disables clipping too)."""

    shared_displacement: bool = True
    """co2: send the first inner-step displacement d in the same all-reduce (2x payload) so
    every worker computes the same Lambda and all anchors stay identical; False uses the local
    d (half the bytes, anchors may drift apart slowly)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.pull <= 1.0:
            raise ValueError(
                f"--local.pull: {self.pull} must lie in (0, 1]; it is the fraction of the way to "
                f"the anchor, try 0.5"
            )
        if not (self.penalty_epsilon > 0 and math.isfinite(self.penalty_epsilon)):
            raise ValueError(
                f"--local.penalty-epsilon: {self.penalty_epsilon} must be a finite positive "
                f"number; try 1e-12"
            )
        if math.isnan(self.clip_threshold) or not self.clip_threshold > 0:
            raise ValueError(
                f"--local.clip-threshold: {self.clip_threshold} must be positive (inf allowed); "
                f"try 1.0, or pass --local.clip False to disable clipping"
            )


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _LocalFamily(LocalUpdate[LocalOptions]):
    """The declarations and checkpoint of the five local methods.

    Elastic resume (``--resume DIR --workers M2``): replicated state (anchor, outer momentum,
    settled exchange results) is kept exactly; per-worker state (local parameters, inner
    optimizer states, displacements) is averaged over the old workers, so the next averaging
    step sees the same mean.
    """

    options_field: ClassVar[str | None] = "local"
    quick_options: ClassVar[Mapping[str, object]] = {"sync_every": 2}

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: LocalOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options or LocalOptions())
        self.tau = self.options.sync_every

    def round_due(self, stats: StepStats) -> bool:
        """Whether this inner step ends a round (marked ``synced`` in the step's extras)."""
        due = self.local_steps == self.tau
        stats.extras["synced"] = 1.0 if due else 0.0
        return due

    def average(self) -> None:
        """A blocking mean all-reduce of the local parameters (launched and finished at once)."""
        self.runtime.enter_round()  # (a member lost since the last round: its detection)
        self.comm.all_reduce(self.flat.params, op="mean", role=Role.PARAMETER).wait()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "inner_kind": self.inner_kind,
            "params": self.flat.params.clone(),
            "local_steps": self.local_steps,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["inner_kind"] != self.inner_kind:
            raise ValueError(
                f"checkpoint holds a {state['inner_kind']} inner optimizer but this run uses "
                f"{self.inner_kind}; resume with the same --local.inner-optimizer"
            )
        super().load_state_dict(state)
        with torch.no_grad():
            self.flat.params.copy_(state["params"])
        self.local_steps = int(state["local_steps"])
        self.rounds = int(state["rounds"])


class LocalSGD(_LocalFamily):
    """Local SGD: tau local SGD steps, then a blocking parameter average.

    Paper: Stich, *Local SGD converges fast and communicates little* (2019); CO2's baseline,
    docs/ALGORITHMS.md §3.1. Symbols: tau -> options.sync_every, inner lr gamma -> --optim.lr with
    the schedule, SGD momentum -> options.sgd_momentum. Inner state local and persistent.
    Deploys: the worker average (the synced parameters right after a round; mid-round an
    uncharged average of the local models). ``finish()`` averages a trailing partial round.
    Memory: parameters + gradients + inner state, as DDP.
    Reduces to: DDP with SGD when tau = 1 (tests/test_co2.py checks it).
    """

    name: ClassVar[str] = "local_sgd"
    cost: ClassVar[CostModel] = CostModel(
        description="parameter average every tau steps",
        traffic=lambda o, t: [Transfer(1.0, 1 / o.sync_every)],
        schedule=lambda o: f"tau = {o.sync_every} local steps per round",
    )
    fixed_inner: ClassVar[InnerOptimizerKind | None] = "sgd"
    muon_refusal: ClassVar[str | None] = "its inner optimizer is SGD"
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state="the step and round counters, and a live member's local parameters",
        worker_state=(
            "join: the local parameters start as the sending member's and the inner optimizer "
            "afresh; rejoin: the same, the inner optimizer kept"
        ),
    )

    def round_committed(self, stats: StepStats) -> bool:
        return stats.extras.get("synced") == 1.0

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        counters = self.round_counters()
        return [(Role.PARAMETER, self.flat.params)], counters

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        with torch.no_grad():
            self.params_written()

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        if self.round_due(stats):
            with torch.no_grad():
                self.average()
                self.params_written()
            self.end_round()
        return stats

    def finish(self) -> None:
        # "Average once more at the very end" (§3.1 edge cases): a trailing partial round.
        if self.local_steps > 0:
            with torch.no_grad():
                self.average()
                self.params_written()
            self.end_round()

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        if self.local_steps == 0:
            yield self.model
        else:
            with self.worker_average() as model:
                yield model

    def state_bytes(self) -> int:
        return self.base_state_bytes()


class LocalAdamW(LocalSGD):
    """Local AdamW: tau local AdamW steps (local, persistent m and v), then a blocking average.

    docs/ALGORITHMS.md §3.1 with AdamW as the inner optimizer (--optim.*). Same as local_sgd
    otherwise. Memory (2 + 2 + K) Psi, as DDP.
    """

    name: ClassVar[str] = "local_adamw"
    cost: ClassVar[CostModel] = CostModel(
        description="parameter average every tau steps",
        traffic=lambda o, t: [Transfer(1.0, 1 / o.sync_every)],
        schedule=lambda o: f"tau = {o.sync_every} local steps per round",
        shards_over_replicas=True,
    )
    fixed_inner: ClassVar[InnerOptimizerKind | None] = "adamw"
    muon_refusal: ClassVar[str | None] = None


class OverlapLocalSGD(_LocalFamily):
    """Overlap-Local-SGD: pull toward a stale anchor, non-blocking parameter all-reduce.

    Paper: Wang, Liang & Joshi, *Overlap Local-SGD* (2020), as restated in docs/ALGORITHMS.md §3.2
    [R-med]. Symbols: tau -> options.sync_every, alpha -> options.pull, z -> the anchor (the
    result of the previous boundary's all-reduce). At each boundary: wait for the previous
    all-reduce (z), pull ``x <- x - alpha (x - z)`` (skipped at the first boundary, where no
    anchor exists yet), launch the all-reduce of the pulled x; it overlaps the next tau local
    steps. Inner optimizer: options.inner_optimizer.
    Memory: one extra copy; the anchor and the communication buffer share storage, since z is
    only read by the pull, right before the buffer is refilled.
    Deploys: an uncharged average of the current local models. ``finish()`` drains.
    """

    name: ClassVar[str] = "overlap_local_sgd"
    cost: ClassVar[CostModel] = CostModel(
        description="average overlaps next round",
        traffic=lambda o, t: [Transfer(1.0, 1 / o.sync_every, hidden_steps=o.sync_every)],
        schedule=lambda o: f"tau = {o.sync_every} local steps per round",
        extra_copies=2,
        shards_over_replicas=True,
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state=(
            "the step and round counters, the anchor z (the members first finish the "
            "all-reduce in flight) and a live member's local parameters"
        ),
        worker_state=(
            "join: the local parameters start as the sending member's and the inner optimizer "
            "afresh; rejoin: the same, the inner optimizer kept"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: LocalOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options)
        self.buffer = torch.zeros_like(self.flat.params)
        self.handle: Handle | None = None
        #: Declared faults: the quorum the all-reduce in flight was launched over, whether it
        #: failed (a member of it was lost), and whether the buffer holds a settled anchor z
        #: with no handle (after healing).
        self.launched_over: tuple[int, ...] = ()
        self.sync_failed = False
        self.anchored = False

    def step(self, closure: Closure) -> StepStats:
        self.mark_failed_sync()
        stats = self.inner_step(closure)
        if self.round_due(stats):
            with torch.no_grad():
                if self.drop_failed_sync():
                    stats.extras["syncs_dropped"] = 1.0
                # (No anchor z at the first boundary, nor after an all-reduce that failed.)
                pulled = self.handle is not None or self.anchored
                if pulled:
                    self.finish_sync()  # the buffer now holds z, the last boundary's average
                    self.flat.params.lerp_(self.buffer, self.options.pull)  # x -= alpha (x - z)
                    self.params_written()
                stats.extras["pulled"] = float(pulled)
                self.launch_sync()  # overlaps the next tau inner steps
            self.end_round()
        return stats

    def launch_sync(self) -> None:
        # (A member lost since the last boundary: the new quorum forms once it is detected.)
        self.launched_over = self.runtime.enter_round().members
        self.sync_failed = self.anchored = False
        self.buffer.copy_(self.flat.params)
        self.handle = self.comm.all_reduce(self.buffer, op="mean", role=Role.PARAMETER)

    # membership (declared faults) -----------------------------------------------------------

    def mark_failed_sync(self) -> None:
        """An all-reduce in flight whose quorum lost a member fails on every member."""
        if self.handle is not None and not set(self.launched_over) <= set(
            self.runtime.quorum.members
        ):
            self.sync_failed = True

    def drop_failed_sync(self) -> bool:
        """Discard a failed all-reduce's result, where the boundary would have waited for it
        (the buffer is reused only once the group is done with it): the boundary then pulls
        toward no anchor. Whether there was one."""
        if self.handle is not None and self.sync_failed:
            self.handle.wait()
            self.handle = None
            self.sync_failed = False
            return True
        return False

    def round_committed(self, stats: StepStats) -> bool:
        return stats.extras.get("synced") == 1.0

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        counters = {**self.round_counters(), "anchored": int(self.anchored)}
        return [(Role.PARAMETER, self.flat.params), (Role.PARAMETER, self.buffer)], counters

    def set_global_counters(self, counters: dict[str, int]) -> None:
        super().set_global_counters(counters)
        self.anchored = bool(counters["anchored"])

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        with torch.no_grad():
            self.params_written()

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """The members first finish the all-reduce in flight, so the anchor z they send is
        settled: the joiner took no part in it. A joiner's own one from before it was lost is
        void."""
        if joining:
            if self.handle is not None:  # (complete: its members issued it steps ago)
                self.handle.wait()
            self.handle = None
            self.sync_failed = False
        else:
            self.mark_failed_sync()
            self.drop_failed_sync()
            if self.handle is not None:
                self.finish_sync()
                self.handle = None
                self.anchored = True
        super().heal(source, joining=joining, kept=kept)

    def finish_sync(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    def finish(self) -> None:
        self.finish_sync()

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        with self.worker_average() as model:
            yield model

    def state_bytes(self) -> int:
        return self.base_state_bytes() + _bytes(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        # Settled first: the buffer holds the in-flight result only once the data has moved.
        pending = pending_state(self.handle)
        # (Declared faults: whether the all-reduce in flight fails is decided by its launch
        # quorum, so a resumed run must know it.)
        faults = {
            "launched_over": list(self.launched_over),
            "sync_failed": self.sync_failed,
            "anchored": self.anchored,
        }
        return {**super().state_dict(), **pending, "buffer": self.buffer.clone(), **faults}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer.copy_(state["buffer"])
        self.handle = self.runtime.restore_pending(state)
        self.launched_over = tuple(state.get("launched_over", ()))
        self.sync_failed = bool(state.get("sync_failed", False))
        self.anchored = bool(state.get("anchored", False))


class _AnchoredOuter(_LocalFamily):
    """Methods with a shared anchor x_{t,0} that every round restarts from."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: LocalOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options)
        if self.options.outer_nesterov:
            raise ValueError(
                f"--local.outer-nesterov: True with --method {self.name}, whose slow momentum "
                f"is its paper's heavy ball; pass --local.outer-nesterov False"
            )
        # clone(): the anchor must not alias the parameters the inner steps overwrite.
        self.anchor = self.flat.params.clone()
        self.momentum = torch.zeros_like(self.flat.params)

    def restart_from_anchor(self) -> None:
        self.flat.params.copy_(self.anchor)
        self.params_written()

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The shared anchor x_{t,0} (no communication)."""
        if self.local_steps == 0:
            yield self.model  # right after a round the parameters are the anchor
        else:
            with self.swapped_in(self.anchor) as model:
                yield model

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "anchor": self.anchor.clone(),
            "outer_momentum": self.momentum.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.anchor.copy_(state["anchor"])
        self.momentum.copy_(state["outer_momentum"])


class SlowMo(_AnchoredOuter):
    """SlowMo: blocking average, then slow momentum on the round's displacement.

    Paper: Wang et al., *SlowMo: Improving communication-efficient distributed SGD with slow
    momentum* (ICLR 2020), docs/ALGORITHMS.md §3.3. Symbols: tau -> options.sync_every, alpha ->
    options.outer_lr, beta -> options.outer_momentum, gamma_t -> the inner learning rate of the
    round's last inner step, u -> ``self.momentum``, x_{t,0} -> ``self.anchor``::

        x_avg = AR_mean(x_local);  u <- beta u + (x_anchor - x_avg) / gamma
        x_anchor <- x_anchor - alpha gamma u;  every worker restarts from x_anchor

    (gamma = 0 leaves the anchor and decays u by beta.) Inner optimizer: options.inner_optimizer,
    state local. Memory (2 + 2 + 2x2 + K) Psi: anchor and u. Deploys the anchor.
    Reduces to: local_sgd / local_adamw when alpha = 1 and beta = 0 (tested).
    """

    name: ClassVar[str] = "slowmo"
    cost: ClassVar[CostModel] = CostModel(
        description="outer momentum every tau steps",
        traffic=lambda o, t: [Transfer(1.0, 1 / o.sync_every)],
        schedule=lambda o: f"tau = {o.sync_every} local steps per round",
        extra_copies=2,
        shards_over_replicas=True,
    )

    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state="the anchor x_{t,0}, the slow momentum u, the step and round counters",
        worker_state=(
            "join: the local parameters start at the anchor and the inner optimizer afresh; "
            "rejoin: the local parameters start at the anchor, the inner optimizer kept"
        ),
    )

    def round_committed(self, stats: StepStats) -> bool:
        return "outer_step" in stats.extras

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        tensors = [(Role.PARAMETER, self.anchor), (Role.FIRST_MOMENT, self.momentum)]
        counters = self.round_counters()
        return tensors, counters

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        with torch.no_grad():
            self.restart_from_anchor()

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        if self.round_due(stats):
            with torch.no_grad():
                self.average()  # x_avg, blocking
                self.outer_step()
            stats.extras["outer_step"] = 1.0
            self.end_round()
        return stats

    def outer_step(self) -> None:
        """u <- beta u + (x_anchor - x_avg) / gamma; x_anchor <- x_anchor - alpha gamma u;
        every worker restarts from the anchor."""
        params = self.flat.params
        gamma = self.last_lr
        beta, alpha = self.options.outer_momentum, self.options.outer_lr
        # params becomes the outer displacement x_anchor - x_avg (it is overwritten below).
        params.sub_(self.anchor).neg_()
        self.momentum.mul_(beta)
        if gamma > 0:
            self.momentum.add_(params, alpha=1.0 / gamma)
            self.anchor.sub_(self.momentum, alpha=alpha * gamma)
        self.restart_from_anchor()

    def finish(self) -> None:
        if self.local_steps > 0:  # a trailing partial round still gets its outer step
            with torch.no_grad():
                self.average()
                self.outer_step()
            self.end_round()

    def state_bytes(self) -> int:
        return self.base_state_bytes() + _bytes(self.anchor, self.momentum)


class CO2(_AnchoredOuter):
    """CO2: asynchronous outer all-reduce overlapping the next round, stale outer momentum,
    staleness gap penalty and coordinate-wise clipping.

    Paper: Sun et al., *CO2: Efficient Distributed Training with Full Communication-Computation
    Overlap* (ICLR 2024), Alg. 1, as restated in docs/ALGORITHMS.md §3.4. Symbols: tau ->
    options.sync_every, alpha -> options.outer_lr, beta -> options.outer_momentum, phi ->
    options.clip_threshold (options.clip switches it), Lambda -> options.gap_penalty,
    epsilon -> options.penalty_epsilon, x_{t,0} -> ``self.anchor``, m -> ``self.momentum``,
    d_t -> ``self.displacement`` (x_{t,1} - x_{t,0}). Round t, worker i::

        tau inner steps from x_{t,0};  d_t <- x_{t,1} - x_{t,0}
        Delta_t = x_{t,0} - x_t,tau   -> asynchronous all-reduce (with d_t when shared)
        t = 0: keep the anchor (x_{1,0} = x_{0,0})
        t > 0: wait for round t-1's all-reduce (launched tau inner steps ago):
               Lambda_t = |x_{t,0} - x_{t-1,0}| / (tau |d_{t-1}| + eps) + 1     (element-wise)
               m_t = beta m_{t-1} + Delta_{t-1} / Lambda_t
               x_{t+1,0} = x_{t,0} - alpha clip(m_t, phi)

    The numerator uses |x_{t,0} - x_{t-1,0}| = alpha |clip(m_{t-1}, phi)| (0 at t = 1), so the
    previous anchor is never stored. Round t-1's buffer is consumed before round t's outer
    gradient is written into it; on one link the two transfers queue anyway, so the order
    costs no overlap. ``finish()`` turns a trailing partial round into a round, then drains the
    last all-reduce and applies its outer update. Deploys the shared anchor.

    Memory (measured by ``state_bytes``): anchor, m and the all-reduce buffer, plus with the
    penalty d_t and a buffer twice as long (shared d) or a second d (local d, as d_{t-1} and
    d_t are both alive): +5 copies with the penalty, +3 without. ACCO Table 1 counts +4: it
    does not count the second d-sized tensor that element-wise Lambda needs.
    Reduces to: SlowMo on one-round-delayed outer gradients (without 1/gamma scaling) when the
    penalty is off and phi is infinite (tested).
    """

    name: ClassVar[str] = "co2"
    cost: ClassVar[CostModel] = CostModel(
        description="async outer all-reduce over next round",
        # The shared displacement d travels in the same all-reduce: twice the payload.
        traffic=lambda o, t: [
            Transfer(
                2.0 if o.gap_penalty and o.shared_displacement else 1.0,
                1 / o.sync_every,
                hidden_steps=o.sync_every,
            )
        ],
        schedule=lambda o: f"tau = {o.sync_every} local steps per round",
        extra_copies=4,
        shards_over_replicas=True,
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state=(
            "the anchor x_{t,0}, the outer momentum m, the step and round counters, the "
            "all-reduce in flight (the members first finish it: its mean outer gradient and "
            "displacement, its inner steps, launch quorum and whether it failed), whether "
            "the last round moved the anchor, and the sending member's displacements d"
        ),
        worker_state=(
            "join: the local parameters start at the anchor and the inner optimizer afresh; "
            "rejoin: the same, the inner optimizer kept; its own all-reduce from before it "
            "was lost is void"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: LocalOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options)
        numel = self.flat.params.numel()
        penalty = self.options.gap_penalty
        shared = penalty and self.options.shared_displacement
        like = self.flat.params
        self.buffer = torch.zeros(
            2 * numel if shared else numel, dtype=like.dtype, device=like.device
        )
        self.displacement = torch.zeros_like(like) if penalty else None
        # Local d: d_{t-1} must survive round t, whose first step writes d_t.
        self.previous_displacement = torch.zeros_like(like) if penalty and not shared else None
        self.handle: Handle | None = None
        #: Inner steps of the round whose outer gradient is in flight (tau in Lambda).
        self.inflight_steps = 0
        self.clip_active = self.options.clip and math.isfinite(self.options.clip_threshold)
        #: Declared faults: the step and quorum the all-reduce in flight was launched at and
        #: over, whether it failed (a member of it was lost), whether the buffer holds its
        #: settled result with no handle (after healing), whether the last round's outer
        #: step moved the anchor (Lambda's numerator), and the syncs settled since
        #: settled_syncs() was last read.
        self.launched_at = 0
        self.launched_over: tuple[int, ...] = ()
        self.sync_failed = False
        self.received = False
        self.anchor_moved = True
        self.settled: list[tuple[int, bool]] = []
        #: M, every worker slot (built with all of them; a quorum's group has its members').
        self.workers = comm.world_size

    @property
    def _shared(self) -> bool:
        return self.previous_displacement is None and self.displacement is not None

    def step(self, closure: Closure) -> StepStats:
        self.mark_failed_sync()
        stats = self.inner_step(closure)
        with torch.no_grad():
            if self.local_steps == 1 and self.displacement is not None:
                torch.sub(self.flat.params, self.anchor, out=self.displacement)  # d_t
            if self.round_due(stats):
                stats.extras.update(self.close_round())
                self.end_round()
        return stats

    def close_round(self) -> dict[str, float]:
        """The end of round t, in Alg. 1's order; returns the step's extras."""
        extras: dict[str, float] = {}
        # t = 0 has no earlier round, and a failed one is discarded: keep the anchor.
        previous = self.settle_previous(extras)
        self.launch_sync()  # round t's Delta (and d_t): it overlaps the next round
        if previous:
            extras.update(self.outer_step())  # x_{t+1,0} = x_{t,0} - alpha clip(m_t, phi)
        self.anchor_moved = previous
        self.restart_from_anchor()
        return extras

    def settle_previous(self, extras: dict[str, float], *, opens: bool = True) -> bool:
        """Round t-1's all-reduce, if any: finished (Lambda_t and m_t), or, when it failed,
        discarded on every member once the loss is detected. Whether it is applied.
        ``opens``: round t follows (not at the run's end)."""
        if self.handle is None and not self.received:
            return False
        if not self.sync_failed:
            if self.handle is not None:
                self.handle.wait()
                self.handle, self.received = None, True
            if opens:
                # The next round's quorum forms once this one settled and before its result
                # is used: a joiner healed there (an engine such as torchft heals at the
                # quorum) receives it with the anchor and m_{t-1} and takes round t's outer
                # step as the members do. A quorum that forms only now (torchft's) may have
                # lost a member of its launch: it then fails, as a loss seen earlier does.
                self.runtime.enter_round()
                self.mark_failed_sync()
        if self.sync_failed:
            if self.handle is not None:  # (its buffer is reused once the group is done)
                self.handle.wait()
            self.handle, self.received, self.sync_failed = None, False, False
            self.runtime.enter_round()  # (it fails when the loss is detected)
            self.settled.append((self.launched_at, False))
            extras["syncs_dropped"] = 1.0
            return False
        extras.update(self.finish_sync())
        self.settled.append((self.launched_at, True))
        return True

    def launch_sync(self) -> None:
        """Delta_t = x_{t,0} - x_{t,tau} (with d_t when shared) into the buffer, then its
        asynchronous mean all-reduce."""
        numel = self.flat.params.numel()
        torch.sub(self.anchor, self.flat.params, out=self.buffer[:numel])
        if self._shared:
            assert self.displacement is not None
            self.buffer[numel:].copy_(self.displacement)
        elif self.previous_displacement is not None and self.displacement is not None:
            self.previous_displacement, self.displacement = (
                self.displacement,
                self.previous_displacement,
            )
        # (A member lost since the last round: the new quorum forms once it is detected.)
        self.launched_over = self.runtime.enter_round().members
        self.launched_at = self.step_index
        self.handle = self.comm.all_reduce(self.buffer, op="mean", role=Role.PSEUDO_GRADIENT)
        self.inflight_steps = self.local_steps

    def _clipped_momentum(self) -> torch.Tensor:
        if not self.clip_active:
            return self.momentum
        phi = self.options.clip_threshold
        return self.momentum.clamp(-phi, phi)

    def finish_sync(self) -> dict[str, float]:
        """Wait for round t-1's all-reduce and update the outer momentum (lines 8-12)."""
        assert self.handle is not None or self.received
        if self.handle is not None:
            self.handle.wait()
        self.received = False
        numel = self.flat.params.numel()
        outer_gradient = self.buffer[:numel]
        extras: dict[str, float] = {}
        if self.options.gap_penalty:
            if self._shared:
                displacement = self.buffer[numel:]
            else:
                assert self.previous_displacement is not None
                displacement = self.previous_displacement
            # Denominator tau |d_{t-1}| + eps, in place: d_{t-1} is not needed afterwards.
            denominator = (
                displacement.abs_().mul_(self.inflight_steps).add_(self.options.penalty_epsilon)
            )
            # |x_{t,0} - x_{t-1,0}| = alpha |clip(m_{t-1})|, read before m is overwritten.
            penalty = self._clipped_momentum().abs().mul_(self.options.outer_lr)
            if not self.anchor_moved:  # (a discarded round left x_{t,0} = x_{t-1,0})
                penalty.zero_()
            penalty.div_(denominator).add_(1.0)  # Lambda_t >= 1, element-wise
            outer_gradient.div_(penalty)
            extras["mean_penalty"] = whole_mean(self.flat, penalty)
        self.momentum.mul_(self.options.outer_momentum).add_(outer_gradient)
        self.handle = None
        return extras

    def outer_step(self) -> dict[str, float]:
        """x_{t+1,0} = x_{t,0} - alpha clip(m_t, phi) (line 13)."""
        extras = {"outer_step": 1.0}
        if self.clip_active:
            phi = self.options.clip_threshold
            extras["clipped_fraction"] = whole_mean(self.flat, (self.momentum.abs() > phi).float())
        self.anchor.sub_(self._clipped_momentum(), alpha=self.options.outer_lr)
        return extras

    def finish(self) -> None:
        with torch.no_grad():
            if self.local_steps > 0:
                self.close_round()
                self.end_round()
            self.mark_failed_sync()
            if self.settle_previous({}, opens=False):
                self.outer_step()
                self.restart_from_anchor()

    # membership (declared faults) -----------------------------------------------------------

    def mark_failed_sync(self) -> None:
        """An all-reduce in flight whose quorum lost a member fails on every member."""
        in_flight = self.handle is not None or self.received
        if in_flight and not set(self.launched_over) <= set(self.runtime.quorum.members):
            self.sync_failed = True

    def round_committed(self, stats: StepStats) -> bool:
        """Whether the step launched a round's all-reduce (its tokens wait for it to settle)."""
        return stats.extras.get("synced") == 1.0

    def settled_syncs(self) -> list[tuple[int, bool]] | None:
        settled, self.settled = self.settled, []
        return settled

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        tensors = [
            (Role.PARAMETER, self.anchor),
            (Role.FIRST_MOMENT, self.momentum),
            (Role.PSEUDO_GRADIENT, self.buffer),
        ]
        for extra in (self.displacement, self.previous_displacement):
            if extra is not None:
                tensors.append((Role.PSEUDO_GRADIENT, extra))
        members = set(self.launched_over)
        counters = {
            **self.round_counters(),
            "inflight_steps": self.inflight_steps,
            "in_flight": int(self.received),
            "sync_failed": int(self.sync_failed),
            "launched_at": self.launched_at,
            "anchor_moved": int(self.anchor_moved),
        }
        counters.update({f"member{k}": int(k in members) for k in range(self.workers)})
        return tensors, counters

    def set_global_counters(self, counters: dict[str, int]) -> None:
        super().set_global_counters(counters)
        self.inflight_steps = counters["inflight_steps"]
        self.received = bool(counters["in_flight"])
        self.sync_failed = bool(counters["sync_failed"])
        self.launched_at = counters["launched_at"]
        self.anchor_moved = bool(counters["anchor_moved"])
        self.launched_over = tuple(k for k in range(self.workers) if counters[f"member{k}"])

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        with torch.no_grad():
            self.restart_from_anchor()

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """The members first finish the all-reduce in flight (early, charged as their wait;
        they still apply it at the round's end), so the sender passes its result on: the
        joiner took no part in it. A joiner's own one from before it was lost is void."""
        if joining:
            if self.handle is not None:  # (complete: its members issued it steps ago)
                self.handle.wait()
            self.handle = None
            self.settled = []
        else:
            self.mark_failed_sync()
            if self.handle is not None:  # (a failed one too: its flag travels with it)
                self.handle.wait()
                self.handle = None
                self.received = True
        super().heal(source, joining=joining, kept=kept)

    def state_bytes(self) -> int:
        return self.base_state_bytes() + _bytes(
            self.anchor,
            self.momentum,
            self.buffer,
            self.displacement,
            self.previous_displacement,
        )

    def state_dict(self) -> dict[str, Any]:
        # A checkpoint needs the in-flight result (all ranks checkpoint together); settling
        # moves the data now but charges the clock only when the round consumes it.
        pending = pending_state(self.handle)
        state = {
            **super().state_dict(),
            **pending,
            "buffer": self.buffer.clone(),
            "inflight_steps": self.inflight_steps,
            # (Declared faults: the all-reduce in flight fails by its launch quorum, its
            # tokens settle by its launch step, and Lambda reads whether the anchor moved.)
            "launched_at": self.launched_at,
            "launched_over": list(self.launched_over),
            "sync_failed": self.sync_failed,
            "received": self.received,
            "anchor_moved": self.anchor_moved,
        }
        if self.displacement is not None:
            state["displacement"] = self.displacement.clone()
        if self.previous_displacement is not None:
            state["previous_displacement"] = self.previous_displacement.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer.copy_(state["buffer"])
        self.handle = self.runtime.restore_pending(state)
        self.inflight_steps = int(state["inflight_steps"])
        self.launched_at = int(state.get("launched_at", 0))
        self.launched_over = tuple(int(k) for k in state.get("launched_over", ()))
        self.sync_failed = bool(state.get("sync_failed", False))
        self.received = bool(state.get("received", False))
        self.anchor_moved = bool(state.get("anchor_moved", True))
        if self.displacement is not None:
            self.displacement.copy_(state["displacement"])
        if self.previous_displacement is not None:
            self.previous_displacement.copy_(state["previous_displacement"])


METHODS: tuple[type[Strategy], ...] = (LocalSGD, LocalAdamW, OverlapLocalSGD, SlowMo, CO2)
