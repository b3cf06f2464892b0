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

One ``step()`` call is one inner step; ``extras["synced"] = 1.0`` marks the step that ended a
round (and ``extras["outer_step"] = 1.0`` one that moved the anchor).

Communication is only through ``self.comm``; role ``parameter`` for parameter averages,
``pseudo_gradient`` for CO2's outer gradient.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lowcomm.comm.base import Comm, Handle, Role
from lowcomm.comm.runtime import pending_state
from lowcomm.optim.adamw import AdamWConfig, make_adamw
from lowcomm.optim.flat import FlatOptimizer, tensor_bytes
from lowcomm.optim.muon import muon_refusal
from lowcomm.optim.sgd import FlatSGD
from lowcomm.strategies.base import Closure, Loss, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, Transfer
from lowcomm.strategies.gradient_step import (
    accumulate,
    average_and_clip,
    make_inner_optimizer,
    step_and_publish,
)
from lowcomm.strategies.sharded_flat import flat_buffers, norm_summer, whole_mean

InnerOptimizerKind = Literal["adamw", "sgd"]


@dataclass(kw_only=True)
class LocalOptions:
    """Options of local_sgd, local_adamw, overlap_local_sgd, slowmo and co2."""

    sync_every: int = 6
    """tau: inner (local) steps per round; the parameters are combined after each round."""

    inner_optimizer: InnerOptimizerKind = "adamw"
    """Inner optimizer of overlap_local_sgd, slowmo and co2: adamw (--optim.*) or sgd
    (--optim.lr, --optim.weight-decay, --local.sgd-momentum). local_sgd always uses sgd and
    local_adamw always adamw."""

    sgd_momentum: float = 0.0
    """Momentum of the inner SGD (PyTorch semantics, no dampening); kept local and persistent."""

    pull: float = 0.5
    """overlap_local_sgd: alpha, the pull toward the stale anchor at each boundary, in (0, 1]."""

    outer_lr: float = 1.0
    """slowmo and co2: alpha, the outer learning rate."""

    outer_momentum: float = 0.5
    """slowmo and co2: beta, the outer (slow) momentum factor, in [0, 1)."""

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
        if (
            isinstance(self.sync_every, bool)
            or not isinstance(self.sync_every, int)
            or self.sync_every < 1
        ):
            raise ValueError(
                f"--local.sync-every: {self.sync_every} must be an integer >= 1; pass the number "
                f"of local steps per round, e.g. 6"
            )
        if self.inner_optimizer not in ("adamw", "sgd"):
            raise ValueError(
                f"--local.inner-optimizer: unknown {self.inner_optimizer!r}; choose adamw or sgd"
            )
        if not 0.0 <= self.sgd_momentum < 1.0:
            raise ValueError(
                f"--local.sgd-momentum: {self.sgd_momentum} must lie in [0, 1); try 0.9 or 0"
            )
        if not 0.0 < self.pull <= 1.0:
            raise ValueError(
                f"--local.pull: {self.pull} must lie in (0, 1]; it is the fraction of the way to "
                f"the anchor, try 0.5"
            )
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ValueError(
                f"--local.outer-lr: {self.outer_lr} must be a finite positive number; try 1.0"
            )
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(
                f"--local.outer-momentum: {self.outer_momentum} must lie in [0, 1); try 0.5"
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


def make_local_optimizer(
    kind: InnerOptimizerKind,
    master: torch.Tensor,
    config: AdamWConfig,
    momentum: float,
    replicas: Comm | None = None,
) -> FlatOptimizer:
    """The per-worker inner optimizer on the flat fp32 master (state local and persistent).

    ``adamw``: :class:`~lowcomm.optim.adamw.FlatAdamW` (docs/ALGORITHMS.md §0.3), its moments
    split over ``replicas`` when a worker has several ranks. ``sgd``:
    :class:`~lowcomm.optim.sgd.FlatSGD` with PyTorch's momentum mu (no dampening, no Nesterov)
    and the same decoupled weight decay as AdamW, so switching the inner optimizer changes only
    the direction rule::

        theta <- theta (1 - eta lambda);  b <- mu b + g  (b = g at first);  theta <- theta - eta b
    """
    if kind == "adamw":
        return make_adamw(master, config, replicas)
    return FlatSGD(master, weight_decay=config.weight_decay, momentum=momentum)


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _LocalUpdate(Strategy):
    """Shared machinery: flat buffers, the inner step, round bookkeeping.

    Elastic resume (``--resume DIR --workers M2``): replicated state (anchor, outer momentum,
    settled exchange results) is kept exactly; per-worker state (local parameters, inner
    optimizer states, displacements) is averaged over the old workers, so the next averaging
    step sees the same mean.
    """

    options_field: ClassVar[str | None] = "local"
    quick_options: ClassVar[Mapping[str, object]] = {"sync_every": 2}
    #: Inner optimizer fixed by the method (None: ``options.inner_optimizer``).
    fixed_inner: ClassVar[InnerOptimizerKind | None] = None
    sharding_refusal: ClassVar[str | None] = None
    muon_refusal: ClassVar[str | None] = None

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: LocalOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context)
        self.options = options if options is not None else LocalOptions()
        self.tau = self.options.sync_every
        self.flat = flat_buffers(model)  # the local shards on a sharded worker
        # In fp32 the parameters are their own master copy; otherwise a separate fp32 master
        # (cloned: it must never alias the working parameters).
        if self.flat.dtype == torch.float32:
            master = self.flat.params
        else:
            master = self.flat.params.float().clone()
        self.inner_kind: InnerOptimizerKind = self.fixed_inner or self.options.inner_optimizer
        if context.optim.name == "muon" and self.inner_kind == "sgd":
            raise muon_refusal(
                self.name, "--local.inner-optimizer sgd has no AdamW for Muon to replace"
            )
        self.inner = (
            make_inner_optimizer(
                model, self.flat, master, context.optim, self.runtime.replica_group, self.name
            )
            if self.inner_kind == "adamw"
            else make_local_optimizer(
                self.inner_kind, master, context.optim, self.options.sgd_momentum
            )
        )
        #: Inner steps taken in the current round (0 right after a round ended).
        self.local_steps = 0
        #: Rounds completed.
        self.rounds = 0
        self._last_lr = 0.0

    # --- helpers -------------------------------------------------------------------------

    @property
    def _separate_master(self) -> bool:
        return self.inner.master is not self.flat.params

    def _params_written(self) -> None:
        """The working parameters were overwritten (average, anchor): refresh the master."""
        if self._separate_master:
            self.inner.master.copy_(self.flat.params)

    def _inner_step(self, closure: Closure) -> tuple[Loss, int, int, float]:
        """One local optimizer step on this worker's own gradient (no communication)."""
        count = self.context.microbatches_per_step
        loss, samples, tokens = accumulate(self.flat, closure, count, self.runtime.replica_group)
        lr = self.lr_at(self.step_index)
        with torch.no_grad():
            # Local methods clip the worker's own gradient (there is no averaged one).
            grads = average_and_clip(
                self.flat.grads,
                count=count,
                max_grad_norm=self.context.max_grad_norm,
                sum_squared_norm=norm_summer(self.flat),
            )
            step_and_publish(self.inner, grads, lr=lr, flat=self.flat)
        self.step_index += 1
        self.local_steps += 1
        self._last_lr = lr
        return loss, samples, tokens, lr

    def _after_first_inner_step(self) -> None:
        """Hook: called right after the first inner step of a round."""
        return None

    @abstractmethod
    def _end_round(self) -> dict[str, float]:
        """Combine the workers at the end of a round; returns extras."""

    def step(self, closure: Closure) -> StepStats:
        loss, samples, tokens, lr = self._inner_step(closure)
        if self.local_steps == 1:
            with torch.no_grad():
                self._after_first_inner_step()
        extras: dict[str, float] = {"synced": 0.0}
        if self.local_steps == self.tau:
            with torch.no_grad():
                extras.update(self._end_round())
            extras["synced"] = 1.0
            self.local_steps = 0
            self.rounds += 1
        return StepStats(
            loss=loss,
            microbatches=self.context.microbatches_per_step,
            samples=samples,
            tokens=tokens,
            lr=lr,
            extras=extras,
        )

    @contextmanager
    def _swapped_in(self, values: torch.Tensor) -> Iterator[nn.Module]:
        """Temporarily load ``values`` into the working parameters (for validation)."""
        saved = self.flat.params.clone()
        with torch.no_grad():
            self.flat.params.copy_(values)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.flat.params.copy_(saved)

    @contextmanager
    def _worker_average(self) -> Iterator[nn.Module]:
        """The mean of the workers' current local models (an uncharged all-reduce of a copy;
        every rank calls it together)."""
        average = self.flat.params.clone()
        # On the uncharged channel: averaging a model for validation neither occupies the
        # modeled link nor counts as training traffic (evaluation is off the clock).
        self.runtime.uncharged.all_reduce(average, op="mean", role=Role.PARAMETER).wait()
        with self._swapped_in(average) as model:
            yield model

    def _base_state_bytes(self) -> int:
        master = tensor_bytes(self.inner.master) if self._separate_master else 0
        return self.flat.bytes + master + self.inner.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "inner_kind": self.inner_kind,
            "inner": self.inner.state_dict(),
            "params": self.flat.params.clone(),
            "local_steps": self.local_steps,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state["inner_kind"] != self.inner_kind:
            raise ValueError(
                f"checkpoint holds a {state['inner_kind']} inner optimizer but this run uses "
                f"{self.inner_kind}; resume with the same --local.inner-optimizer"
            )
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            self.flat.params.copy_(state["params"])
        self.local_steps = int(state["local_steps"])
        self.rounds = int(state["rounds"])


