"""Delayed and eager outer steps (docs/ALGORITHMS.md §4.3-4.4): the outer all-reduce overlaps whole
inner phases.

Paper: "Eager Updates For Overlapped Communication and Computation in DiLoCo" (seed 003).
The paper's equations are lost; the rules below are docs/ALGORITHMS.md's reconstructions [R-hi].
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role, Settled
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, fragment_traffic
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


def quorum_eager_outer_gradient(
    stale_mean: torch.Tensor,
    fresh_own: torch.Tensor,
    stale_own: torch.Tensor,
    stale_size: int,
    fresh_size: int,
) -> torch.Tensor:
    """The eager outer gradient over quorums (docs/ALGORITHMS.md, "Membership"): each
    contribution weighs 1/|Q| of the quorum of its own round,

    Delta~_m^(t) = Delta^(t-N) - Delta_m^(t-N) / |Q_{t-N}| + Delta_m^(t) / |Q_t|,

    which is :func:`eager_outer_gradient` when both quorums have its M workers (then computed
    by it, to the bit)."""
    if stale_size == fresh_size:
        return eager_outer_gradient(stale_mean, fresh_own, stale_own, fresh_size)
    return stale_mean - stale_own / stale_size + fresh_own / fresh_size


@dataclass
class PendingSync:
    """A fragment's outer exchange in flight: launched at step ``launched_at`` over the
    quorum ``members``; ``failed``: a member of it was lost before it settled, so it fails
    on every member."""

    exchange: OuterExchange
    launched_at: int
    members: tuple[int, ...]
    failed: bool = False
    #: The workers whose Delta entered its mean (|Q| of its round; None: every member).
    size: int | None = None

    @property
    def weight(self) -> int:
        """|Q| of its round: what its mean divided by."""
        return len(self.members) if self.size is None else self.size


#: The delayed methods' membership rule (docs/ALGORITHMS.md, "Membership: quorum, commit and
#: healing"; the rows of eager and diloco_delayed).
DELAYED_MEMBERSHIP = MembershipRule(
    round="sync",
    global_state=(
        "the sending member's outer parameters phi_p and outer momentum of every fragment, "
        "the step, round and outer-step counters, and every exchange in flight (settled by "
        "the members first): its launch step, quorum and weight (|Q| of its round), whether "
        "it failed, its mean and for eager the sender's own contribution"
    ),
    worker_state=(
        "join: the local parameters start at phi_p and the inner AdamW afresh; rejoin: the "
        "same, the inner AdamW kept; the joiner's own exchanges from before it was lost are "
        "void"
    ),
)


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
        self.pending: list[deque[PendingSync]] = [deque() for _ in self.fragments]
        #: M, every worker slot (built with all of them; a quorum's group has its members').
        self.workers = comm.world_size
        #: Syncs settled since settled_syncs() was last read: (launch step, applied).
        self.settled: list[tuple[int, bool]] = []

    def step(self, closure: Closure) -> StepStats:
        self.mark_failed_syncs()
        stats = self.inner_step(closure)
        t = self.step_index
        dropped = 0
        for p, offset in enumerate(self.sync_offsets):
            if t >= offset and (t - offset) % self.options.sync_every == 0:
                dropped += self.sync_fragment(p)
                stats.extras["outer_step"] = 1.0
        if dropped:
            stats.extras["syncs_dropped"] = float(dropped)
        return stats

    def sync_fragment(self, p: int) -> int:
        """End of fragment p's inner phase: launch its exchange, apply the one N rounds old.
        Returns 1 when that one failed (a member of its quorum was lost while it flew): its
        mean is discarded on every member, and the outer step takes no part of it."""
        # (A member lost since the last launch: the new quorum forms once it is detected.)
        quorum = self.runtime.enter_round()
        members = quorum.members
        # (A quorum that forms only now, torchft's, may have lost a member of an exchange's
        # launch: it fails, as a loss seen at the step's start does.)
        self.mark_failed_syncs()
        # |Q_t|: the workers whose Delta enters the mean. A joiner healed at this round's
        # quorum sits it out where the engine says so (torchft: its payload is zeroed and
        # the mean divides by the others); it then contributes nothing, its own part too.
        size = min(len(members), self.comm.world_size)
        if quorum.joined and size < len(members):
            self.set_local_fragment(p, self.globals_[p])
        fresh_own = self.globals_[p] - self.local_fragment(p)
        launched = PendingSync(self.launch_sync(p), self.step_index, members, size=size)
        self.pending[p].append(launched)
        failed = 0
        if len(self.pending[p]) > self.options.outer_delay:
            sync = self.pending[p].popleft()
            stale_mean, _, stale_own = sync.exchange.wait()
            self.settled.append((sync.launched_at, not sync.failed))
            stale_size = sync.weight
            if sync.failed:
                failed = 1
                if not self.eager:  # no outer step: phi_p and its momentum unchanged
                    self.set_local_fragment(p, self.globals_[p])
                    return failed
                # Eager: the failed round's others' part is lost; the own fresh part of
                # this round is applied as in the first rounds.
                stale_mean = torch.zeros_like(fresh_own)
                stale_own = torch.zeros_like(fresh_own)
                stale_size = size
        elif self.eager:
            # First rounds [R-lo]: Delta^(0) = Delta_m^(0) = 0, a (1/M) Delta_m^(t) step.
            stale_mean = torch.zeros_like(fresh_own)
            stale_own = torch.zeros_like(fresh_own)
            stale_size = size
        else:
            # Naive delay, first rounds: no update (zero outer gradient); restart from phi_m.
            self.set_local_fragment(p, self.globals_[p])
            return failed
        if self.eager:
            update = quorum_eager_outer_gradient(stale_mean, fresh_own, stale_own, stale_size, size)
        else:
            update = stale_mean
        self.outer_step(p, update)
        self.set_local_fragment(p, self.globals_[p])
        return failed

    def finish(self) -> None:
        """Drain every in-flight exchange and apply it, oldest first [R-med].

        Naive delay applies Delta^(s). Eager already applied its own part of round s (fresh,
        1/|Q_s| Delta_m^(s)), so it applies the others' part, Delta^(s) - Delta_m^(s)/|Q_s|:
        every worker's contribution then enters phi_m exactly once. A failed exchange is
        discarded once its loss is detected."""
        self.mark_failed_syncs()
        for p, queue in enumerate(self.pending):
            while queue:
                sync = queue.popleft()
                mean, _, own = sync.exchange.wait()
                self.settled.append((sync.launched_at, not sync.failed))
                if sync.failed:
                    self.runtime.enter_round()  # (it fails when the loss is detected)
                    continue
                update = mean - own / sync.weight if self.eager else mean
                self.outer_step(p, update)
            self.set_local_fragment(p, self.globals_[p])

    # membership (declared faults) -----------------------------------------------------------

    def mark_failed_syncs(self) -> None:
        """Mark the exchanges in flight whose launch quorum lost a member: they fail on
        every member."""
        alive = set(self.runtime.quorum.members)
        for queue in self.pending:
            for sync in queue:
                if not set(sync.members) <= alive:
                    sync.failed = True

    def round_committed(self, stats: StepStats) -> bool:
        """Whether the step launched a sync (its tokens wait for that sync to settle)."""
        return stats.extras.get("outer_step") == 1.0

    def settled_syncs(self) -> list[tuple[int, bool]] | None:
        settled, self.settled = self.settled, []
        return settled

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """The members settle their exchanges in flight first (early, charged as their
        waits; they still apply each at its own round's end), so that the sender can pass
        them on: a joiner takes the sender's phi, outer momentum and exchanges in flight, so
        it applies the same outer steps at the same steps. A joiner's own exchanges from
        before it was lost are void."""
        if joining:
            self.pending = [deque() for _ in self.fragments]
            self.settled = []
        else:
            self.mark_failed_syncs()
            for queue in self.pending:
                for sync in queue:
                    if not sync.failed:
                        sync.exchange.wait()
        self.pass_in_flight(source, joining=joining)
        super().heal(source, joining=joining, kept=kept)

    def settle_moved(self) -> None:
        """Finish the data movement of every exchange in flight whose round has committed
        (:meth:`OuterExchange.settle_moved`): the live-membership engine calls it on every
        rank of a worker before it asks for a quorum whose healing sends them."""
        for queue in self.pending:
            for sync in queue:
                sync.exchange.settle_moved()

    def healing_payload(self) -> tuple[list[torch.Tensor], dict[str, int]]:
        """The global state and every exchange in flight, settled (an engine that heals at
        the next round's quorum has completed their collectives first): per exchange its
        mean, for eager the sender's own Delta, and its launch step, quorum and failure."""
        tensors, counters = super().healing_payload()
        for p, queue in enumerate(self.pending):
            counters[f"in_flight{p}"] = len(queue)
            for i, sync in enumerate(queue):
                mean, own = sync.exchange.moved_result()
                tensors.extend((mean, own) if self.eager else (mean,))
                key = f"in_flight{p}.{i}"
                counters[f"{key}.at"] = sync.launched_at
                counters[f"{key}.failed"] = int(sync.failed)
                counters[f"{key}.members"] = sum(1 << k for k in sync.members)
                counters[f"{key}.size"] = sync.weight
        return tensors, counters

    def take_healing_payload(self, tensors: list[torch.Tensor], counters: dict[str, int]) -> None:
        """The joiner applies the sender's exchanges in flight at the same steps; its own
        from before it was lost are void."""
        mine = len(self.global_state()[0])
        super().take_healing_payload(tensors[:mine], counters)
        received = iter(tensors[mine:])
        self.pending = [deque() for _ in self.fragments]
        self.settled = []
        for p, queue in enumerate(self.pending):
            for i in range(counters.get(f"in_flight{p}", 0)):
                mean = next(received).clone()
                own = next(received).clone() if self.eager else torch.zeros_like(mean)
                key = f"in_flight{p}.{i}"
                bits = counters[f"{key}.members"]
                members = tuple(k for k in range(self.workers) if bits >> k & 1)
                exchange = self.received_exchange(mean, own)
                # (Its weight, |Q| of its round, is the sender's: under torchft a member
                # healed in that round sat it out, so it can be fewer than its members.)
                weight = counters.get(f"{key}.size")
                queue.append(
                    PendingSync(
                        exchange, counters[f"{key}.at"], members, bool(counters[f"{key}.failed"]),
                        size=weight,
                    )
                )  # fmt: skip

    def pass_in_flight(self, source: int, *, joining: bool) -> None:
        """The sender's exchanges in flight to a joiner: their launch steps, quorums and
        failures and weights (a few numbers, uncharged), then each live one's mean and, for eager, the
        sender's own contribution (charged on the link)."""
        workers = self.workers
        counts = torch.tensor([float(len(q)) for q in self.pending], dtype=torch.float64)
        self.runtime.uncharged.broadcast(counts, src=source, role=Role.OTHER).wait()
        sizes = [int(c) for c in counts.tolist()]
        # (a row: launch step, failed, weight, then one column per worker slot: a member)
        header = torch.zeros(sum(sizes), 3 + workers, dtype=torch.float64)
        if not joining:
            rows = [sync for queue in self.pending for sync in queue]
            for row, sync in zip(header, rows, strict=True):
                row[0], row[1], row[2] = sync.launched_at, float(sync.failed), sync.weight
                row[3 + torch.tensor(sync.members, dtype=torch.long)] = 1.0
        if header.numel():
            self.runtime.uncharged.broadcast(header, src=source, role=Role.OTHER).wait()
        received: list[deque[PendingSync]] = []
        index = 0
        for p, size in enumerate(sizes):
            queue: deque[PendingSync] = deque()
            for i in range(size):
                row = header[index]
                index += 1
                failed = bool(row[1])
                if joining:
                    mean, own = (torch.zeros_like(self.globals_[p]) for _ in range(2))
                else:
                    mean, _, own = self.pending[p][i].exchange.wait()
                if not failed:
                    for tensor in (mean, own) if self.eager else (mean,):
                        into = tensor if joining else tensor.clone()
                        self.comm.broadcast(into, src=source, role=Role.PSEUDO_GRADIENT).wait()
                if joining:
                    members = tuple(int(k) for k in row[3:].nonzero().flatten().tolist())
                    exchange = self.received_exchange(mean, own)
                    queue.append(
                        PendingSync(exchange, int(row[0]), members, failed, size=int(row[2]))
                    )
            received.append(queue)
        if joining:
            self.pending = received

    def received_exchange(self, mean: torch.Tensor, own: torch.Tensor) -> OuterExchange:
        """An exchange whose result arrived whole (healing): waiting for it charges nothing."""
        state = {
            "mean": mean,
            "extras": torch.zeros(0),
            "own": own,
            "finish_time": None,
            "settled": Settled().state_dict(),
            "launch_time": None,
            "waited": True,
            "sync_seconds": 0.0,
        }
        return self.restore_exchange(state)

    def in_flight_state(self) -> list[Any]:
        """Each exchange in flight with its launch step, quorum, failure and weight (|Q| of
        its round: under torchft fewer than its members where one healed in it sat it out)."""
        return [
            [
                {**sync.exchange.state_dict(), "launched_at": sync.launched_at,
                 "members": list(sync.members), "failed": sync.failed, "size": sync.weight}
                for sync in queue
            ]
            for queue in self.pending
        ]  # fmt: skip

    def load_in_flight_state(self, saved: list[Any]) -> None:
        """Restore what :meth:`in_flight_state` saved. A checkpoint without an exchange's
        weight gets its members' count (every worker, M, where it has no members either),
        which is what such a checkpoint resumed with."""
        if len(saved) != len(self.pending):
            raise ValueError(
                f"{self.name}: the checkpoint has {len(saved)} fragments, this run "
                f"{len(self.pending)}; resume with the same --diloco.fragments"
            )
        everyone = tuple(range(self.workers))
        self.pending = [
            deque(
                PendingSync(
                    self.restore_exchange(item),
                    int(item.get("launched_at", -1)),
                    tuple(item.get("members", everyone)),
                    bool(item.get("failed", False)),
                    size=None if item.get("size") is None else int(item["size"]),
                )
                for item in queue
            )
            for queue in saved
        ]

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
    membership: ClassVar[MembershipRule | None] = DELAYED_MEMBERSHIP
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
    membership: ClassVar[MembershipRule | None] = DELAYED_MEMBERSHIP
    eager = True


METHODS: tuple[type[Strategy], ...] = (DiLoCoDelayed, Eager)
