"""CoCoDC (docs/ALGORITHMS.md §4.5): Streaming DiLoCo with delay-compensated merging and adaptive
fragment transmission.

Paper: "CoCoDC: Communication-Computation overlap with Delay Compensation" (seed 002),
eqs. 1-12, Alg. 1-2, with docs/ALGORITHMS.md's sign fix of Eq. 8 and the Taylor-consistent d.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role, values_on
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, fragment_traffic
from lowcomm.strategies.diloco import DiLoCoOptions, OuterLoopStrategy
from lowcomm.strategies.sharded_flat import ranks_mean, whole_norm
from lowcomm.strategies.streaming import (
    QUICK_OPTIONS,
    InFlight,
    check_overlap,
    load_in_flight,
    mark_failed_syncs,
    save_in_flight,
)


def compensated_merge(
    new_global: torch.Tensor,
    at_launch: torch.Tensor,
    now: torch.Tensor,
    *,
    overlap_steps: int,
    compensation: float,
    sync_every: int,
    sign: str = "fixed",
) -> torch.Tensor:
    """CoCoDC's merged fragment (Eqs. 4, 7, 8 with the sign fix of docs/ALGORITHMS.md §4.5).

    g^m    = (theta_{t_p} - theta_{t_l}) / tau                     (Eq. 4, descent rate)
    d      = theta^g_new - theta_{t_p}                             (Taylor-consistent d)
    g_corr = g^m + lambda g^m * g^m * d / H                        (Eq. 7)
    fixed:   theta_{t_l} <- theta^g_new - tau g_corr               (sign-fixed Eq. 8)
    literal: theta_{t_l} <- theta^g_new + tau g_corr               (printed Eq. 8, ablation)

    With lambda = 0 the fixed rule is the new global state plus the local progress made during
    the overlap. Args map: theta^g_new -> new_global, theta_{t_p} -> at_launch, theta_{t_l} ->
    now, tau -> overlap_steps, lambda -> compensation, H -> sync_every.
    """
    if overlap_steps == 0:
        return new_global.clone()  # no overlap, no local progress to carry over
    rate = (at_launch - now) / overlap_steps
    displacement = new_global - at_launch
    corrected = rate + compensation * rate * rate * displacement / sync_every
    if sign == "fixed":
        return new_global - overlap_steps * corrected
    if sign == "literal":
        return new_global + overlap_steps * corrected
    raise ValueError(f"--diloco.compensation-sign: {sign!r} is unknown; choose fixed or literal")


def select_fragment(
    step: int,
    last_sync_steps: Sequence[int],
    rates: Sequence[float],
    in_flight: Sequence[int],
    sync_every: int,
) -> int | None:
    """CoCoDC's fragment choice at global step t_g (Alg. 2; docs/ALGORITHMS.md §4.5 step 4).

    A fragment with t_g - t_{p,b} >= H is due: choose the stalest, ties by index. Otherwise
    argmax_p R_p (ties by index). In-flight fragments are excluded. Depends only on values
    every worker agrees on, so every worker chooses the same fragment. None if all are in flight.
    """
    candidates = [p for p in range(len(rates)) if p not in in_flight]
    if not candidates:
        return None
    stale = [p for p in candidates if step - last_sync_steps[p] >= sync_every]
    if stale:
        return max(stale, key=lambda p: (step - last_sync_steps[p], -p))
    return max(candidates, key=lambda p: (rates[p], -p))


def syncs_per_period(
    fragments: int, gamma: float, sync_every: int, step_s: float, sync_s: float
) -> int:
    """Eq. 9-10: N = max(K, floor(gamma H T_c / T_s))."""
    if not (step_s > 0 and sync_s > 0):
        return fragments
    return max(fragments, math.floor(gamma * sync_every * step_s / sync_s))


class CoCoDC(OuterLoopStrategy[DiLoCoOptions]):
    """CoCoDC: delay-compensated merge and adaptive transmission on top of Streaming DiLoCo.

    Paper: CoCoDC (docs/ALGORITHMS.md §4.5). Symbols: H -> options.sync_every, K -> options.fragments
    (default 4), tau -> options.overlap_steps, lambda -> options.compensation, gamma ->
    options.transmission_gamma, R_p -> rates[p] (initially inf), t_{p,b} -> last_sync_steps[p]
    (initially 0), T_c -> mean inner-step compute seconds, T_s -> seconds from launch to
    completion of one fragment sync, both on the run's clock (``runtime.clock``).

    Agreement: each sync carries this worker's (T_c, T_s) as two float32 values next to the
    outer gradient; N = max(K, floor(gamma H T_c / T_s)) and h = floor(H / N) are recomputed
    from the worker-mean when a sync completes, so every worker uses the same h. Until two syncs
    have completed (or with a comm that has no clock) N = K, h = H/K: plain round robin.
    R_p = ||mean Delta_p|| / max(1, t_p - t_{p,b}) uses the averaged Delta, also identical.

    Elastic resume: as :class:`OuterLoopStrategy` (global state kept, local state averaged); the
    per-worker compensation ratio and schedule readings that differ are averaged too.
    """

    name: ClassVar[str] = "cocodc"
    default_fragments: ClassVar[int] = 4
    quick_options: ClassVar[Mapping[str, object]] = QUICK_OPTIONS
    cost: ClassVar[CostModel] = CostModel(
        description="streaming + delay compensation",
        # Adaptive transmission: N = max(K, floor(gamma H T_c / T_s)) syncs per H, one every
        # h = max(1, H // N) steps, each of a fragment Psi/K overlapping tau inner steps.
        traffic=lambda o, t: fragment_traffic(
            o.fragments or CoCoDC.default_fragments,
            1
            / max(
                1,
                o.sync_every
                // syncs_per_period(
                    o.fragments or CoCoDC.default_fragments,
                    o.transmission_gamma,
                    o.sync_every,
                    t.step_seconds,
                    t.all_reduce_seconds(1 / (o.fragments or CoCoDC.default_fragments)),
                ),
            ),
            o.overlap_steps,
        ),
        schedule=lambda o: (
            f"H = {o.sync_every}, K = {o.fragments or CoCoDC.default_fragments} fragments, "
            f"tau = {o.overlap_steps}, "
            f"N = max(K, floor({o.transmission_gamma} H T_c / T_s)) syncs per H"
        ),
        extra_copies=3,
        shards_over_replicas=True,
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state=(
            "every fragment's theta^g_p and outer momentum, the counters, and the fragment "
            "schedule every member agrees on (each fragment's rate R_p and last sync step, "
            "the agreed T_c and T_s, the syncs per H); the members first finish their syncs "
            "in flight"
        ),
        worker_state=(
            "as streaming_diloco: every local fragment starts at theta^g_p, the inner AdamW "
            "afresh on join and kept on rejoin, no sync in flight; its own measured T_c and "
            "T_s start at the sender's"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: DiLoCoOptions | None = None,
    ) -> None:
        options = options or DiLoCoOptions()
        check_overlap(options, model, self.default_fragments, self.name)
        super().__init__(model, comm, context, options)
        self.rates = [math.inf] * self.num_fragments
        self.last_sync_steps = [0] * self.num_fragments
        self.syncs_per_h = self.num_fragments
        self.interval = self.options.sync_every // self.syncs_per_h
        self.in_flight: list[InFlight] = []
        self.clock = self.runtime.clock
        self.step_seconds = 0.0  # EMA of this worker's inner-step compute time (T_c)
        self.last_sync_seconds = 0.0  # this worker's last measured sync time (T_s)
        self.agreed_step_seconds = 0.0
        self.agreed_sync_seconds = 0.0
        self.compensation_ratio = 0.0
        #: Declared faults: the step of the last sync that completed (tokens commit there)
        #: and the schedule a joiner receives (:meth:`global_state`).
        self.completed_at = -1
        self.schedule = torch.zeros(0, dtype=torch.float64)

    def step(self, closure: Closure) -> StepStats:
        mark_failed_syncs(self.in_flight, self.runtime.quorum.members)
        stats = self.timed_inner_step(closure)
        t = self.step_index
        due = [s for s in self.in_flight if s.complete_at <= t]
        for sync in due:
            self.in_flight.remove(sync)
            self.complete(sync, t)  # finish_sync, outer step, compensated merge
        dropped = sum(sync.failed for sync in due)
        if dropped:
            stats.extras["syncs_dropped"] = float(dropped)
        p = self.fragment_due(t)
        if p is not None:
            sync = self.launch(p, t)
            stats.extras["synced_fragment"] = float(p)
            if self.options.overlap_steps == 0:
                self.in_flight.remove(sync)
                self.complete(sync, t)
        stats.extras["syncs_per_h"] = float(self.syncs_per_h)
        stats.extras["compensation_ratio"] = self.compensation_ratio
        return stats

    def timed_inner_step(self, closure: Closure) -> StepStats:
        """The inner step, its compute seconds folded into T_c's moving average."""
        before = self._compute_seconds()
        stats = self.inner_step(closure)
        after = self._compute_seconds()
        if before is not None and after is not None:
            measured = after - before
            self.step_seconds = (
                measured if self.step_seconds == 0 else 0.9 * self.step_seconds + 0.1 * measured
            )
        return stats

    def fragment_due(self, t: int) -> int | None:
        """The fragment to launch at step t (Alg. 2): one every h steps, none that would not
        complete before the end, none while a sync is in flight unless h >= tau."""
        tau = self.options.overlap_steps
        can_launch = not self.in_flight or self.interval >= tau
        if t % self.interval != 0 or t + tau > self.context.total_steps or not can_launch:
            return None
        in_flight = [s.fragment for s in self.in_flight]
        return select_fragment(
            t, self.last_sync_steps, self.rates, in_flight, self.options.sync_every
        )

    def launch(self, p: int, t: int) -> InFlight:
        """launch_sync of fragment p with this worker's (T_c, T_s) and the launch snapshot."""
        # (A sharded worker's ranks agree on their timings first, as a replicated
        # worker's do in its hierarchical mean: the fragment schedule follows them.)
        timings = [self.step_seconds, self.last_sync_seconds]
        extras = ranks_mean(self.flat, values_on(timings, self.flat.device))
        snapshot = self.local_fragment(p)
        # (A member lost since the last launch: the new quorum forms once it is detected.)
        members = self.runtime.enter_round().members
        exchange = self.launch_sync(p, extras)
        sync = InFlight(p, t, t + self.options.overlap_steps, exchange, snapshot, members)
        self.in_flight.append(sync)
        return sync

    def _compute_seconds(self) -> float | None:
        if self.clock is None:
            return None
        return self.clock.compute_seconds()

    def complete(self, sync: InFlight, t: int) -> None:
        """Wait; outer step; compensated merge; update R_p, t_{p,b}, and the agreed N."""
        mean, extras, _ = sync.exchange.wait()
        p = sync.fragment
        if sync.failed:
            # A member was lost while it flew: no outer step, and the local fragment merges
            # with the unchanged theta^g_p (streaming_diloco's rule); the schedule keeps its
            # state, which the failed mean would have updated.
            self.runtime.enter_round()
            assert sync.snapshot is not None
            self.set_local_fragment(p, self.merged(p, sync.snapshot))
            return
        self.completed_at = t
        if sync.exchange.sync_seconds is not None and self.clock is not None:
            self.last_sync_seconds = sync.exchange.sync_seconds
        self.outer_step(p, mean)
        assert sync.snapshot is not None
        now = self.local_fragment(p)
        merged = compensated_merge(
            self.globals_[p],
            sync.snapshot,
            now,
            overlap_steps=self.options.overlap_steps,
            compensation=self.options.compensation,
            sync_every=self.options.sync_every,
            sign=self.options.compensation_sign,
        )
        if self.options.overlap_steps > 0:
            # ||compensation|| / ||tau g^m|| (prediction D3 of docs/ALGORITHMS.md §7.3).
            plain = self.globals_[p] + (now - sync.snapshot)
            progress = whole_norm(self.flat, now - sync.snapshot)
            self.compensation_ratio = (
                whole_norm(self.flat, merged - plain) / progress if progress > 0 else 0.0
            )
        self.set_local_fragment(p, merged)
        # Eq. 11-12: the rate metric from the averaged outer gradient, then the last-sync step.
        self.rates[p] = whole_norm(self.flat, mean) / max(
            1, sync.launched_at - self.last_sync_steps[p]
        )
        self.last_sync_steps[p] = t
        if extras.numel() == 2 and float(extras[0]) > 0 and float(extras[1]) > 0:
            self.agreed_step_seconds = float(extras[0])
            self.agreed_sync_seconds = float(extras[1])
            self.syncs_per_h = syncs_per_period(
                self.num_fragments,
                self.options.transmission_gamma,
                self.options.sync_every,
                self.agreed_step_seconds,
                self.agreed_sync_seconds,
            )
            self.interval = max(1, self.options.sync_every // self.syncs_per_h)

    def merged(self, p: int, snapshot: torch.Tensor) -> torch.Tensor:
        """The compensated merge of local fragment p with theta^g_p as it stands."""
        return compensated_merge(
            self.globals_[p],
            snapshot,
            self.local_fragment(p),
            overlap_steps=self.options.overlap_steps,
            compensation=self.options.compensation,
            sync_every=self.options.sync_every,
            sign=self.options.compensation_sign,
        )

    def finish(self) -> None:
        for sync in list(self.in_flight):
            self.in_flight.remove(sync)
            self.complete(sync, self.step_index)

    # membership (declared faults) -----------------------------------------------------------

    def round_committed(self, stats: StepStats) -> bool:
        return self.completed_at == self.step_index

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        tensors, counters = super().global_state()
        self.schedule = torch.tensor(
            [*self.rates, *self.last_sync_steps, self.syncs_per_h, self.interval,
             self.agreed_step_seconds, self.agreed_sync_seconds, self.step_seconds,
             self.last_sync_seconds, self.compensation_ratio],
            dtype=torch.float64,
        )  # fmt: skip
        return [*tensors, (Role.OTHER, self.schedule)], counters

    def start_worker_state(self, *, kept: bool) -> None:
        super().start_worker_state(kept=kept)
        k = self.num_fragments
        values = self.schedule.tolist()
        self.rates = values[:k]
        self.last_sync_steps = [int(v) for v in values[k : 2 * k]]
        self.syncs_per_h, self.interval = int(values[2 * k]), int(values[2 * k + 1])
        (
            self.agreed_step_seconds,
            self.agreed_sync_seconds,
            self.step_seconds,
            self.last_sync_seconds,
            self.compensation_ratio,
        ) = values[2 * k + 2 :]

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """As streaming_diloco's: the members first finish their syncs in flight."""
        if joining:
            self.in_flight = []
        else:
            mark_failed_syncs(self.in_flight, self.runtime.quorum.members)
            completing = any(not sync.failed for sync in self.in_flight)
            self.finish()
            if completing:
                self.completed_at = self.step_index + 1  # (it commits at this step)
        super().heal(source, joining=joining, kept=kept)

    def in_flight_state(self) -> list[Any]:
        return [save_in_flight(sync) for sync in self.in_flight]

    def load_in_flight_state(self, saved: list[Any]) -> None:
        self.in_flight = [load_in_flight(item, self.restore_exchange) for item in saved]

    def extra_state_bytes(self) -> int:
        # The in-flight buffer and the launch snapshot of one fragment (Eq. 4 needs it).
        return 2 * 4 * max(f.numel for f in self.fragments)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "rates": list(self.rates),
            "last_sync_steps": list(self.last_sync_steps),
            "syncs_per_h": self.syncs_per_h,
            "step_seconds": self.step_seconds,
            "last_sync_seconds": self.last_sync_seconds,
            "agreed_step_seconds": self.agreed_step_seconds,
            "agreed_sync_seconds": self.agreed_sync_seconds,
            "compensation_ratio": self.compensation_ratio,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rates = [float(r) for r in state["rates"]]
        self.last_sync_steps = [int(s) for s in state["last_sync_steps"]]
        self.syncs_per_h = int(state["syncs_per_h"])
        self.interval = max(1, self.options.sync_every // self.syncs_per_h)
        self.step_seconds = float(state["step_seconds"])
        self.last_sync_seconds = float(state["last_sync_seconds"])
        self.agreed_step_seconds = float(state["agreed_step_seconds"])
        self.agreed_sync_seconds = float(state["agreed_sync_seconds"])
        self.compensation_ratio = float(state["compensation_ratio"])


METHODS: tuple[type[Strategy], ...] = (CoCoDC,)
