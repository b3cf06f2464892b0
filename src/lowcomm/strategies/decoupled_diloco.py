"""Decoupled DiLoCo (docs/ALGORITHMS.md, "Decoupled DiLoCo", reconstructed): learners that
never wait for each other, and a synchronizer that merges whichever fragments are in.

Every worker is a learner. It takes inner steps and, on Streaming DiLoCo's schedule (its own
step count), sends a fragment's outer gradient with its token and step counts to the
synchronizer: a message on its own link (``Runtime.message``), which arrives at its modeled
completion. The synchronizer (:class:`Synchronizer`) merges with
:mod:`lowcomm.strategies.decoupled_sync` (minimum quorum, grace window, token weighting, outer
Nesterov per fragment) and answers each learner with the new fragment, a message down the
learner's link from the merge (or, for a fragment that missed its merge, from its arrival). A
learner takes the reply at its first step boundary at least tau of its own steps after the
send at which the reply has arrived on its clock.

**Where the synchronizer runs.** It is a process of its own in the modeled system, reached
over each learner's link; the simulation charges exactly those messages, whatever it moves
to run it. With every learner a thread of one process, it is one object the threads share
(each deposits its tick's sends). With learners in worker processes (one each, or K threads
in each of several), every learner keeps a *replica*, and at each tick's end the members
all-gather, uncharged, their posts and their sends' counters and then each fragment that
someone sent (:meth:`DecoupledDiLoCo._exchange`): every replica submits the same
contributions in the same order (learner, then fragment) and so makes the same merges, bit
for bit, as the shared object. So the real bytes differ from the charged ones: each sent
fragment reaches all M learners rather than one synchronizer, and no reply moves (each
learner reads its replica), while the charge stays one fragment up the sender's link and one
reply down it. A replica keeps the replies of its own learner only. A learner outside the
quorum feeds nobody and its replica falls behind; when it joins or rejoins, the member that
heals it sends it its replica (uncharged; the modeled healing is Theta down the joiner's
link, charged as in one process). A checkpoint holds each process's replica.

**With live membership** (``--membership torchft``) every learner is a worker
process with a replica, and each tick's exchange is one torchft round
(:meth:`DecoupledDiLoCo._exchange_round`): a quorum, one all-gather of every participant's
post, counters and sent fragments (each row naming its learner, so the round's participants
are the tick's members), and a commit; a round that did not commit is tried again on a new
quorum, on every member alike. A learner lost is out at the next quorum, as a crash is here.
A joiner is healed at its quorum with a live learner's whole replica
(:meth:`DecoupledDiLoCo.healing_payload`), starts by the join rule, and sits out that round.
With R ranks per learner each rank's round moves its slice of the learner's row, and the
learner's ranks reassemble every row (:meth:`DecoupledDiLoCo._round_rows`). A checkpoint holds
the worker's replica, so a resumed job's workers go on from theirs, and one behind is healed.
On the real clock a joiner's process reads its clock from its own start, so the engine has it
take its healing source's clock (``compares_clocks``).

**Learners of several ranks** (``--ranks-per-worker R``, replicated). The R ranks of a
learner run this code alike on the same replica (their gradients averaged at each inner
step), each with a replica of the synchronizer fed over the uncharged two-level group. What a
rank reads off its own clock (its sends' arrivals, its posted clock, a reply's arrival) may
differ between the ranks on the real clock, so the ranks decide from what they agree on: the
gathered table's rows (each learner's from its ranks' slices, its own included) and a reply
taken once it is in on every rank's clock.
A message travels as a worker's collectives do: each rank charges its 1/R slice on its own
outer link, and a reply's slices are reassembled by an all-gather over the learner's ranks,
charged on the inner link (:meth:`DecoupledDiLoCo._reassembled`). A contribution counts the
learner's tokens, R times a rank's.

**Ticks.** The training loop calls ``step()`` once per loop step on every learner; here a loop
step is a *tick* of the run, and a learner takes an inner step at a tick only when it is not
ahead of the others: when its clock is at most the earliest clock of the learners that are not
waiting, or less than one nominal step (the fastest learner's last inner step) past it. A
learner three times slower takes an inner step every third tick, so at equal modeled time it
has computed a third of the tokens and no learner ever waits for it. A tick in which a learner
takes no step reports no micro-batch, no token and a NaN loss (the loop leaves such rows out
of the step's record).

**Determinism.** The threads run in any order; everything the synchronizer decides is decided
between two points every learner passes together: at the end of each tick every learner posts
its clock and its last reply's transfer time on the uncharged group (an all-gather over the
tick's members, after its sends of the tick). A learner's clock then bounds its later sends:
each arrives after it. A merge at time t is applied once every live learner either has its
fresh fragment in or a clock of at least t (nothing it sends later can arrive by t), and every
learner applies the same merges at the same tick, whichever thread does it first. So a
straggler never blocks a merge past the time the others reach, and metrics and evaluation (the
loop's own collectives, between ticks) never meet a learner waiting inside the synchronizer.

**Deployed model** (evaluation, the final model): the synchronizer's global fragments Theta_p
at that tick, the same on every learner.
"""

from __future__ import annotations

import io
import math
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import nn

from lowcomm.comm.base import CollectiveKind, Comm, Handle, Role, Settled
from lowcomm.optim.outer import OuterNesterov
from lowcomm.strategies.base import (
    Closure,
    StepStats,
    Strategy,
    StrategyContext,
    zeroed_tensors,
)
from lowcomm.strategies.declaration import (
    CostModel,
    MembershipRule,
    QuantizedExchange,
    fragment_traffic,
)
from lowcomm.strategies.decoupled_sync import (
    GRACE_KINDS,
    LATE_POLICIES,
    WEIGHTINGS,
    Contribution,
    GraceKind,
    GraceRule,
    LatePolicy,
    Weighting,
    decide_merge,
    merged_outer_gradient,
)
from lowcomm.strategies.diloco import (
    PAPER_OUTER,
    OuterLoopStrategy,
    default_fragment_count,
    scaled_outer,
)
from lowcomm.strategies.local_update import RoundOptions
from lowcomm.strategies.streaming import completion_offsets

#: Why a sharded worker (--worker-sharding fsdp) is refused (one clause).
WHOLE_FRAGMENTS = (
    "a learner sends and takes whole fragments of its replica, which FSDP's shards of the "
    "model do not hold"
)


@dataclass(kw_only=True)
class DecoupledOptions(RoundOptions):
    """Options of decoupled_diloco: Streaming DiLoCo's period, fragments, overlap, mixing and
    outer step (the same meaning and defaults as --diloco.*), and the synchronizer's quorum,
    grace window, weighting and late policy."""

    group: ClassVar[str] = "decoupled"

    sync_every: int = 16
    """H: a learner's inner steps between two sends of one fragment."""

    outer_lr: float | None = None
    """eta_out: the synchronizer's outer learning rate (None: from H by
    --decoupled.outer-defaults)."""

    outer_momentum: float | None = None
    """mu: the synchronizer's outer momentum, 0 = plain outer SGD (None: from H by
    --decoupled.outer-defaults)."""

    outer_nesterov: bool = True
    """Nesterov form of the outer momentum (False = heavy ball)."""

    outer_defaults: Literal["scaled", "paper"] = "scaled"
    """What an unset --decoupled.outer-lr / --decoupled.outer-momentum takes: scaled (from H,
    as --diloco.outer-defaults scaled) or paper (DiLoCo's eta_out 0.7, mu 0.9)."""

    fragments: int | None = None
    """K: number of strided fragments (None: 4, capped at the model's transformer blocks)."""

    overlap_steps: int = 1
    """tau: inner steps a learner computes between sending a fragment and needing its reply
    (0: it waits for the reply; one fragment only)."""

    mixing: float = 0.5
    """alpha: weight of the LOCAL parameters when a reply is taken, theta <- alpha * local +
    (1 - alpha) * Theta (0 takes the synchronizer's fragment)."""

    min_quorum: int = 1
    """K_q: fresh fragments the synchronizer needs before it merges (at most --workers; while
    fewer learners are live, no fragment merges and the learners go on alone)."""

    grace: GraceKind = "adaptive"
    """The grace window after the quorum: adaptive (gamma times the slack the overlap leaves),
    fixed (--decoupled.grace-seconds) or none (merge as soon as the quorum is in)."""

    grace_gamma: float = 0.5
    """gamma: the share of the slack the adaptive window may spend, in [0, 1)."""

    grace_seconds: float | None = None
    """The fixed window in seconds, or the adaptive window's cap (None: no cap)."""

    weighting: Weighting = "paper"
    """A learner's weight: paper (tokens x tokens per step), tokens, or equal."""

    late: LatePolicy = "next"
    """A fragment that misses its merge: next (merged into the fragment's next merge) or drop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, value, choices in (
            ("--decoupled.outer-defaults", self.outer_defaults, ("scaled", "paper")),
            ("--decoupled.weighting", self.weighting, WEIGHTINGS),
            ("--decoupled.late", self.late, LATE_POLICIES),
            ("--decoupled.grace", self.grace, GRACE_KINDS),
        ):
            if value not in choices:
                raise ValueError(
                    f"{flag}: {value!r} is unknown; choose one of {', '.join(choices)}"
                )
        if self.fragments is not None and self.fragments < 1:
            raise ValueError(
                f"--decoupled.fragments: {self.fragments} must be >= 1; pass e.g. 4, or None "
                "for the default"
            )
        if self.overlap_steps < 0:
            raise ValueError(
                f"--decoupled.overlap-steps: {self.overlap_steps} must be >= 0; pass e.g. 1"
            )
        if not 0.0 <= self.mixing <= 1.0:
            raise ValueError(
                f"--decoupled.mixing: {self.mixing} must lie in [0, 1] (weight of the local "
                "parameters); try 0.5"
            )
        if self.min_quorum < 1:
            raise ValueError(
                f"--decoupled.min-quorum: {self.min_quorum} must be at least 1; 1 merges as "
                "soon as any learner's fragment is in"
            )
        self.grace_rule()  # (its own one-line checks)

    def outer(self) -> tuple[float, float]:
        """(eta_out, mu) of the synchronizer's outer steps, as :meth:`DiLoCoOptions.outer`."""
        lr, momentum = (
            scaled_outer(self.sync_every) if self.outer_defaults == "scaled" else PAPER_OUTER
        )
        return (
            lr if self.outer_lr is None else self.outer_lr,
            momentum if self.outer_momentum is None else self.outer_momentum,
        )

    def grace_rule(self) -> GraceRule:
        """The synchronizer's :class:`GraceRule` from these options."""
        return GraceRule(
            kind=self.grace,
            gamma=self.grace_gamma,
            overlap_steps=self.overlap_steps,
            cap=self.grace_seconds,
        )


