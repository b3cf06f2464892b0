"""Delayed and eager outer steps (docs/ALGORITHMS.md §4.3-4.4): the outer all-reduce overlaps whole
inner phases.

Paper: "Eager Updates For Overlapped Communication and Computation in DiLoCo" (seed 003).
The paper's equations are lost; the rules below are docs/ALGORITHMS.md's reconstructions [R-hi].
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, fragment_traffic
from lowcomm.strategies.diloco import DiLoCoOptions, OuterExchange, OuterLoopStrategy
from lowcomm.strategies.streaming import completion_offsets


def eager_outer_gradient(
    stale_mean: torch.Tensor,
    fresh_own: torch.Tensor,
    stale_own: torch.Tensor,
    world_size: int,
) -> torch.Tensor:
    """The eager outer gradient (docs/ALGORITHMS.md §4.4):

    Delta~_m^(t) = Delta^(t-N) + (1/M) (Delta_m^(t) - Delta_m^(t-N))
                 = (1/M) (Delta_m^(t) + sum_{m' != m} Delta_{m'}^(t-N)).

    Args:
        stale_mean: Delta^(t-N), the averaged outer gradient from N rounds back.
        fresh_own: Delta_m^(t), this worker's current outer gradient.
        stale_own: Delta_m^(t-N), this worker's contribution to ``stale_mean``.
        world_size: M.
    """
    return stale_mean + (fresh_own - stale_own) / world_size


class DelayedOuterBase(OuterLoopStrategy[DiLoCoOptions]):
    """Per-worker outer parameters phi_m (``globals_``) stepped with an outer gradient whose
    all-reduce overlaps the next N inner phases. Per fragment when K > 1: fragment p syncs at
    steps (p+1)H/K (mod H), each fragment's gradient delayed by N of its own periods H, and the
    local fragment is reset to phi_{m,p} after its outer step (no alpha-mixing).

    Elastic resume: as :class:`~lowcomm.strategies.diloco.OuterLoopStrategy`; the delayed outer
    exchange is saved settled and kept.
    """

    eager: ClassVar[bool]

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: DiLoCoOptions | None = None,
    ) -> None:
        options = options or DiLoCoOptions()
        fragments = options.fragments or self.default_fragments
        if fragments > options.sync_every:
            raise ValueError(
                f"--diloco.fragments: {fragments} fragments do not fit in --diloco.sync-every "
                f"{options.sync_every} steps; pass at most {options.sync_every} fragments"
            )
        super().__init__(model, comm, context, options)
        self.sync_offsets = completion_offsets(self.options.sync_every, self.num_fragments)
        # Per fragment: in-flight exchanges, oldest first, with the fresh own Delta at launch.
        self.pending: list[deque[OuterExchange]] = [deque() for _ in self.fragments]

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        t = self.step_index
        for p, offset in enumerate(self.sync_offsets):
            if t >= offset and (t - offset) % self.options.sync_every == 0:
                self.sync_fragment(p)
                stats.extras["outer_step"] = 1.0
        return stats

    def sync_fragment(self, p: int) -> None:
        """End of fragment p's inner phase: launch its exchange, apply the one N rounds old."""
        fresh_own = self.globals_[p] - self.local_fragment(p)
        self.pending[p].append(self.launch_sync(p))
        if len(self.pending[p]) > self.options.outer_delay:
            stale_mean, _, stale_own = self.pending[p].popleft().wait()
        elif self.eager:
            # First rounds [R-lo]: Delta^(0) = Delta_m^(0) = 0, a (1/M) Delta_m^(t) step.
            stale_mean = torch.zeros_like(fresh_own)
            stale_own = torch.zeros_like(fresh_own)
        else:
            # Naive delay, first rounds: no update (zero outer gradient); restart from phi_m.
            self.set_local_fragment(p, self.globals_[p])
            return
        if self.eager:
            update = eager_outer_gradient(stale_mean, fresh_own, stale_own, self.comm.world_size)
        else:
            update = stale_mean
        self.outer_step(p, update)
        self.set_local_fragment(p, self.globals_[p])

    def finish(self) -> None:
        """Drain every in-flight exchange and apply it, oldest first [R-med].

        Naive delay applies Delta^(s). Eager already applied its own part of round s (fresh,
        1/M Delta_m^(s)), so it applies the others' part, Delta^(s) - (1/M) Delta_m^(s): every
        worker's contribution then enters phi_m exactly once.
        """
        for p, queue in enumerate(self.pending):
            while queue:
                mean, _, own = queue.popleft().wait()
                update = mean - own / self.comm.world_size if self.eager else mean
                self.outer_step(p, update)
            self.set_local_fragment(p, self.globals_[p])

    def in_flight_state(self) -> list[Any]:
        return [[exchange.state_dict() for exchange in queue] for queue in self.pending]

    def load_in_flight_state(self, saved: list[Any]) -> None:
        if len(saved) != len(self.pending):
            raise ValueError(
                f"{self.name}: the checkpoint has {len(saved)} fragments, this run "
                f"{len(self.pending)}; resume with the same --diloco.fragments"
            )
        self.pending = [deque(self.restore_exchange(item) for item in queue) for queue in saved]

    def extra_state_bytes(self) -> int:
        # N in-flight buffers of every fragment (the whole model), plus for eager the stored own
        # contributions (inside each exchange) -- docs/ALGORITHMS.md counts +2+2N copies for eager.
        copies = self.options.outer_delay * (2 if self.eager else 1)
        return copies * 4 * sum(f.numel for f in self.fragments)