class LocalSGD(_LocalUpdate):
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

    def _end_round(self) -> dict[str, float]:
        self.comm.all_reduce(self.flat.params, op="mean", role=Role.PARAMETER).wait()
        self._params_written()
        return {}

    def finish(self) -> None:
        # "Average once more at the very end" (§3.1 edge cases): a trailing partial round.
        if self.local_steps > 0:
            with torch.no_grad():
                self._end_round()
            self.local_steps = 0
            self.rounds += 1

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        if self.local_steps == 0:
            yield self.model
        else:
            with self._worker_average() as model:
                yield model

    def state_bytes(self) -> int:
        return self._base_state_bytes()


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


class OverlapLocalSGD(_LocalUpdate):
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

    def _end_round(self) -> dict[str, float]:
        pulled = 0.0
        if self.handle is not None:
            self.handle.wait()  # the buffer now holds z, the average of the last boundary
            self.flat.params.lerp_(self.buffer, self.options.pull)
            self._params_written()
            pulled = 1.0
        self.buffer.copy_(self.flat.params)
        self.handle = self.comm.all_reduce(self.buffer, op="mean", role=Role.PARAMETER)
        return {"pulled": pulled}

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        with self._worker_average() as model:
            yield model

    def state_bytes(self) -> int:
        return self._base_state_bytes() + _bytes(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        # Settled first: the buffer holds the in-flight result only once the data has moved.
        pending = pending_state(self.handle)
        return {**super().state_dict(), **pending, "buffer": self.buffer.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer.copy_(state["buffer"])
        self.handle = self.runtime.restore_pending(state)


class _AnchoredOuter(_LocalUpdate):
    """Methods with a shared anchor x_{t,0} that every round restarts from."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: LocalOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options)
        # clone(): the anchor must not alias the parameters the inner steps overwrite.
        self.anchor = self.flat.params.clone()
        self.momentum = torch.zeros_like(self.flat.params)

    def _restart_from_anchor(self) -> None:
        self.flat.params.copy_(self.anchor)
        self._params_written()

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The shared anchor x_{t,0} (no communication)."""
        if self.local_steps == 0:
            yield self.model  # right after a round the parameters are the anchor
        else:
            with self._swapped_in(self.anchor) as model:
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

    def _end_round(self) -> dict[str, float]:
        params = self.flat.params
        self.comm.all_reduce(params, op="mean", role=Role.PARAMETER).wait()
        gamma = self._last_lr
        beta, alpha = self.options.outer_momentum, self.options.outer_lr
        # params becomes the outer displacement x_anchor - x_avg (it is overwritten below).
        params.sub_(self.anchor).neg_()
        self.momentum.mul_(beta)
        if gamma > 0:
            self.momentum.add_(params, alpha=1.0 / gamma)
            self.anchor.sub_(self.momentum, alpha=alpha * gamma)
        self._restart_from_anchor()
        return {"outer_step": 1.0}

    def finish(self) -> None:
        if self.local_steps > 0:  # a trailing partial round still gets its outer step
            with torch.no_grad():
                self._end_round()
            self.local_steps = 0
            self.rounds += 1

    def state_bytes(self) -> int:
        return self._base_state_bytes() + _bytes(self.anchor, self.momentum)


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

    @property
    def _shared(self) -> bool:
        return self.previous_displacement is None and self.displacement is not None

    def _after_first_inner_step(self) -> None:
        if self.displacement is not None:
            torch.sub(self.flat.params, self.anchor, out=self.displacement)

    def _clipped_momentum(self) -> torch.Tensor:
        if not self.clip_active:
            return self.momentum
        phi = self.options.clip_threshold
        return self.momentum.clamp(-phi, phi)

    def _consume_previous(self) -> dict[str, float]:
        """Wait for round t-1's all-reduce and update the outer momentum (lines 8-12)."""
        assert self.handle is not None
        self.handle.wait()
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
            penalty.div_(denominator).add_(1.0)  # Lambda_t >= 1, element-wise
            outer_gradient.div_(penalty)
            extras["mean_penalty"] = whole_mean(self.flat, penalty)
        self.momentum.mul_(self.options.outer_momentum).add_(outer_gradient)
        self.handle = None
        return extras

    def _apply_outer_step(self) -> dict[str, float]:
        """x_{t+1,0} = x_{t,0} - alpha clip(m_t, phi) (line 13)."""
        extras = {"outer_step": 1.0}
        if self.clip_active:
            phi = self.options.clip_threshold
            extras["clipped_fraction"] = whole_mean(self.flat, (self.momentum.abs() > phi).float())
        self.anchor.sub_(self._clipped_momentum(), alpha=self.options.outer_lr)
        return extras

    def _end_round(self) -> dict[str, float]:
        extras: dict[str, float] = {}
        consumed = self.handle is not None
        if consumed:
            extras.update(self._consume_previous())
        # Round t's outer gradient (and d_t) into the buffer, then launch it: it completes
        # while the next round computes.
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
        self.handle = self.comm.all_reduce(self.buffer, op="mean", role=Role.PSEUDO_GRADIENT)
        self.inflight_steps = self.local_steps
        if consumed:
            extras.update(self._apply_outer_step())
        # t = 0 keeps the anchor (x_{1,0} = x_{0,0}); every round restarts from the anchor.
        self._restart_from_anchor()
        return extras

    def finish(self) -> None:
        with torch.no_grad():
            if self.local_steps > 0:
                self._end_round()
                self.local_steps = 0
                self.rounds += 1
            if self.handle is not None:
                self._consume_previous()
                self._apply_outer_step()
                self._restart_from_anchor()

    def state_bytes(self) -> int:
        return self._base_state_bytes() + _bytes(
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
        if self.displacement is not None:
            self.displacement.copy_(state["displacement"])
        if self.previous_displacement is not None:
            self.previous_displacement.copy_(state["previous_displacement"])


METHODS: tuple[type[Strategy], ...] = (LocalSGD, LocalAdamW, OverlapLocalSGD, SlowMo, CO2)