@dataclass(frozen=True)
class MergeRecord:
    """One applied merge, as the synchronizer logged it (for tests and reports)."""

    fragment: int
    version: int
    merge_time: float
    tick: int
    included: tuple[tuple[int, int], ...]
    """(learner, base version) of each merged contribution, fresh ones first."""
    weights: tuple[float, ...]
    dropped: tuple[tuple[int, int], ...]
    """(learner, base version) of late contributions discarded at this merge (late drop)."""


@dataclass(frozen=True)
class Reply:
    """The synchronizer's answer to a contribution: it leaves at ``leaves`` (the merge, or the
    arrival of a contribution that missed its merge) with version ``version`` of the fragment;
    ``merged``: the contribution's tokens are (or will be, under ``late next``) committed."""

    leaves: float
    version: int
    values: torch.Tensor
    merged: bool


@dataclass(frozen=True)
class _Pending:
    ticket: int
    contribution: Contribution


#: A contribution as a tick hands it to the synchronizer: (fragment, contribution, the
#: sender's last inner step in seconds).
Sent = tuple[int, Contribution, float]


class Posted(NamedTuple):
    """What a learner posts at a tick's end: its clock (a bound on its later sends' arrivals),
    whether it waits for a reply, its last inner step's seconds (xi_step) and its last
    reply's transfer seconds (xi_sync)."""

    learner: int
    clock: float
    waiting: bool
    step_s: float
    sync_s: float


@dataclass(frozen=True)
class Pace:
    """What the learners agreed at a tick's end: the clocks of those not waiting, the nominal
    step (the shortest last inner step), and whether any learner waits for a reply."""

    clocks: tuple[tuple[int, float], ...] = ()
    nominal: float = 0.0
    waiting: bool = False

    def earliest(self, members: tuple[int, ...]) -> float:
        """The earliest posted clock among ``members`` (this tick's quorum: a learner lost
        since then no longer sets the pace); -inf when none of them posted one."""
        posted = dict(self.clocks)
        return min((posted[m] for m in members if m in posted), default=-math.inf)