class DiLoCoDelayed(DelayedOuterBase):
    """Naive delayed outer steps: phi_m <- OuterNesterov(phi_m, Delta^(t-N)).

    Paper: EAGER §2.2, Alg. 2 (docs/ALGORITHMS.md §4.3, reconstructed). Symbols: phi_m -> globals_
    (per-worker outer parameters, never synchronized directly), N -> options.outer_delay
    (1 = the paper's naive 1-outer-step delay), H -> options.sync_every, eta_out ->
    options.outer_lr (the paper had to lower it for stability). First N rounds: no update.
    Reduces to: diloco's outer step applied one round late (tests/test_eager.py checks it).
    """

    name: ClassVar[str] = "diloco_delayed"
    cost: ClassVar[CostModel] = CostModel(
        description="outer step one round late",
        # K fragments (default 1) once per H, each all-reduce overlapping N outer rounds.
        traffic=lambda o, t: fragment_traffic(
            o.fragments or DelayedOuterBase.default_fragments,
            (o.fragments or DelayedOuterBase.default_fragments) / o.sync_every,
            o.outer_delay * o.sync_every,
        ),
        schedule=lambda o: (
            f"H = {o.sync_every}, K = {o.fragments or DelayedOuterBase.default_fragments} "
            f"fragments, N = {o.outer_delay} outer round(s) per all-reduce"
        ),
        extra_copies=3,
        shards_over_replicas=True,
    )
    eager = False


class Eager(DelayedOuterBase):
    """Eager outer steps: the stale own contribution is replaced by the fresh one.

    Paper: EAGER §2.3, Alg. 3 (docs/ALGORITHMS.md §4.4, reconstructed). phi_m <- OuterNesterov_m(
    phi_m, Delta^(t-N) + (1/M)(Delta_m^(t) - Delta_m^(t-N))). Symbols: N -> options.outer_delay
    (1-outer-step and N-outer-step), K -> options.fragments (per-fragment eager, as the paper
    combines it with Streaming DiLoCo), M -> comm.world_size. With quantization, Delta_m^(t-N)
    is the dequantized payload the others received, so it is removed exactly.
    """

    name: ClassVar[str] = "eager"
    cost: ClassVar[CostModel] = CostModel(
        description="eager local outer step, round overlap",
        # K fragments (default 1) once per H, each all-reduce overlapping N outer rounds.
        traffic=lambda o, t: fragment_traffic(
            o.fragments or DelayedOuterBase.default_fragments,
            (o.fragments or DelayedOuterBase.default_fragments) / o.sync_every,
            o.outer_delay * o.sync_every,
        ),
        schedule=lambda o: (
            f"H = {o.sync_every}, K = {o.fragments or DelayedOuterBase.default_fragments} "
            f"fragments, N = {o.outer_delay} outer round(s) per all-reduce"
        ),
        extra_copies=3,
        shards_over_replicas=True,
    )
    eager = True


METHODS: tuple[type[Strategy], ...] = (DiLoCoDelayed, Eager)
