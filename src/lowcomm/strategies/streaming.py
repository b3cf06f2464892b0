"""Streaming DiLoCo (docs/ALGORITHMS.md §4.2): fragments synchronized on a staggered schedule, each
all-reduce overlapping tau inner steps, merged with a mixing factor alpha.

Paper: Douillard et al. 2025, "Streaming DiLoCo with overlapping communication".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, fragment_traffic
from lowcomm.strategies.diloco import (
    DiLoCoOptions,
    OuterExchange,
    OuterLoopStrategy,
    default_fragment_count,
)

#: The fragmented methods' options for a short run (``quick_options``): DiLoCo's with H = 4. With
#: the default K = min(4, blocks) fragments, a model of 1 or 2 blocks then leaves each fragment
#: H/K > tau = 1 steps (H = 2 refused a 2-block model's 2 fragments), and 4 steps run a cycle.
QUICK_OPTIONS: Mapping[str, object] = {**OuterLoopStrategy.quick_options, "sync_every": 4}


def completion_offsets(sync_every: int, fragments: int) -> list[int]:
    """Step (mod H) at which fragment p's sync completes: (p+1) H / K, rounded down (torchft)."""
    return [((p + 1) * sync_every) // fragments for p in range(fragments)]


def check_overlap(
    options: DiLoCoOptions, model: nn.Module, default_fragments: int, method: str
) -> None:
    """tau must leave room for the staggered schedule: at most one fragment in flight.

    The fragment count is the one the strategy will use: ``options.fragments``, or the
    method's default capped at the model's number of blocks.
    """
    fragments = options.fragments or default_fragment_count(model, default_fragments)
    sync_every = options.sync_every
    if fragments > sync_every:
        raise ValueError(
            f"--diloco.fragments: {fragments} fragments do not fit in --diloco.sync-every "
            f"{sync_every} steps for {method}; pass at most {sync_every} fragments or a larger H"
        )
    gap = sync_every // fragments
    if options.overlap_steps >= gap:
        raise ValueError(
            f"--diloco.overlap-steps: {options.overlap_steps} must be < H/K = {sync_every}//"
            f"{fragments} = {gap} so that each fragment's all-reduce completes before the next "
            f"fragment's starts; lower tau, raise --diloco.sync-every or use fewer fragments"
        )


@dataclass
class InFlight:
    """A fragment sync launched at step ``launched_at`` that completes at ``complete_at``.

    ``members``: the quorum it was launched over (declared faults; empty when none is
    known); ``failed``: a member of it was lost while it was in flight, so it fails on every
    member (streaming_diloco's membership rule).
    """

    fragment: int
    launched_at: int
    complete_at: int
    exchange: OuterExchange
    snapshot: torch.Tensor | None = None
    members: tuple[int, ...] = ()
    failed: bool = False


def save_in_flight(sync: InFlight) -> dict[str, Any]:
    """A checkpointable record of a fragment sync in flight (its exchange settled now)."""
    state: dict[str, Any] = {
        "fragment": sync.fragment,
        "launched_at": sync.launched_at,
        "complete_at": sync.complete_at,
        "exchange": sync.exchange.state_dict(),
        "members": list(sync.members),
        "failed": sync.failed,
    }
    if sync.snapshot is not None:
        state["snapshot"] = sync.snapshot.clone()
    return state


def load_in_flight(
    state: dict[str, Any], restore: Callable[[dict[str, Any]], OuterExchange]
) -> InFlight:
    """The fragment sync :func:`save_in_flight` saved."""
    return InFlight(
        int(state["fragment"]),
        int(state["launched_at"]),
        int(state["complete_at"]),
        restore(state["exchange"]),
        state.get("snapshot"),
        tuple(int(k) for k in state.get("members", ())),
        bool(state.get("failed", False)),
    )


def mark_failed_syncs(in_flight: list[InFlight], members: tuple[int, ...]) -> None:
    """Mark the syncs in flight whose launch quorum lost a member (not all in ``members``,
    the current quorum): they fail on every member."""
    alive = set(members)
    for sync in in_flight:
        if sync.members and not set(sync.members) <= alive:
            sync.failed = True


class StreamingDiLoCo(OuterLoopStrategy[DiLoCoOptions]):
    """Streaming DiLoCo: K strided fragments, staggered syncs overlapping tau inner steps.

    Paper: Douillard et al. 2025 (docs/ALGORITHMS.md §4.2). Symbols: H -> options.sync_every,
    K -> options.fragments (default 4), tau -> options.overlap_steps, alpha -> options.mixing
    (the weight of the LOCAL parameters: theta_p <- alpha theta_p + (1-alpha) theta^g_p, torchft's
    convention; CoCoDC's Eq. 3 puts alpha on the global side, the same at 0.5), theta^g_p ->
    globals_[p]. Fragment p launches at steps t = (p+1)H/K - tau (mod H) and merges tau steps
    later; no sync starts within tau steps of the end; finish() drains one in flight.
    Reduces to: diloco with K=1, tau=0, alpha=0 (tests/test_diloco.py checks it).

    Elastic resume: as :class:`~lowcomm.strategies.diloco.OuterLoopStrategy`; fragments in
    flight are saved settled (their results are replicated and kept).
    """

    name: ClassVar[str] = "streaming_diloco"
    default_fragments: ClassVar[int] = 4
    quick_options: ClassVar[Mapping[str, object]] = QUICK_OPTIONS
    cost: ClassVar[CostModel] = CostModel(
        description="fragments overlap tau steps",
        # K fragments of Psi/K, each synced once per H, each overlapping tau inner steps.
        traffic=lambda o, t: fragment_traffic(
            o.fragments or StreamingDiLoCo.default_fragments,
            (o.fragments or StreamingDiLoCo.default_fragments) / o.sync_every,
            o.overlap_steps,
        ),
        schedule=lambda o: (
            f"H = {o.sync_every}, K = {o.fragments or StreamingDiLoCo.default_fragments} "
            f"fragments, tau = {o.overlap_steps}"
        ),
        extra_copies=2,
        shards_over_replicas=True,
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state=(
            "every fragment's global copy theta^g_p and outer momentum, the step, round and "
            "outer-step counters; the members first finish their syncs in flight, so a "
            "joiner receives them settled and starts with none in flight"
        ),
        worker_state=(
            "as diloco: join: every local fragment starts at theta^g_p and the inner AdamW "
            "afresh; rejoin: the same, the inner AdamW kept"
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
        tau = self.options.overlap_steps
        self.launch_offsets = [
            c - tau for c in completion_offsets(self.options.sync_every, self.num_fragments)
        ]
        self.in_flight: list[InFlight] = []
        #: Declared faults: the step of the last sync that completed (tokens commit there).
        self.completed_at = -1

    def step(self, closure: Closure) -> StepStats:
        self.mark_failed_syncs()
        stats = self.inner_step(closure)
        t = self.step_index
        dropped = sum(sync.failed for sync in self.in_flight if sync.complete_at <= t)
        completed = self.finish_syncs_due(t)
        launched = self.launch_syncs_due(t)
        stats.extras["syncs_completed"] = float(completed - dropped)
        stats.extras["syncs_launched"] = float(launched)
        if dropped:
            stats.extras["syncs_dropped"] = float(dropped)
        return stats

    def launch_syncs_due(self, t: int) -> int:
        """launch_sync of every fragment whose launch offset falls on step t (Alg. 1)."""
        tau = self.options.overlap_steps
        launched = 0
        for p, offset in enumerate(self.launch_offsets):
            if t < offset or (t - offset) % self.options.sync_every:
                continue
            if t + tau > self.context.total_steps:
                continue  # would not complete before the end (§4.2 edge case)
            # (A member lost since the last launch: the new quorum forms once it is detected.)
            members = self.runtime.enter_round().members
            self.in_flight.append(InFlight(p, t, t + tau, self.launch_sync(p), members=members))
            launched += 1
        if tau == 0:
            self.finish_syncs_due(t)
        return launched

    def finish_syncs_due(self, t: int) -> int:
        """finish_sync of every fragment whose tau steps of overlap end at step t."""
        due = [sync for sync in self.in_flight if sync.complete_at <= t]
        for sync in due:
            self.in_flight.remove(sync)
            self.complete(sync)
        return len(due)

    def complete(self, sync: InFlight) -> None:
        """Wait, step the fragment's outer optimizer, merge into the local fragment.

        A sync that failed (a member lost while it was in flight) takes no outer step: its
        result is discarded once the loss is detected, and the local fragment merges with
        the unchanged theta^g_p, as torchft's DiLoCo does when a sync does not commit (at
        alpha = 0 every member's fragment returns to the same theta^g_p, so no member keeps a
        round's drift the others dropped)."""
        mean, _, _ = sync.exchange.wait()
        p = sync.fragment
        if sync.failed:
            self.runtime.enter_round()  # (the exchange fails when the loss is detected)
        else:
            self.outer_step(p, mean)
            self.completed_at = self.step_index
        local = self.local_fragment(p)
        # lerp(global, local, alpha) = alpha local + (1 - alpha) global; exactly global at 0.
        self.set_local_fragment(p, torch.lerp(self.globals_[p], local, self.options.mixing))

    def finish(self) -> None:
        for sync in list(self.in_flight):
            self.in_flight.remove(sync)
            self.complete(sync)

    # membership (declared faults) -----------------------------------------------------------

    def mark_failed_syncs(self) -> None:
        """Mark the syncs in flight that lost a member: they fail on every member."""
        mark_failed_syncs(self.in_flight, self.runtime.quorum.members)

    def round_committed(self, stats: StepStats) -> bool:
        return self.completed_at == self.step_index

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """The members first finish their syncs in flight (early, charged as their waits),
        so the state they send is settled: the joiner took no part in those syncs and could
        not apply their outer steps. A joiner's own syncs from before it was lost are void."""
        if joining:
            self.in_flight = []
        else:
            self.mark_failed_syncs()
            completing = any(not sync.failed for sync in self.in_flight)
            self.finish()
            if completing:
                # (A sync finished early here commits at this step: its tokens would
                # otherwise wait for a later sync, which the run's last one never has.)
                self.completed_at = self.step_index + 1
        super().heal(source, joining=joining, kept=kept)

    def in_flight_state(self) -> list[Any]:
        return [save_in_flight(sync) for sync in self.in_flight]

    def load_in_flight_state(self, saved: list[Any]) -> None:
        self.in_flight = [load_in_flight(item, self.restore_exchange) for item in saved]

    def extra_state_bytes(self) -> int:
        # The in-flight buffer: one fragment's outer gradient (counted at the largest fragment).
        return 4 * max(f.numel for f in self.fragments) if self.options.overlap_steps > 0 else 0


METHODS: tuple[type[Strategy], ...] = (StreamingDiLoCo,)