class Synchronizer:
    """The global fragments Theta_p, their outer optimizers and versions, the contributions
    not yet merged, and what the learners posted at the last tick; shared by the learners of
    one process, or one replica per learner in worker processes (every method takes its
    lock).

    ``owners``: the learners whose replies this copy answers (None: every learner). A replica
    answers its own learner only, so it keeps only the versions that learner's replies may
    still need; everything a merge reads is the same in every replica."""

    def __init__(
        self, globals_: list[torch.Tensor], *, learners: int, options: DecoupledOptions,
        owners: Collection[int] | None = None,
    ) -> None:  # fmt: skip
        lr, momentum = options.outer()
        self.lock = threading.Lock()
        self.learners = learners
        self.owners = None if owners is None else frozenset(owners)
        self.options = options
        self.grace = options.grace_rule()
        self.params = [g.detach().clone() for g in globals_]
        self.outer = [
            OuterNesterov(p, lr=lr, momentum=momentum, nesterov=options.outer_nesterov)
            for p in self.params
        ]
        self.version = [0] * len(self.params)
        #: Per fragment, version -> (time it exists at the synchronizer, values): the versions
        #: a reply not yet taken may still need (older ones are dropped, :meth:`_prune`).
        self.history: list[dict[int, tuple[float, torch.Tensor]]] = [
            {0: (-math.inf, p.clone())} for p in self.params
        ]
        #: ticket -> (fragment, learner, arrival) of every contribution not yet answered.
        self.unreplied: dict[int, tuple[int, int, float]] = {}
        self.pending: list[list[_Pending]] = [[] for _ in self.params]
        #: Contributions the learners of one process deposited during a tick, submitted at its
        #: end (:meth:`advance`), and the tickets it gave: (learner, fragment) -> ticket.
        self.inbox: list[Sent] = []
        self.issued: dict[tuple[int, int], int] = {}
        #: ticket -> (fragment, learner, merge time, new version) of merged fresh ones.
        self.merged: dict[int, tuple[int, int, float, int]] = {}
        self.tickets = 0
        #: The last tick whose merges are applied, and its members' clocks.
        self.tick = -1
        self.live: tuple[int, ...] = tuple(range(learners))
        self.horizon = -math.inf
        self.pace = Pace()
        self.finished = False
        self.restored = False
        self.step_time = [0.0] * learners
        self.sync_time = [0.0] * learners
        self.log: list[MergeRecord] = []
        self.committed_tokens = 0
        self.dropped_tokens = 0
        self.discarded_tokens = 0

    # --- learners' calls -------------------------------------------------------------------

    def submit(self, p: int, contribution: Contribution, step_time: float) -> int:
        """Take a contribution of fragment p; its ticket names it in :meth:`reply`."""
        with self.lock:
            return self._submit(p, contribution, step_time)

    def deposit(self, p: int, contribution: Contribution, step_time: float) -> None:
        """Leave a contribution for this tick's :meth:`advance` to submit (the learners of one
        process sharing this synchronizer, during the tick)."""
        with self.lock:
            self.inbox.append((p, contribution, step_time))

    def advance(
        self,
        tick: int,
        rows: Sequence[tuple[int, float, bool, float, float]],
        sent: Sequence[Sent] = (),
    ) -> None:
        """Submit the tick's contributions (``sent`` and the deposited ones, in learner and
        fragment order: their tickets, in :attr:`issued`, are the same in every replica),
        then apply every merge decided by the end of ``tick``; ``rows`` are the tick's
        members' :class:`Posted`. The first learner to call it for a tick does the work; the
        others find it done."""
        with self.lock:
            if tick <= self.tick or self.finished:
                return
            self.tick = tick
            posts = [Posted(*row) for row in rows]
            self._enter(tuple(sorted(row.learner for row in posts)))
            for row in posts:
                self.sync_time[row.learner] = row.sync_s
            arrived = sorted([*self.inbox, *sent], key=lambda s: (s[1].learner, s[0]))
            self.inbox = []
            self.issued = {(c.learner, p): self._submit(p, c, step) for p, c, step in arrived}
            bounds = {row.learner: row.clock for row in posts}
            stepping = [(row.learner, row.clock) for row in posts if not row.waiting]
            steps = [row.step_s for row in posts if row.step_s > 0]
            self.pace = Pace(
                clocks=tuple(stepping or bounds.items()),
                nominal=min(steps, default=0.0),
                waiting=any(row.waiting for row in posts),
            )
            self.horizon = min(bounds.values())
            self._merge_decided(bounds, tick)
            self._prune()

    def finish(self, sync_times: Mapping[int, float] | None = None) -> None:
        """No learner sends again: apply every merge that can still form (``sync_times``: the
        live learners' last xi_sync, posted since the last tick)."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
            for learner, seconds in (sync_times or {}).items():
                self.sync_time[learner] = seconds
            self.horizon = math.inf
            self._merge_decided({m: math.inf for m in self.live}, self.tick + 1)

    def reply(self, p: int, ticket: int, c: Contribution) -> Reply | None:
        """The reply to contribution ``c`` (ticket ``ticket``) of fragment p, or None while it
        is not decided. Merged: it leaves at the merge with the new version. Missed its merge
        (late): it leaves at its arrival with the version then current, once every merge up
        to its arrival is applied."""
        with self.lock:
            found = self.merged.pop(ticket, None)
            if found is not None:
                _, _, at, version = found
                self.unreplied.pop(ticket, None)
                return Reply(at, version, self.history[p][version][1], True)
            if self.version[p] > c.base_version and c.arrival <= self.horizon:
                version = self._version_at(p, c.arrival)
                merged = self.options.late == "next"
                self.unreplied.pop(ticket, None)
                return Reply(c.arrival, version, self.history[p][version][1], merged)
            return None

    def snapshot(self) -> tuple[list[torch.Tensor], list[int], int]:
        """Copies of every Theta_p, their versions, and the last tick applied."""
        with self.lock:
            return [p.clone() for p in self.params], list(self.version), self.tick

    def state_dict(self) -> dict[str, Any]:
        """Everything the synchronizer holds but its log (for a checkpoint between ticks)."""
        with self.lock:
            return {
                "learners": self.learners,
                "params": [p.clone() for p in self.params],
                "outer": [o.state_dict() for o in self.outer],
                "version": list(self.version),
                "history": [
                    {v: (at, values.clone()) for v, (at, values) in h.items()} for h in self.history
                ],
                "unreplied": dict(self.unreplied),
                "pending": [
                    [(e.ticket, _contribution_state(e.contribution)) for e in pending]
                    for pending in self.pending
                ],
                "merged": dict(self.merged),
                "tickets": self.tickets,
                "tick": self.tick,
                "live": list(self.live),
                "horizon": self.horizon,
                "pace": (self.pace.clocks, self.pace.nominal, self.pace.waiting),
                "finished": self.finished,
                "step_time": list(self.step_time),
                "sync_time": list(self.sync_time),
                "tokens": (self.committed_tokens, self.dropped_tokens, self.discarded_tokens),
            }

    def shared_state(self) -> dict[str, Any]:
        """What every replica holds alike, bit for bit (a joiner's healing payload): the
        state without the replies this replica keeps for its own learner, and with only the
        versions from the one current at the horizon on, which every replica keeps (a reply
        to a contribution sent later may need them; older ones only this replica's learner's
        replies). A joiner takes no reply of another learner's, so it loses nothing; and a
        joining worker of R ranks may take each rank's slice of these bytes from another
        live worker."""
        state = self.state_dict()
        with self.lock:
            floors = [self._version_at(p, self.horizon) for p in range(len(self.params))]
        state["unreplied"], state["merged"] = {}, {}
        state["history"] = [
            {v: history[v] for v in sorted(history) if v >= floor}
            for history, floor in zip(state["history"], floors, strict=True)
        ]
        return state

    def load_state_dict(self, state: dict[str, Any], *, once: bool = True) -> None:
        """Take a checkpoint's state (or a live replica's), keeping the replies of
        :attr:`owners` only. ``once``: the first learner of a process to load it restores
        it; each other one adds the replies and versions its state holds that are not in yet
        (a checkpoint of replicas holds each learner's own replies only)."""
        with self.lock:
            if once and self.restored:
                self._add_replies(state)
                return
            if int(state["learners"]) != self.learners:
                raise ValueError(
                    f"--resume: the checkpoint's decoupled_diloco synchronizer has "
                    f"{state['learners']} learners and this run {self.learners}; decoupled_diloco "
                    f"resumes on the same --workers only (pass --workers {state['learners']})"
                )
            self.restored = True
            self._load_globals(state)
            self.unreplied = {
                int(k): v for k, v in state["unreplied"].items() if self._owns(int(v[1]))
            }
            self.pending = [
                [_Pending(int(t), _contribution_of(c)) for t, c in pending]
                for pending in state["pending"]
            ]
            self.merged = {int(k): v for k, v in state["merged"].items() if self._owns(int(v[1]))}
            self.tickets = int(state["tickets"])
            self.tick = int(state["tick"])
            self.live = tuple(int(m) for m in state["live"])
            self.horizon = float(state["horizon"])
            clocks, nominal, waiting = state["pace"]
            self.pace = Pace(
                tuple((int(m), float(c)) for m, c in clocks), float(nominal), bool(waiting)
            )
            # (A finished run's final checkpoint holds its drain, done: a resume that extends
            # it with more --steps submits and merges again, from that drained state.)
            self.finished = False
            self.step_time = [float(x) for x in state["step_time"]]
            self.sync_time = [float(x) for x in state["sync_time"]]
            self.committed_tokens, self.dropped_tokens, self.discarded_tokens = state["tokens"]

    def _load_globals(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's global state, whatever its learners: Theta_p, the outer
        optimizers, the versions and their history."""
        for mine, saved in zip(self.params, state["params"], strict=True):
            mine.copy_(saved)
        for outer, saved in zip(self.outer, state["outer"], strict=True):
            outer.load_state_dict(saved)
        self.version = [int(v) for v in state["version"]]
        self.history = [
            {int(v): (float(at), values.clone()) for v, (at, values) in h.items()}
            for h in state["history"]
        ]

    def load_remapped(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state written for another number of learners (an elastic
        resume; the first learner of a process to call it does the work). Theta_p, the outer
        optimizers, the versions and their history, the last tick and its horizon, and the
        token counts are kept; the contributions not yet merged and the replies not yet
        taken are dropped, since their learners are not this run's (their tokens are counted
        discarded), and no learner has posted a clock yet."""
        with self.lock:
            if self.restored:
                return
            self.restored = True
            self._load_globals(state)
            self.tickets = int(state["tickets"])
            self.tick = int(state["tick"])
            self.horizon = float(state["horizon"])
            committed, dropped, discarded = (int(n) for n in state["tokens"])
            pending = sum(int(c["tokens"]) for queue in state["pending"] for _, c in queue)
            self.committed_tokens, self.dropped_tokens = committed, dropped
            self.discarded_tokens = discarded + pending

    # --- with the lock held ----------------------------------------------------------------

    def _add_replies(self, state: dict[str, Any]) -> None:
        """The replies not yet taken, and the versions they may need, of another learner's
        copy of this state (the same merges: an entry held by both is the same)."""
        for k, v in state["unreplied"].items():
            if self._owns(int(v[1])):
                self.unreplied.setdefault(int(k), v)
        for k, v in state["merged"].items():
            if self._owns(int(v[1])):
                self.merged.setdefault(int(k), v)
        for mine, saved in zip(self.history, state["history"], strict=True):
            for v, (at, values) in saved.items():
                mine.setdefault(int(v), (float(at), values.clone()))

    def _owns(self, learner: int) -> bool:
        return self.owners is None or learner in self.owners

    def _submit(self, p: int, contribution: Contribution, step_time: float) -> int:
        ticket = self.tickets
        self.tickets += 1
        self.pending[p].append(_Pending(ticket, contribution))
        if self._owns(contribution.learner):
            self.unreplied[ticket] = (p, contribution.learner, contribution.arrival)
        self.step_time[contribution.learner] = step_time
        return ticket

    def _enter(self, live: tuple[int, ...]) -> None:
        """The tick's members are the live learners: a learner lost since the last tick takes
        its contributions not yet merged with it (its tokens are not committed)."""
        if live == self.live:
            return
        gone = set(self.live) - set(live)
        self.live = live
        for p, pending in enumerate(self.pending):
            lost = [e for e in pending if e.contribution.learner in gone]
            self.discarded_tokens += sum(e.contribution.tokens for e in lost)
            self.pending[p] = [e for e in pending if e.contribution.learner not in gone]
        self.merged = {t: v for t, v in self.merged.items() if v[1] not in gone}
        self.unreplied = {t: v for t, v in self.unreplied.items() if v[1] not in gone}

    def _version_at(self, p: int, time: float) -> int:
        """The latest version of fragment p the synchronizer held at ``time``."""
        return max(v for v, (at, _) in self.history[p].items() if at <= time)

    def _prune(self) -> None:
        """Drop the versions no reply can still take: a reply not yet taken leaves at or
        after its contribution's arrival, and a contribution sent later arrives after the
        horizon, so every version older than the one current at the earliest of those is
        unused."""
        for p, history in enumerate(self.history):
            waits = [arrival for q, _, arrival in self.unreplied.values() if q == p]
            floor = self._version_at(p, min([self.horizon, *waits]))
            for v in [v for v in history if v < floor]:
                del history[v]

    def _fresh(self, p: int) -> list[_Pending]:
        v = self.version[p]
        return sorted(
            (e for e in self.pending[p] if e.contribution.base_version == v),
            key=lambda e: (e.contribution.arrival, e.contribution.learner),
        )

    def _merge_decided(self, bounds: dict[int, float], tick: int) -> None:
        quorum = self.options.min_quorum
        progressed = True
        while progressed:
            progressed = False
            for p in range(len(self.params)):
                fresh = self._fresh(p)
                if not fresh:
                    continue
                first = fresh[0].contribution.learner
                arguments: dict[str, Any] = {
                    "min_quorum": quorum,
                    "live": self.live,
                    "grace": self.grace,
                    "step_time": self.step_time[first],
                    "sync_time": self.sync_time[first],
                    "weighting": self.options.weighting,
                }
                probe = decide_merge([e.contribution for e in fresh], **arguments)
                if probe is None:
                    continue
                t = probe.merge_time
                senders = {e.contribution.learner for e in fresh}
                if any(bounds.get(m, -math.inf) < t for m in self.live if m not in senders):
                    continue  # (a learner may still send a fragment that arrives by t)
                self._apply(p, fresh, t, tick, arguments)
                progressed = True

    def _apply(
        self, p: int, fresh: list[_Pending], t: float, tick: int, arguments: dict[str, Any]
    ) -> None:
        v = self.version[p]
        late = sorted(
            (
                e
                for e in self.pending[p]
                if e.contribution.base_version < v and e.contribution.arrival <= t
            ),
            key=lambda e: (e.contribution.arrival, e.contribution.learner),
        )
        carried = late if self.options.late == "next" else []
        decision = decide_merge(
            [e.contribution for e in fresh],
            carried=[e.contribution for e in carried],
            **arguments,
        )
        assert decision is not None and decision.merge_time == t
        delta = merged_outer_gradient(decision.included, decision.weights)
        self.outer[p].step(delta)
        self.version[p] = v + 1
        self.history[p][v + 1] = (t, self.params[p].clone())
        included = {id(c) for c in decision.included}
        for e in fresh:
            if id(e.contribution) in included and self._owns(e.contribution.learner):
                self.merged[e.ticket] = (p, e.contribution.learner, t, v + 1)
        gone = included | {id(e.contribution) for e in late}
        self.pending[p] = [e for e in self.pending[p] if id(e.contribution) not in gone]
        self.committed_tokens += sum(c.tokens for c in decision.included)
        dropped = [] if self.options.late == "next" else late
        self.dropped_tokens += sum(e.contribution.tokens for e in dropped)
        self.log.append(
            MergeRecord(
                fragment=p,
                version=v + 1,
                merge_time=t,
                tick=tick,
                included=tuple((c.learner, c.base_version) for c in decision.included),
                weights=decision.weights,
                dropped=tuple(
                    (e.contribution.learner, e.contribution.base_version) for e in dropped
                ),
            )
        )


def _contribution_state(c: Contribution) -> dict[str, Any]:
    return {
        "learner": c.learner, "outer_gradient": c.outer_gradient.clone(), "tokens": c.tokens,
        "steps": c.steps, "arrival": c.arrival, "base_version": c.base_version,
    }  # fmt: skip


def _contribution_of(state: dict[str, Any]) -> Contribution:
    return Contribution(
        learner=int(state["learner"]), outer_gradient=state["outer_gradient"].clone(),
        tokens=int(state["tokens"]), steps=int(state["steps"]), arrival=float(state["arrival"]),
        base_version=int(state["base_version"]),
    )  # fmt: skip


#: Per fragment, the counters a learner posts of a send: sent (1) or not (0), tokens, steps,
#: arrival, base version, and its last inner step's seconds.
_SENT_FIELDS = 6

#: One synchronizer per in-process group: its learners are that group's threads.
_SHARED: weakref.WeakKeyDictionary[object, Synchronizer] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


@dataclass
class Outstanding:
    """A contribution sent and not yet answered, with its reply once it is known."""

    launched_at: int
    ticket: int
    contribution: Contribution
    reply: Reply | None = None
    reply_done: float | None = None
    reply_handle: Handle | None = None


class DecoupledDiLoCo(OuterLoopStrategy[DecoupledOptions]):
    """Decoupled DiLoCo: learners on Streaming DiLoCo's fragment schedule that never wait for
    each other; a shared synchronizer merges a fragment once the minimum quorum is in, after a
    grace window, weighted by tokens, with the fragment's outer Nesterov step.

    Paper: Douillard, Rush, Donchev, Charles et al. 2026, "Decoupled DiLoCo for Resilient
    Distributed Pre-training" (arXiv 2604.21428; docs/ALGORITHMS.md, "Decoupled DiLoCo",
    reconstructed). Symbols: K_q -> options.min_quorum, gamma -> options.grace_gamma,
    w_{m,p} -> options.weighting, H -> options.sync_every, K -> options.fragments (default
    4), tau -> options.overlap_steps, alpha -> options.mixing, Theta_p ->
    Synchronizer.params[p], the learner's base version b_p -> self.base[p] (its copy
    Theta_p^(b) is globals_[p]).
    Reduces to: diloco with K_q = M, grace none, equal tokens, K = 1, tau = 0, alpha = 0; to
    streaming_diloco with K fragments whenever every reply arrives within the overlap
    (tests/test_decoupled_diloco.py checks both, parameters bit for bit).

    Placement: every worker a thread of one process (one shared synchronizer), a process of
    its own, or one of K threads in each of several processes (a replica of the synchronizer
    per learner; the same numbers, see the module docstring), on either clock, with or
    without faults, launched by ``lowcomm train`` or torchrun; a worker of several replicated
    ranks too (sharded, refused in one line); with ``--membership torchft`` (a round per
    tick, see the module docstring). Resume:
    exact on the same workers (every learner's checkpoint holds the synchronizer's state, or
    its replica's, too); on another worker count, remapped (:meth:`_load_remapped`: the
    synchronizer's global state kept, the fragments not yet merged dropped, every learner
    started by the join rule).
    """

    name: ClassVar[str] = "decoupled_diloco"
    options_field: ClassVar[str | None] = "decoupled"
    default_fragments: ClassVar[int] = 4
    quick_options: ClassVar[Mapping[str, object]] = {"sync_every": 4}
    quantized_exchange: ClassVar[QuantizedExchange | None] = None
    reshard_remaps: ClassVar[bool] = True
    #: Its synchronizer merges by comparing the learners' clocks: on the real clock a joiner
    #: healed by an engine (torchft) takes its healing source's clock, since its own process
    #: reads its clock from its own start, behind the job's.
    compares_clocks: ClassVar[bool] = True
    sharding_refusal: ClassVar[str | None] = WHOLE_FRAGMENTS
    comm_dtypes: ClassVar[tuple[str, ...]] = ("fp32",)
    comm_dtype_refusal: ClassVar[str | None] = (
        "its fragments reach the synchronizer as float32 and are charged so"
    )
    cost: ClassVar[CostModel] = CostModel(
        description="fragments sent to a synchronizer, no barrier",
        # Each fragment up and back once per H: a ring all-reduce's bytes of Psi/K (the
        # synchronizer sharded M ways), overlapping tau inner steps.
        traffic=lambda o, t: fragment_traffic(
            o.fragments or DecoupledDiLoCo.default_fragments,
            (o.fragments or DecoupledDiLoCo.default_fragments) / o.sync_every,
            o.overlap_steps,
        ),
        schedule=lambda o: (
            f"H = {o.sync_every}, K = {o.fragments or DecoupledDiLoCo.default_fragments} "
            f"fragments, tau = {o.overlap_steps}, quorum {o.min_quorum}, grace {o.grace}"
        ),
        extra_copies=2,
        shards_over_replicas=True,
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state=(
            "the synchronizer's, not a learner's: every fragment's Theta_p, sent to a joiner "
            "from the synchronizer over the joiner's link"
        ),
        worker_state=(
            "join: the local parameters start at Theta, the inner AdamW afresh, the counters at "
            "0 and no fragment in flight; rejoin: the learner keeps its (stale) parameters and "
            "inner AdamW, and its first send of each fragment is late"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: DecoupledOptions | None = None,
    ) -> None:
        options = options or DecoupledOptions()
        self._check_schedule(options, model)
        super().__init__(model, comm, context, options)
        workers = comm.world_size
        if options.min_quorum > workers:
            raise ValueError(
                f"--decoupled.min-quorum: {options.min_quorum} is more than the {workers} "
                f"workers; pass at most {workers}"
            )
        if options.overlap_steps == 0 and self.num_fragments > 1:
            raise ValueError(
                f"--decoupled.overlap-steps: 0 with {self.num_fragments} fragments: a learner "
                "waits for each reply at tau = 0, which needs one fragment; pass "
                "--decoupled.fragments 1 or tau >= 1"
            )
        replicas = self.runtime.replica_group
        #: R: the ranks of this learner, replicas of it (threads or processes of its own).
        self.ranks = 1 if replicas is None else replicas.world_size
        raw = self.runtime.uncharged
        self.learner = int(getattr(raw, "slot", comm.rank))
        group = getattr(raw, "group", None)
        local = getattr(group, "local_size", getattr(group, "size", 0))
        #: The only learner: nothing to agree with anyone.
        self.alone = workers == 1
        #: Whether each collective between learners is a committed round of live membership
        #: (torchft; with R ranks, the outer level's): a tick's exchange is then one round.
        self.rounds = bool(getattr(getattr(raw, "outer_comm", raw), "committed_rounds", False))
        #: Whether every learner is a thread of this process, sharing one synchronizer; else
        #: (worker processes, or K workers in each of several) each learner keeps a replica,
        #: fed every learner's contributions over the uncharged group (:meth:`_exchange`).
        self.shared = not self.alone and group is not None and local >= workers
        self.sync = self._synchronizer(group, workers, options)
        tau = options.overlap_steps
        self.launch_offsets = [
            c - tau for c in completion_offsets(options.sync_every, self.num_fragments)
        ]
        self.base = [0] * self.num_fragments
        self.tokens = [0] * self.num_fragments
        self.steps = [0] * self.num_fragments
        self.outstanding: list[Outstanding | None] = [None] * self.num_fragments
        self.waiting = False
        self.last_step_s = 0.0
        #: xi_sync: the transfer seconds of the last reply this learner took.
        self.sync_s = 0.0
        #: This tick's sends, handed to the synchronizer at the tick's end.
        self.sending: list[Sent] = []
        #: This learner's clock as it posted it at the last tick's end.
        self.posted = -math.inf
        self.ticks = 0
        #: Whether this learner is inside a tick (from its start to its replies' taking), and
        #: how many times an engine (torchft) healed it from a live learner's replica.
        self.stepping, self.heals = False, 0
        self.committed_now = False

    @classmethod
    def _check_schedule(cls, options: DecoupledOptions, model: nn.Module) -> None:
        """The fragments fit in H, and tau in the gap between two fragments' sends."""
        fragments = options.fragments or default_fragment_count(model, cls.default_fragments)
        if fragments > options.sync_every:
            raise ValueError(
                f"--decoupled.fragments: {fragments} fragments do not fit in "
                f"--decoupled.sync-every {options.sync_every} steps; pass at most "
                f"{options.sync_every} fragments or a larger H"
            )
        gap = options.sync_every // fragments
        if options.overlap_steps >= gap:
            raise ValueError(
                f"--decoupled.overlap-steps: {options.overlap_steps} must be < H/K = "
                f"{options.sync_every}//{fragments} = {gap} so that a learner takes a fragment's "
                "reply before it sends the next fragment; lower tau, raise "
                "--decoupled.sync-every or use fewer fragments"
            )

    @property
    def replicated(self) -> bool:
        """Whether this learner keeps a replica of the synchronizer (see :attr:`shared`)."""
        return not (self.alone or self.shared)

    def _synchronizer(
        self, group: object | None, workers: int, options: DecoupledOptions
    ) -> Synchronizer:
        """The synchronizer of this learner's in-process group, made by its first learner,
        or this learner's own replica."""
        if not self.shared or group is None:
            return Synchronizer(self.globals_, learners=max(workers, self.learner + 1),
                                options=options, owners=(self.learner,))  # fmt: skip
        with _SHARED_LOCK:
            sync = _SHARED.get(group)
            if sync is None:
                sync = Synchronizer(self.globals_, learners=workers, options=options)
                _SHARED[group] = sync
            return sync

    # --- the learner's clock and link --------------------------------------------------------

    def now(self) -> float:
        clock = self.runtime.clock
        return clock.now() if clock is not None else float(self.step_index)

    def _message(self, kind: CollectiveKind, role: Role, numel: int, start: float) -> Handle | None:
        """Charge a message of ``numel`` float32 on this learner's link from ``start``: with R
        ranks, this rank's 1/R slice on its own outer link (the R slices travel in parallel,
        as the worker's collectives' do)."""
        charge = self.runtime.message
        share = numel if self.ranks == 1 else max(1, -(-numel // self.ranks))
        return None if charge is None else charge(kind, role, 4 * share, start)

    def _reassembled(self, values: torch.Tensor) -> torch.Tensor:
        """A message down to a learner of R ranks arrives one slice on each rank's link; an
        all-gather of the slices over the learner's ranks (charged on the inner link, waited
        for) gives every rank the whole of it, as a worker's collectives end. With one rank,
        ``values`` itself."""
        group = self.runtime.replica_group
        if group is None:
            return values
        n, ranks, r = values.numel(), self.ranks, group.rank
        c = max(1, -(-n // ranks))
        work = torch.zeros(c * ranks, dtype=values.dtype, device=values.device)
        work[:n] = values.reshape(-1)
        whole = torch.empty_like(work)
        group.all_gather(whole, work[r * c : (r + 1) * c].clone(), role=Role.PARAMETER).wait()
        return whole[:n].view_as(values)

    @staticmethod
    def _arrival(handle: Handle | None, start: float) -> float:
        """A message's modeled arrival (its start without emulation), without moving the
        clock."""
        if handle is None:
            return start
        finish = handle.settle().finish_time
        return start if finish is None else finish

    # --- a tick ------------------------------------------------------------------------------

    def step(self, closure: Closure) -> StepStats:
        tick = self.ticks
        self.ticks += 1
        self.stepping = True
        self.committed_now = False
        earliest, mine = self._earliest()
        if self._takes_a_step(earliest, mine):
            before = self.now()
            stats = self.inner_step(closure)
            self.last_step_s = self.now() - before
            for p in range(self.num_fragments):
                # (The learner's tokens: each of its R ranks took an equal share of them.)
                self.tokens[p] += stats.tokens * self.ranks
                self.steps[p] += 1
            launched = self.send_fragments_due(self.step_index)
        else:
            stats = StepStats(
                loss=math.nan, microbatches=0, samples=0, tokens=0,
                lr=self.lr_at(self.step_index), committed_steps=0,
            )  # fmt: skip
            launched = 0
        heals = self.heals
        rows, sent = self._exchange()
        if self.heals != heals:
            # Healed inside the tick's round: its commit alone had failed, so the others went
            # on, and the round it took part in again is their next tick's, whose quorum
            # healed it with their replica of this one (its tick set from it) and which it
            # sat out. The rows are of that tick.
            tick = self.ticks
            self.ticks += 1
        self.sync.advance(tick, rows, sent)
        for p, _, _ in self.sending:
            out = self.outstanding[p]
            assert out is not None
            out.ticket = self.sync.issued[(self.learner, p)]
        self.sending = []
        taken = self.take_replies_due()
        self.stepping = False
        stats.extras["syncs_launched"] = float(launched)
        stats.extras["syncs_completed"] = float(taken)
        return stats

    def _earliest(self) -> tuple[float, float]:
        """The earliest clock among the learners not waiting, and this learner's, both read at
        one point: agreed anew at this tick's start (an all-gather of the members' clocks)
        after a tick in which one waited, else as posted at the last tick's end (on the real
        clock, time passes between ticks, in the loop's bookkeeping, for every learner)."""
        if self.alone or not self.sync.pace.waiting:
            # (In rounds, the last tick's rows are its members: the quorum may be changing.)
            members = self.sync.live if self.rounds else self.runtime.quorum.members
            return self.sync.pace.earliest(members), self.posted
        now = self.now()
        rows = self._gather([now, float(self.waiting)])
        stepping = [row[0] for row in rows if row[1] == 0.0]
        if not stepping:
            # Every live learner waits at tau = 0 and none took a reply since the last tick:
            # no clock can move, so no merge or reply can come.
            raise ValueError(
                f"--decoupled.overlap-steps: 0 with --decoupled.min-quorum "
                f"{self.options.min_quorum}: all {len(rows)} live learners wait for replies "
                "that no merge can give; use --decoupled.overlap-steps 1 or a quorum the live "
                "learners reach"
            )
        return min(stepping), now

    def _takes_a_step(self, earliest: float, mine: float) -> bool:
        """Not waiting for a reply, and not ahead of the earliest learner by a nominal step."""
        if self.waiting:
            return False
        if self.alone or earliest == -math.inf:  # (alone, or the run's first tick)
            return True
        clock = self.runtime.clock
        if clock is None or clock.kind != "virtual":
            # On the real clock the threads' times include each other's turns on the shared
            # cores, which says nothing of a learner's own pace: every learner steps.
            return True
        return mine <= earliest or mine < earliest + self.sync.pace.nominal

    def _exchange(self) -> tuple[list[Posted], list[Sent]]:
        """Every member's :class:`Posted` at this tick's end, and the tick's contributions
        the synchronizer has not been handed yet: sharing it, each learner deposits its own;
        with replicas, every learner's (gathered here)."""
        # (A learner waiting for its reply sends nothing before it arrives: its later sends
        # arrive after its outstanding one's arrival, too.)
        bound = max(
            [self.now()] + [out.contribution.arrival for out in self.outstanding if out is not None]
        )
        self.posted = self.now()
        mine = Posted(self.learner, bound if self.waiting else self.posted, self.waiting,
                      self.last_step_s, self.sync_s)  # fmt: skip
        if self.alone:
            return [mine], list(self.sending)
        if self.rounds:
            return self._exchange_round(mine)
        if self.replicated:
            return self._exchange_replicas(mine)
        for p, contribution, step_s in self.sending:
            self.sync.deposit(p, contribution, step_s)
        table = self._gather([mine.clock, float(mine.waiting), mine.step_s, mine.sync_s])
        return [self._posted(m, row) for m, row in zip(self._members(), table, strict=True)], []

    @staticmethod
    def _posted(learner: int, row: list[float]) -> Posted:
        return Posted(learner, row[0], row[1] != 0.0, row[2], row[3])

    def _members(self) -> tuple[int, ...]:
        """The learners of this tick, in the order of the uncharged group's ranks."""
        members = self.runtime.quorum.members
        if len(members) != self.runtime.uncharged.world_size:
            raise RuntimeError(
                f"decoupled_diloco: the quorum {members} and the group of "
                f"{self.runtime.uncharged.world_size} ranks disagree"
            )
        return members

    def _exchange_replicas(self, mine: Posted) -> tuple[list[Posted], list[Sent]]:
        """With a replica per learner: an all-gather of each member's post and of its sends'
        counters (:data:`_SENT_FIELDS` per fragment), then one of each fragment someone sent
        (zeros from the others). Uncharged: the modeled messages are each learner's own,
        charged when it sent; these real bytes (every sent fragment to every learner) are how
        the replicas come to hold the same contributions."""
        sending = {p: (c, step_s) for p, c, step_s in self.sending}
        header = [mine.clock, float(mine.waiting), mine.step_s, mine.sync_s]
        for p in range(self.num_fragments):
            if p in sending:
                c, step_s = sending[p]
                header += [1.0, float(c.tokens), float(c.steps), c.arrival,
                           float(c.base_version), step_s]  # fmt: skip
            else:
                header += [0.0] * _SENT_FIELDS
        members = self._members()
        # (A learner's own row is what it posted; the others' are as gathered. With R ranks,
        # its own too, from its ranks' slices: the same on every rank whatever its clock.)
        own = self.ranks == 1
        table = [header if m == self.learner and own else row
                 for m, row in zip(members, self._gather(header), strict=True)]  # fmt: skip
        sent: list[Sent] = []
        for p in range(self.num_fragments):
            at = 4 + _SENT_FIELDS * p
            senders = [i for i, row in enumerate(table) if row[at] != 0.0]
            if not senders:
                continue
            values = self._gather_fragment(p, sending.get(p))
            for i in senders:
                learner, row = members[i], table[i]
                if learner == self.learner and own:
                    sent.append((p, *sending[p]))
                    continue
                c = Contribution(
                    learner=learner, outer_gradient=values[i].clone(), tokens=int(row[at + 1]),
                    steps=int(row[at + 2]), arrival=row[at + 3], base_version=int(row[at + 4]),
                )  # fmt: skip
                if learner == self.learner:
                    self._sent_as(p, c)
                sent.append((p, c, row[at + 5]))
        return [self._posted(m, row) for m, row in zip(members, table, strict=True)], sent

    def _exchange_round(self, mine: Posted) -> tuple[list[Posted], list[Sent]]:
        """With live membership (torchft): the tick is one round, one all-gather of each
        participant's post, its sends' counters and the fragments it sent (a row names its
        learner: the round's participants are the tick's members). A failed round is tried
        again on a new quorum by the communicator, so every member gets the same rows or
        none. A learner healed in the round sits it out: its row is not among them, and what
        it sent at this tick is dropped (it never reaches the synchronizer)."""
        slots, width = self._round_slots()
        like = self.globals_[0]
        header = [float(self.learner), mine.clock, float(mine.waiting), mine.step_s, mine.sync_s]
        values = torch.zeros(slots, width, dtype=like.dtype, device=like.device)
        if len(self.sending) > slots:
            raise RuntimeError(f"decoupled_diloco: {len(self.sending)} sends in one tick")
        for i, (p, c, step_s) in enumerate(self.sending):
            header += [float(p), float(c.tokens), float(c.steps), c.arrival,
                       float(c.base_version), step_s]  # fmt: skip
            values[i, : c.outer_gradient.numel()] = c.outer_gradient.reshape(-1)
        for _ in range(slots - len(self.sending)):
            header += [-1.0] + [0.0] * (_SENT_FIELDS - 1)
        split = 8 * len(header)
        wire = torch.cat([
            torch.tensor(header, dtype=torch.float64).view(torch.uint8),
            values.reshape(-1).view(torch.uint8).cpu(),
        ])  # fmt: skip
        sending = {p: (c, step_s) for p, c, step_s in self.sending}
        posts: list[Posted] = []
        sent: list[Sent] = []
        for row in self._round_rows(wire):
            head: list[float] = row[:split].clone().view(torch.float64).tolist()
            learner = int(head[0])
            posts.append(self._posted(learner, head[1:5]))
            block = row[split:].clone().view(like.dtype).view(slots, width)
            for i in range(slots):
                at = 5 + _SENT_FIELDS * i
                if head[at] < 0:
                    continue
                p = int(head[at])
                # (A learner's own row is what it sent; with R ranks, its own too is the
                # gathered one, made of its ranks' slices, as in :meth:`_exchange_replicas`.)
                if learner == self.learner and self.ranks == 1:
                    sent.append((p, *sending[p]))
                    continue
                numel = self.globals_[p].numel()
                c = Contribution(
                    learner=learner, outer_gradient=block[i, :numel].clone().view_as(self.globals_[p]),
                    tokens=int(head[at + 1]), steps=int(head[at + 2]), arrival=head[at + 3],
                    base_version=int(head[at + 4]),
                )  # fmt: skip
                if learner == self.learner:
                    self._sent_as(p, c)
                sent.append((p, c, head[at + 5]))
        if all(post.learner != self.learner for post in posts):
            for p in sending:
                self.outstanding[p] = None
            self.sending = []
            self.waiting = False
        return posts, sent

    def _round_rows(self, wire: torch.Tensor) -> torch.Tensor:
        """One torchft round's all-gather of this learner's ``wire`` (bytes, on the host): one
        row per participant, in slot order. With R ranks, rank r moves the r-th of R slices
        of it in its own round (to rank r of the others; the R ranks' rounds commit
        together, on one quorum), then an all-gather over the learner's ranks reassembles
        every participant's row, as a worker's collectives do. Uncharged, as every tick's
        exchange. A round tried again on a quorum of another size gives that many rows."""
        raw = self.runtime.uncharged
        self.runtime.enter_round()  # (its quorum: how many rows come back)
        if self.ranks == 1:
            out = torch.empty(raw.world_size * wire.numel(), dtype=torch.uint8)
            raw.all_gather(out, wire, role=Role.OTHER).wait()
            return out.view(-1, wire.numel())
        outer, inner = _levels(raw)
        n, ranks, r = wire.numel(), self.ranks, inner.rank
        # (Slices of whole 8-byte words: a float64 of the header is one rank's, whole, even
        # where the ranks' readings of their own clocks differ.)
        c = -(-n // (8 * ranks)) * 8
        piece = torch.zeros(c, dtype=torch.uint8)
        mine = wire[r * c : (r + 1) * c]
        piece[: mine.numel()] = mine
        received = torch.empty(outer.world_size * c, dtype=torch.uint8)
        outer.all_gather(received, piece, role=Role.OTHER).wait()
        count = received.numel() // c  # (after a retry: that round's participants)
        full = torch.empty(ranks * count * c, dtype=torch.uint8)
        inner.all_gather(full, received, role=Role.OTHER).wait()
        # (full[r', m, :] is slice r' of participant m's row)
        return full.view(ranks, count, c).permute(1, 0, 2).reshape(count, ranks * c)[:, :n]

    def _round_slots(self) -> tuple[int, int]:
        """How many fragments a learner may send in one tick (those whose launch offsets fall
        on the same step of H), and the largest fragment's size: a round's row holds that
        many fragments of that size."""
        period = self.options.sync_every
        offsets = [offset % period for offset in self.launch_offsets]
        slots = max(offsets.count(offset) for offset in offsets)
        return slots, max(g.numel() for g in self.globals_)

    def _sent_as(self, p: int, c: Contribution) -> None:
        """This learner's contribution of fragment p as its ranks' slices gave it (each rank
        timed its send on its own clock)."""
        out = self.outstanding[p]
        assert out is not None
        out.contribution = c

    def _gather_fragment(self, p: int, mine: tuple[Contribution, float] | None) -> torch.Tensor:
        """Every member's outer gradient of fragment p, one row each (zeros from a member
        that did not send it)."""
        raw = self.runtime.uncharged
        like = self.globals_[p]
        values = mine[0].outer_gradient if mine is not None else torch.zeros_like(like)
        out = torch.empty(raw.world_size * like.numel(), dtype=like.dtype, device=like.device)
        raw.all_gather(out, values.reshape(-1).contiguous(), role=Role.OTHER).wait()
        return out.view(raw.world_size, like.numel())

    def _gather(self, values: list[float]) -> list[list[float]]:
        """An all-gather of a few floats over the tick's members (uncharged: agreeing on
        what the modeled clocks say is the simulation's bookkeeping, not a message): on the
        host in one process, on the parameters' device between processes (their group may be
        NCCL's; reading the rows back is then the tick's one wait for the device)."""
        if self.rounds:  # (a round of its own, on the host: torchft's groups are Gloo's)
            wire = torch.tensor(values, dtype=torch.float64).view(torch.uint8)
            table = self._round_rows(wire).contiguous().view(torch.float64)
            gathered: list[list[float]] = table.tolist()
            return gathered
        raw = self.runtime.uncharged
        device = torch.device("cpu") if self.shared else self.globals_[0].device
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        out = torch.zeros(raw.world_size * len(values), dtype=torch.float64, device=device)
        raw.all_gather(out, mine, role=Role.OTHER).wait()
        rows: list[list[float]] = out.view(-1, len(values)).cpu().tolist()
        return rows

    def send_fragments_due(self, t: int) -> int:
        """Send every fragment whose launch offset falls on this learner's step t, unless its
        previous send is still unanswered (at most one contribution per fragment in flight)."""
        tau = self.options.overlap_steps
        sent = 0
        now = self.now()
        for p, offset in enumerate(self.launch_offsets):
            if t < offset or (t - offset) % self.options.sync_every:
                continue
            if t + tau > self.context.total_steps or self.outstanding[p] is not None:
                continue
            delta = self.globals_[p] - self.local_fragment(p)
            handle = self._message(
                CollectiveKind.REDUCE_SCATTER, Role.PSEUDO_GRADIENT, delta.numel(), now
            )
            contribution = Contribution(
                learner=self.learner,
                outer_gradient=delta,
                tokens=self.tokens[p],
                steps=self.steps[p],
                arrival=self._arrival(handle, now),
                base_version=self.base[p],
            )
            self.tokens[p] = self.steps[p] = 0
            # (Its ticket comes at the tick's end, when the synchronizer takes it.)
            self.sending.append((p, contribution, self.last_step_s))
            self.outstanding[p] = Outstanding(t, -1, contribution)
            self.waiting = self.waiting or tau == 0
            sent += 1
        return sent

    def take_replies_due(self, *, final: bool = False) -> int:
        """Take every reply that has arrived by this step boundary, tau of this learner's
        steps or more after its send; at tau = 0 (or at the end) wait for it. With R ranks,
        a reply is taken once it has arrived on every rank's clock (they may differ on the
        real clock), so the ranks take it at the same boundary."""
        tau = self.options.overlap_steps
        due = [self._reply_in(p, out, final) for p, out in enumerate(self.outstanding)]
        if self.ranks > 1 and tau > 0 and not final:
            due = self._on_every_rank(due)
        taken = 0
        for p, out in enumerate(self.outstanding):
            if out is None or not due[p]:
                continue
            if (tau == 0 or final) and out.reply_handle is not None:
                out.reply_handle.wait()
            self._take(p, out)
            taken += 1
        self.waiting = any(out is not None for out in self.outstanding) and tau == 0
        return taken

    def _reply_in(self, p: int, out: Outstanding | None, final: bool) -> bool:
        """Whether fragment p's reply is due and here: decided, tau steps or more after the
        send, and arrived on this rank's clock (at tau = 0 or at the end: decided, and then
        waited for). Charges the reply on the link once it is decided."""
        tau = self.options.overlap_steps
        if out is None or (not final and self.step_index < out.launched_at + tau):
            return False
        if out.reply is None:
            reply = self.sync.reply(p, out.ticket, out.contribution)
            if reply is None:
                return False
            out.reply = reply
            out.reply_handle = self._message(
                CollectiveKind.ALL_GATHER, Role.PARAMETER, reply.values.numel(), reply.leaves
            )
            out.reply_done = self._arrival(out.reply_handle, reply.leaves)
            self.sync_s = out.reply_done - reply.leaves
        assert out.reply_done is not None
        return tau == 0 or final or out.reply_done <= self.now()

    def _on_every_rank(self, flags: list[bool]) -> list[bool]:
        """Each of ``flags`` true on every rank of this learner: an uncharged all-gather over
        the two-level group, in which rank r's slice of an (R, K) table, its own row, is what
        it moves, so each learner's row of the result holds its R ranks' flags."""
        raw, ranks, k = self.runtime.uncharged, self.ranks, len(flags)
        if self.rounds:  # (over the learner's own ranks: not a round between learners)
            _, inner = _levels(raw)
            own = torch.tensor([float(f) for f in flags], dtype=torch.float64)
            table = torch.zeros(ranks * k, dtype=torch.float64)
            inner.all_gather(table, own, role=Role.OTHER).wait()
            return [flag == 1.0 for flag in table.view(ranks, k).amin(0).tolist()]
        device = self.globals_[0].device
        mine = torch.tensor([float(f) for f in flags] * ranks, dtype=torch.float64, device=device)
        out = torch.zeros(raw.world_size * ranks * k, dtype=torch.float64, device=device)
        raw.all_gather(out, mine, role=Role.OTHER).wait()
        everyone: list[float] = out.view(raw.world_size, ranks, k)[raw.rank].amin(0).tolist()
        return [flag == 1.0 for flag in everyone]

    def _take(self, p: int, out: Outstanding) -> None:
        """theta_p <- alpha theta_p + (1 - alpha) Theta_p^(v); b_p <- v."""
        assert out.reply is not None
        self.globals_[p].copy_(self._reassembled(out.reply.values))
        local = self.local_fragment(p)
        # lerp(global, local, alpha) = alpha local + (1 - alpha) global; exactly global at 0.
        self.set_local_fragment(p, torch.lerp(self.globals_[p], local, self.options.mixing))
        self.base[p] = out.reply.version
        self.outstanding[p] = None
        self.outer_steps += 1
        self.committed_now = self.committed_now or out.reply.merged

    def finish(self) -> None:
        """Once every learner has ended its last tick (and posted its last xi_sync), the
        synchronizer applies every merge that can still form, and each learner takes its
        replies (waiting for them)."""
        if self.alone:
            self.sync.finish({self.learner: self.sync_s})
        elif self.rounds:  # (a round: its rows name their learners)
            table = self._gather([float(self.learner), self.sync_s])
            self.sync.finish({int(row[0]): row[1] for row in table})
        else:
            table = self._gather([self.sync_s])
            self.sync.finish({m: row[0] for m, row in zip(self._members(), table, strict=True)})
        self.take_replies_due(final=True)

    # --- membership (declared faults) --------------------------------------------------------

    def round_committed(self, stats: StepStats) -> bool:
        return self.committed_now

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """A joiner takes every Theta_p from the synchronizer, a message of the whole model
        down its link (charged; its clock waits for it), and starts by the rule of
        :attr:`membership`; a rejoiner keeps its own state. Members do nothing: no learner
        holds state another needs."""
        if self.replicated:
            self._copy_synchronizer(source, joining)
        if not joining:
            return
        params, versions, tick = self.sync.snapshot()
        self._forget_sends(tick)
        if kept:
            return
        now = self.now()
        for p, values in enumerate(params):
            handle = self._message(CollectiveKind.ALL_GATHER, Role.PARAMETER, values.numel(), now)
            if handle is not None:
                handle.wait()
            params[p] = self._reassembled(values)
        self._start_at(params, versions)

    def _forget_sends(self, tick: int) -> None:
        """No fragment in flight and the counters at 0, from the tick after ``tick``."""
        self.ticks = tick + 1
        self.outstanding = [None] * self.num_fragments
        self.tokens = [0] * self.num_fragments
        self.steps = [0] * self.num_fragments
        self.waiting = False
        self.posted = self.now()  # (its clock, moved to the latest member's)

    def _start_at(self, params: list[torch.Tensor], versions: list[int]) -> None:
        """The join rule of :attr:`membership`: the local parameters and their base at
        Theta (``params``, of ``versions``), the inner AdamW afresh, the step count at the
        tick's."""
        for p, values in enumerate(params):
            self.globals_[p].copy_(values)
            self.set_local_fragment(p, values)
            self.base[p] = versions[p]
        self.inner.reset()
        self.step_index = self.ticks
        self.last_step_s = 0.0
        self.posted = self.now()

    def _copy_synchronizer(self, source: int, joining: bool) -> None:
        """The member of rank ``source`` sends its replica to the round's members, and a
        joiner takes it (its own missed the ticks it was out: nobody fed it). Uncharged: the
        modeled transfer is the joiner's Theta down its link, charged in :meth:`heal`."""
        raw = self.runtime.uncharged
        device = self.globals_[0].device
        payload = torch.empty(0, dtype=torch.uint8)
        if raw.rank == source:
            buffer = io.BytesIO()
            torch.save(self.sync.state_dict(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        raw.broadcast(size, src=source, role=Role.OTHER).wait()
        received = torch.zeros(int(size.cpu()[0]), dtype=torch.uint8, device=device)
        if raw.rank == source:
            received.copy_(payload)
        raw.broadcast(received, src=source, role=Role.OTHER).wait()
        if joining:
            state = torch.load(
                io.BytesIO(received.cpu().numpy().tobytes()), map_location=device,
                weights_only=True,
            )  # fmt: skip
            self.sync.load_state_dict(state, once=False)

    # --- live membership (torchft): healing at a round's quorum ----------------------------

    def healing_payload(self) -> tuple[list[torch.Tensor], dict[str, int]]:
        """What a live learner sends a joiner at a round's quorum: its replica of the
        synchronizer (every Theta_p, outer optimizer, version, pending contribution and token
        count: :meth:`Synchronizer.shared_state`, the same bytes on every live worker, so a
        joining worker's rank r may take its slice from rank r of any of them), as one tensor
        of its bytes, and this learner's step count (which the engine sets to the joiner's
        loop step).

        torchft reads it inside a round's quorum, on its quorum thread, which may be while
        this learner is inside a tick (a round opened early, whose lock the send's pricing
        releases: :meth:`Replica.needs_quorum`). The tick's exchange waits for that quorum,
        and nothing before it changes the replica, so it is the replica of the tick before
        the round's wherever it is read; the joiner takes its tick from it and enters that
        round. Read after the exchange, it would hold the round's merges, which the joiner
        would then apply again: refused."""
        round_tick = self.ticks - 1 if self.stepping else self.ticks
        if self.sync.tick + 1 != round_tick:
            raise RuntimeError(
                f"decoupled_diloco: learner {self.learner}'s replica was read for healing "
                f"at tick {self.sync.tick} for the round of tick {round_tick}: a quorum "
                "must form before the tick's exchange"
            )
        buffer = io.BytesIO()
        torch.save(self.sync.shared_state(), buffer)
        state = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return [state], {"step_index": self.step_index}

    def take_healing_payload(self, tensors: list[torch.Tensor], counters: dict[str, int]) -> None:
        """A joiner takes a live learner's replica of the synchronizer (its own replies
        only: it has none), then starts by :meth:`start_worker_state`."""
        (payload,) = tensors
        state = torch.load(
            io.BytesIO(payload.cpu().numpy().tobytes()), map_location=self.globals_[0].device,
            weights_only=True,
        )  # fmt: skip
        self.sync.load_state_dict(state, once=False)
        self.step_index = int(counters["step_index"])

    def start_worker_state(self, *, kept: bool) -> None:
        """The rule of :attr:`membership`, after healing from a live learner's replica: no
        fragment in flight, from the tick after the replica's last; a joiner's clock moves
        to the latest clock the members posted at that tick (a worker that was away has no
        time of its own), then takes every Theta_p down its link (charged; its clock waits
        for it), its local parameters at Theta and its inner AdamW afresh."""
        params, versions, tick = self.sync.snapshot()
        self._forget_sends(tick)
        self.heals += 1
        if kept:
            return
        latest = max((clock for _, clock in self.sync.pace.clocks), default=self.now())
        start = max(self.now(), latest)
        for p, values in enumerate(params):
            handle = self._message(CollectiveKind.ALL_GATHER, Role.PARAMETER, values.numel(), start)
            if handle is not None:
                handle.wait()
            params[p] = self._reassembled(values)
        self._start_at(params, versions)
        self.sync_s = 0.0

    # --- Strategy API ------------------------------------------------------------------------

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The model at the synchronizer's global fragments Theta (the same on every learner);
        the learner's local parameters are restored afterwards."""
        params, _, _ = self.sync.snapshot()
        local = self.flat.params.clone()
        with torch.no_grad():
            for fragment, values in zip(self.fragments, params, strict=True):
                fragment.scatter(self.flat.params, values.to(self.flat.dtype))
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.flat.params.copy_(local)

    def extra_state_bytes(self) -> int:
        # One fragment's outer gradient in flight per fragment at most.
        return 4 * sum(f.numel for f in self.fragments)

    def state_dict(self) -> dict[str, Any]:
        """This learner's state and, in every learner's checkpoint alike, the synchronizer's
        (a checkpoint is taken between ticks, when no learner is inside it)."""
        outstanding: list[dict[str, Any] | None] = []
        for out in self.outstanding:
            if out is None:
                outstanding.append(None)
                continue
            reply = out.reply
            outstanding.append({
                "launched_at": out.launched_at, "ticket": out.ticket,
                "contribution": _contribution_state(out.contribution),
                "reply": None
                if reply is None
                else (reply.leaves, reply.version, reply.merged, reply.values.clone()),
                "reply_done": out.reply_done,
            })  # fmt: skip
        return {
            **super().state_dict(),
            "learner": {
                "base": list(self.base), "tokens": list(self.tokens), "steps": list(self.steps),
                "outstanding": outstanding, "waiting": self.waiting,
                "last_step_s": self.last_step_s, "ticks": self.ticks, "posted": self.posted,
                "sync_s": self.sync_s,
            },
            "synchronizer": self.sync.state_dict(),
        }  # fmt: skip

    def lose_state(self) -> None:
        """The learner's own state is lost; the synchronizer (shared by the process's
        learners, or this process's replica of it) is not the learner's and stays."""
        state = self.state_dict()
        del state["synchronizer"]  # (not reloaded: the process's other learners go on in it)
        lost = zeroed_tensors(state)
        super().load_state_dict(lost)
        self._load_learner(lost["learner"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "synchronizer" not in state:
            raise ValueError(
                "--resume: this checkpoint of decoupled_diloco holds no synchronizer state; "
                "run again from the start"
            )
        super().load_state_dict(state)
        if int(state["synchronizer"]["learners"]) != self.sync.learners:
            self._load_remapped(state["synchronizer"])
            return
        self.sync.load_state_dict(state["synchronizer"], once=self.shared)
        mine = dict(state["learner"])
        mine.setdefault("sync_s", state["synchronizer"]["sync_time"][self.learner])
        self._load_learner(mine)

    def _load_remapped(self, saved: dict[str, Any]) -> None:
        """An elastic resume (another number of learners; every learner is handed the old
        learner 0's state, lowcomm.train.reshard): the synchronizer keeps its global state
        (:meth:`Synchronizer.load_remapped`) and every learner starts by the join rule, at
        Theta with its inner AdamW afresh. Uncharged: like every method's elastic resume, a
        restart that reads the checkpoint."""
        self.sync.load_remapped(saved)
        params, versions, tick = self.sync.snapshot()
        self._forget_sends(tick)
        self._start_at(params, versions)
        self.sync_s = 0.0

    def _load_learner(self, mine: dict[str, Any]) -> None:
        """This learner's own part of a checkpoint (``state_dict()["learner"]``)."""
        self.sync_s = float(mine["sync_s"])
        self.base = [int(b) for b in mine["base"]]
        self.tokens = [int(t) for t in mine["tokens"]]
        self.steps = [int(t) for t in mine["steps"]]
        self.waiting = bool(mine["waiting"])
        self.last_step_s = float(mine["last_step_s"])
        self.posted = float(mine["posted"])
        self.ticks = int(mine["ticks"])
        self.outstanding = []
        for saved in mine["outstanding"]:
            if saved is None:
                self.outstanding.append(None)
                continue
            out = Outstanding(
                int(saved["launched_at"]), int(saved["ticket"]),
                _contribution_of(saved["contribution"]),
            )  # fmt: skip
            if saved["reply"] is not None:
                leaves, version, merged, values = saved["reply"]
                out.reply = Reply(float(leaves), int(version), values.clone(), bool(merged))
                out.reply_done = float(saved["reply_done"])
                # (Charged before the checkpoint: it completes at its modeled arrival.)
                out.reply_handle = self.runtime.restore(Settled(out.reply_done))
            self.outstanding.append(out)


METHODS: tuple[type[Strategy], ...] = (DecoupledDiLoCo,)


def _levels(comm: Comm) -> tuple[Comm, Comm]:
    """A two-level group's levels: between learners (rank r of each) and among a learner's
    own ranks. Read by attribute, as Strategy does, so a strategy names the Comm protocol
    only, never the emulation that builds the group."""
    outer: Comm | None = getattr(comm, "outer_comm", None)
    inner: Comm | None = getattr(comm, "replica_comm", None)
    assert outer is not None and inner is not None, "learners of several ranks need two levels"
    return outer, inner
