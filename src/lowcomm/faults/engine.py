"""Declared faults applied to one worker of an in-process run (every worker a thread).

The trace decides who is alive at each step; every worker reads the same trace, so every
member derives the same quorum without talking (:meth:`WorkerFaults.plan`). At each step a
worker:

* outside the quorum (crashed, left, or not yet joined) takes no part: it issues no strategy
  collective and charges its clock nothing. Its thread stays only to take its turn in the
  run's bookkeeping (the metrics gather, the validation sums, the summary), which its rows
  leave out.
* in the quorum enters it on the strategy's in-process group (the collectives of the step run
  over its members; a mean divides by its size), sets its compute speed from the trace's
  ``slow`` events, and then:

  - when workers join at this step, the joiners' clocks move to the latest member's time
    (uncharged; their absence is not a wait), then every member takes part in healing: the
    lowest surviving member sends what the method declares global, charged on the link; the
    joiners start their own state by the method's rule (:meth:`Strategy.heal`);
  - when a member crashed at this step and the method's round is a step (ddp, demo,
    sparta), the step is *dropped* on every member: each computes its micro-batches (the
    gradient it cannot send), waits the detection time on its clock, discards the gradient,
    changes no state and commits nothing;
  - when a member crashed and the method's round is a sync (the DiLoCo, local and DES-LOC
    families, sparseloco), the survivors take their inner steps as usual and wait, at the
    next sync, until the detection time after the crash has passed
    (:meth:`WorkerFaults.enter_round`);
  - otherwise it takes the method's step.

**Membership events placed by time** (``t=SECONDS``, as every generated trace places its
crashes and joins) land on a step: the first step whose start, on the run's clock, is at or
after the event's time. The run's clock at a step's start is the latest clock of the
previous step's members: at each step, while an event placed by time is still to come, every
worker (member or not) takes part in one uncharged max over the bookkeeping group, giving its
clock (a member) or nothing (``-inf``: a worker outside the quorum has no time of its own).
Every worker gets the same number and resolves the same events to the same step, without
talking on the strategy's links; from then on the event acts exactly as if the trace had
placed it with ``step=N`` at that step (:meth:`WorkerFaults.resolve`). For a synchronous
method the members' clocks agree after each step's collective, so this is their common time;
for a local method it is the slowest member's, the time at which the whole quorum has
reached the step. A run whose events are placed by step makes no such agreement.

Events at one step happen together, in trace order: a worker whose events at a step leave it
dead takes no part in it (a replacement that joins and crashes within one step never runs),
and one that was dead before the step is not *lost* at it.

**A quorum below ``min_workers``** (``--fault-min-workers``) waits, on the run's clock, for
the trace's next joins that form one; they land on the step that waited
(:meth:`WorkerFaults.resolve`). On the virtual clock the wait is modeled: the live workers'
clocks move to the moment the quorum forms (exposed time), and no real time passes; on the
real clock they sleep, the lowest live worker saying every :data:`SAY_EVERY_S` seconds who is
missing and how long it has waited. A trace placed by step cannot be waited out (no step is
taken to reach its join); the pre-flight refuses it. A wait longer than ``quorum_wait_s``
from its start stalls the run (:attr:`WorkerFaults.stalled`): the loop checkpoints the state
before that step and ends, and a resume counts its wait from the same start.

A worker that leaves announces it: the others neither wait to detect it nor drop a step. A
link degraded to F makes a transfer that starts in it take 1/F times its modeled time; one
that starts while the link is down starts when it is up (:meth:`WorkerFaults.transfer_time`).

Committed tokens: a step-round method commits a member's tokens at every step that was not
dropped; a sync-round method commits a worker's inner-step tokens at the sync it takes part
in, and a worker lost before its sync loses them. A method whose sync's result is applied
rounds after its launch (eager, diloco_delayed, co2: :meth:`Strategy.settled_syncs`) closes
the tokens of the steps up to each launch into that sync's bucket, and commits or drops the
bucket when the sync settles: applied by every member, or failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.comm.base import Role
from lowcomm.comm.runtime import Quorum
from lowcomm.faults.trace import MEMBERSHIP_KINDS, Event, FaultTrace

if TYPE_CHECKING:
    from lowcomm.comm.base import Comm
    from lowcomm.comm.clock import Clock
    from lowcomm.comm.inprocess import InProcessComm
    from lowcomm.comm.torch_comm import QuorumTorchComm
    from lowcomm.faults.stacked import QuorumStackedComm

__all__ = ["SAY_EVERY_S", "QuorumStall", "StepPlan", "WorkerFaults", "quorum_at", "wait_saying"]


def quorum_at(trace: FaultTrace, step: int) -> tuple[tuple[int, ...], int]:
    """The members at ``step`` and the quorum's id: the number of steps up to ``step`` at which
    membership changed (so a crash and its replacement's join at one step change it too)."""
    members = trace.members(step=step)
    changes = {
        event.at_step
        for event in trace.membership_events()
        if event.at_step is not None and event.at_step <= step
    }
    return members, len(changes)


def _after(alive: set[int], events: tuple[Event, ...]) -> set[int]:
    """The live workers after ``events`` (in order)."""
    alive = set(alive)
    for event in events:
        assert event.worker is not None
        if event.kind in ("crash", "leave"):
            alive.discard(event.worker)
        else:
            alive.add(event.worker)
    return alive


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"


#: How often a run waiting for its quorum on the real clock says so (seconds).
SAY_EVERY_S = 30.0


def wait_saying(
    *,
    now: Callable[[], float],
    sleep_until: Callable[[float], None],
    end: float,
    since: float,
    every_s: float | None,
    say: Callable[[str], None] | None,
    line: Callable[[float], str],
) -> None:
    """Wait until ``end`` on a clock (``now``, ``sleep_until``), saying ``line(waited)`` every
    ``every_s`` seconds of the wait begun at ``since`` (None: in one sleep, silently; ``say``
    None: this worker waits without speaking)."""
    if every_s is None or say is None:
        sleep_until(end)
        return
    due = since + every_s
    while due <= now():  # (a wait resumed from a checkpoint began before it)
        due += every_s
    while now() < end:
        sleep_until(min(end, due))
        current = now()
        if due <= current < end:
            say(line(current - since))
            due += every_s


@dataclass(frozen=True)
class QuorumStall:
    """A quorum that could not be formed: the run ends with a checkpoint at ``step``."""

    step: int
    alive: tuple[int, ...]
    missing: tuple[int, ...]
    min_workers: int
    waited_s: float
    quorum_wait_s: float


@dataclass(frozen=True)
class StepPlan:
    """What one worker does at one step.

    Attributes:
        quorum: the step's quorum (``joined``: this worker joins at this step).
        member: whether this worker is in it.
        events: the membership events at this step.
        lost: the workers that crash at this step (one that leaves announces it: the others
            neither wait to detect it nor drop the step).
        joining: the workers that join or rejoin at this step.
        source: the rank (in the quorum) of the member that heals the joiners.
        dropped: the step is dropped on every member (a step-round method lost a member).
    """

    quorum: Quorum
    member: bool
    events: tuple[Event, ...]
    lost: tuple[int, ...]
    joining: tuple[int, ...]
    source: int | None
    dropped: bool


def _workers_of(events: tuple[Event, ...], kinds: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(sorted({e.worker for e in events if e.kind in kinds and e.worker is not None}))


class WorkerFaults:
    """One worker's view of the run's faults (it implements the runtime's ``Membership``).

    Args:
        trace: the run's trace.
        slot: this worker's slot (its rank among the M workers).
        round_kind: ``step`` or ``sync``, the method's :class:`MembershipRule` round.
        detection_s: seconds until the survivors of a loss go on without the lost worker.
        clock: this worker's clock.
        raw: this worker's member of the strategy's in-process group.
        books: this worker's member of the bookkeeping group (every worker, member or not),
            where the step's start time is agreed while membership events placed by time are
            still to come; needed only by such a trace.
        extend: for a generated trace, the same trace over a longer horizon (seconds): called
            when the run's clock passes the trace's horizon (None: the trace is complete).
        horizon_s: the modeled time the trace covers (``math.inf``: complete).
        min_workers: the fewest live workers a quorum needs; below it the run waits for
            joins (:meth:`resolve`).
        quorum_wait_s: how long (on the run's clock) it waits before it gives up.
        say: where the waiting worker's lines go (one line each; the lowest live slot speaks;
            on the real clock every :data:`SAY_EVERY_S` seconds of the wait).
    """

    #: Whether a crash zeroes its worker's state where it stands (a worker that goes on in a
    #: process torchrun started: :mod:`lowcomm.faults.processes`); a thread of the other
    #: placements keeps it, healed at its join.
    loses_state_in_place = False

    def __init__(
        self,
        trace: FaultTrace,
        *,
        slot: int,
        round_kind: str,
        detection_s: float,
        clock: Clock,
        raw: InProcessComm | QuorumTorchComm | QuorumStackedComm,
        books: Comm | None = None,
        extend: Callable[[float], FaultTrace] | None = None,
        horizon_s: float = math.inf,
        min_workers: int = 1,
        quorum_wait_s: float = math.inf,
        say: Callable[[str], None] = print,
    ) -> None:
        self.trace = trace
        self.slot = slot
        self.round_kind = round_kind
        self.detection_s = detection_s
        self.clock = clock
        self.raw = raw
        self.books = books
        self.base_speed = clock.speed_factor
        self._extend = extend
        self._horizon_s = horizon_s
        self._quorum = Quorum(tuple(range(trace.workers)))
        self._detect_until: float | None = None
        #: Tokens this worker computed that a sync has not committed yet (sync rounds).
        self.pending_tokens = 0
        self.committed_tokens = 0
        self.dropped_steps = 0
        #: Late-settling methods: tokens closed at each sync's launch step, awaiting its result.
        self.awaiting: dict[int, int] = {}
        #: Syncs that failed on every member, by the step that settled them.
        self.failed_syncs: dict[int, int] = {}
        self._step = 0
        # Membership resolved step by step (resolve): the events of each step, the members
        # after them and the quorum's id.
        self._set_trace(trace)
        self._next = 0
        self._alive = tuple(range(trace.workers))
        self._quorum_id = 0
        self._resolved: list[tuple[tuple[Event, ...], tuple[int, ...], int]] = []
        self.min_workers = min_workers
        self.quorum_wait_s = quorum_wait_s
        self.say = say
        self.say_every_s = SAY_EVERY_S if clock.kind == "real" else None
        #: When the current wait for a quorum began, on the run's clock (None: no wait).
        self._waiting_since: float | None = None
        #: The quorum that could not be formed (None: the run goes on).
        self.stalled: QuorumStall | None = None

    def _set_trace(self, trace: FaultTrace) -> None:
        self.trace = trace
        self._membership = trace.membership_events()
        #: The trace's slow and link events alone: the per-step queries read only these.
        self.rates = FaultTrace(
            workers=trace.workers,
            events=tuple(e for e in trace.events if e.kind not in MEMBERSHIP_KINDS),
            source=trace.source,
        )

    # --- the runtime's Membership -----------------------------------------------------------

    def quorum(self) -> Quorum:
        return self._quorum

    def enter_round(self) -> Quorum:
        if self._detect_until is not None:
            self.wait_until(self._detect_until)  # (waits only if not detected yet)
            self._detect_until = None
        return self._quorum

    # --- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this worker stands in the trace, for a checkpoint: the membership resolved
        so far (each step's events as indices into the trace's membership events, its members
        and quorum id), the trace's cursor and horizon, the quorum in force, a detection still
        to wait, the token counts (with the buckets of syncs still to settle) and the syncs
        failed so far, by step. Everything else is the trace itself, which the resumed
        run reads again (the checkpoint's fingerprint names its content)."""
        # (By equality: a grown generated trace holds equal events, as other objects.)
        index = {event: position for position, event in enumerate(self._membership)}
        return {
            "resolved": [
                ([index[event] for event in events], list(members), quorum_id)
                for events, members, quorum_id in self._resolved
            ],
            "next": self._next,
            "alive": list(self._alive),
            "quorum_id": self._quorum_id,
            "horizon_s": self._horizon_s,
            "quorum": [list(self._quorum.members), self._quorum.id, self._quorum.joined],
            "detect_until": self._detect_until,
            "step": self._step,
            "pending_tokens": self.pending_tokens,
            "committed_tokens": self.committed_tokens,
            "dropped_steps": self.dropped_steps,
            "waiting_since": self._waiting_since,
            "awaiting": sorted(self.awaiting.items()),
            "failed_syncs": sorted(self.failed_syncs.items()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (on a worker built from the same trace)."""
        horizon = float(state["horizon_s"])
        if horizon != self._horizon_s and self._extend is not None:
            self._horizon_s = horizon  # (the generated trace as far as the run had grown it)
            self._set_trace(self._extend(horizon))
        self._resolved = [
            (tuple(self._membership[i] for i in events), tuple(members), int(quorum_id))
            for events, members, quorum_id in state["resolved"]
        ]
        self._next = int(state["next"])
        self._alive = tuple(state["alive"])
        self._quorum_id = int(state["quorum_id"])
        members, quorum_id, joined = state["quorum"]
        self._quorum = Quorum(tuple(members), int(quorum_id), joined=bool(joined))
        detect = state["detect_until"]
        self._detect_until = None if detect is None else float(detect)
        self._step = int(state["step"])
        self.pending_tokens = int(state["pending_tokens"])
        self.committed_tokens = int(state["committed_tokens"])
        self.dropped_steps = int(state["dropped_steps"])
        waiting = state.get("waiting_since")
        self._waiting_since = None if waiting is None else float(waiting)
        # (A checkpoint of a run whose syncs settle when launched holds neither.)
        self.awaiting = {int(at): int(n) for at, n in state.get("awaiting", ())}
        self.failed_syncs = {int(at): int(n) for at, n in state.get("failed_syncs", ())}

    # --- the loop's side ---------------------------------------------------------------

    def resolve(self, step: int) -> None:
        """Place the membership events that happen by ``step``'s start (every worker calls
        it at every step, in order, before the step; see the module docstring). A quorum
        below ``min_workers`` waits for the joins that form one (:meth:`_wait_for_quorum`);
        when none comes in time, :attr:`stalled` says so and nothing more is placed."""
        while len(self._resolved) <= step and self.stalled is None:
            current = len(self._resolved)
            due, start = self._due_events(current)
            alive = _after(set(self._alive), due)
            if len(alive) < self.min_workers:
                # (A trace placed by step never gets here: the pre-flight refuses it.)
                assert start is not None, "a quorum below the minimum on a trace by step"
                more = self._wait_for_quorum(current, start, alive)
                if more is None:  # (the step's events stay to come: a resume places them)
                    self._next -= len(due)
                    return
                due += more
                alive = _after(alive, more)
            else:  # (no wait in progress: a run resumed with fewer --fault-min-workers)
                self._waiting_since = None
            if due:
                self._alive = tuple(sorted(alive))
                self._quorum_id += 1
            self._resolved.append((due, self._alive, self._quorum_id))

    def quorum_lost(self, step: int) -> bool:
        """Whether no quorum of ``min_workers`` formed for ``step`` in the time the run waits
        for one (the run then ends with a checkpoint; :attr:`stalled` says why)."""
        self.resolve(step)
        return self.stalled is not None

    def _wait_for_quorum(
        self, step: int, start: float, alive: set[int]
    ) -> tuple[Event, ...] | None:
        """The quorum at ``step`` (starting at ``start`` on the run's clock) has fewer than
        ``min_workers`` live workers: wait, on this clock, until the trace's next events form
        one, up to ``quorum_wait_s`` after the wait began (a wait the run resumed in began
        before its checkpoint). Returns those events (they land on this step), or None when
        none forms in time: the live workers' clocks then stand at the wait's end and
        :attr:`stalled` describes it."""
        since = start if self._waiting_since is None else self._waiting_since
        self._waiting_since = since
        deadline = since + self.quorum_wait_s
        formed = self._next_quorum(alive, deadline)
        end = deadline if formed is None else formed[0]
        missing = tuple(sorted(set(range(self.trace.workers)) - alive))
        speaker = bool(alive) and self.slot == min(alive)
        if speaker:
            live = ", ".join(map(str, sorted(alive)))
            self.say(
                f"lowcomm: step {step}: the quorum needs --fault-min-workers {self.min_workers} "
                f"live workers and has {len(alive)} (worker {live}); waiting for worker "
                f"{', '.join(map(str, missing))} to join, up to {_seconds(self.quorum_wait_s)} "
                "(--fault-quorum-wait-s)"
            )
        if self.slot in alive:
            wait_saying(
                now=self.clock.now,
                sleep_until=lambda until: self.wait_until(until),
                end=end,
                since=since,
                every_s=self.say_every_s,
                say=self.say if speaker else None,
                line=lambda waited: (
                    f"lowcomm: step {step}: still waiting for worker "
                    f"{', '.join(map(str, missing))} to form a quorum of "
                    f"{self.min_workers}: waited {_seconds(waited)} of "
                    f"{_seconds(self.quorum_wait_s)}"
                ),
            )
        if formed is None:
            self.stalled = QuorumStall(
                step=step, alive=tuple(sorted(alive)), missing=missing,
                min_workers=self.min_workers, waited_s=deadline - since,
                quorum_wait_s=self.quorum_wait_s,
            )  # fmt: skip
            return None
        at, index = formed
        events = tuple(self._membership[self._next : index])
        self._next = index
        self._waiting_since = None
        if speaker:
            self.say(
                f"lowcomm: step {step}: a quorum of {len(_after(alive, events))} formed after "
                f"waiting {_seconds(at - since)}"
            )
        return events

    def _next_quorum(self, alive: set[int], deadline: float) -> tuple[float, int] | None:
        """When the trace's next membership events (from the cursor) first leave at least
        ``min_workers`` alive, at or before ``deadline``: that moment and the cursor after
        its events; None if they do not (a generated trace grows as far as the deadline)."""
        members, index = set(alive), self._next
        while True:
            while index >= len(self._membership):
                if self._extend is None or self._horizon_s > deadline:
                    return None
                self._horizon_s *= 2
                self._set_trace(self._extend(self._horizon_s))
            event = self._membership[index]
            if event.at > deadline:
                return None
            members = _after(members, (event,))
            index += 1
            moment_ends = index == len(self._membership) or self._membership[index].at != event.at
            if moment_ends and len(members) >= self.min_workers:
                return event.at, index

    def wait_until(self, deadline: float) -> None:
        """Wait on this worker's clock until ``deadline`` (on the real clock the sleep is a
        wait on communication, exposed time, not compute)."""
        if self.clock.kind == "real":
            with self.clock.blocked():
                self.clock.wait_until(deadline)
        else:
            self.clock.wait_until(deadline)

    def _due_events(self, step: int) -> tuple[tuple[Event, ...], float | None]:
        """The membership events not yet placed that happen by ``step``'s start, and that
        start on the run's clock (None: not agreed, the trace is placed by step or has no
        event to come)."""
        if self._next >= len(self._membership) and self._extend is None:
            return (), None
        if self._membership and self._membership[0].at_step is not None:  # (one clock)
            found = []
            while self._next < len(self._membership):
                event = self._membership[self._next]
                assert event.at_step is not None
                if event.at_step > step:
                    break
                found.append(event)
                self._next += 1
            return tuple(found), None
        start = self._agreed_start()
        while start >= self._horizon_s and self._extend is not None:
            self._horizon_s *= 2
            self._set_trace(self._extend(self._horizon_s))
        found = []
        while self._next < len(self._membership):
            event = self._membership[self._next]
            if event.at > start:
                break
            found.append(event)
            self._next += 1
        return tuple(found), start

    def _agreed_start(self) -> float:
        """The step's start on the run's clock: the latest clock among the previous step's
        members, agreed by every worker (an uncharged max on the bookkeeping group)."""
        if self.books is None:
            raise RuntimeError(
                "membership events placed by time need the bookkeeping group to agree the "
                "step's start; pass books="
            )
        mine = self.clock.now() if self.slot in self._alive else -math.inf
        times = torch.tensor([mine], dtype=torch.float64)
        self.books.all_reduce(times, op="max", role=Role.OTHER).wait()
        return float(times[0])

    def members(self, step: int) -> tuple[int, ...]:
        """The members of ``step``'s quorum (a step already resolved)."""
        self.resolve(step)
        return self._resolved[step][1]

    def plan(self, step: int) -> StepPlan:
        """What this worker does at ``step`` (the same quorum on every member)."""
        self.resolve(step)
        events, members, quorum_id = self._resolved[step]
        before = self._resolved[step - 1][1] if step > 0 else tuple(range(self.trace.workers))
        # (A worker dead before the step is not lost at it; one dead after it does not join.)
        lost = tuple(w for w in _workers_of(events, ("crash",)) if w in before)
        joining = tuple(w for w in _workers_of(events, ("join", "rejoin")) if w in members)
        survivors = [m for m in members if m not in joining]
        source = None
        if joining:
            if not survivors:
                raise RuntimeError(
                    f"{self.trace.source}: step {step}: every member of the quorum joins at "
                    "once, so none holds the state to heal them from; keep one worker alive"
                )
            source = members.index(survivors[0])
        quorum = Quorum(members, quorum_id, joined=self.slot in joining)
        dropped = bool(lost) and self.round_kind == "step"
        return StepPlan(quorum, self.slot in members, events, lost, joining, source, dropped)

    def begin(self, plan: StepPlan, step: int) -> None:
        """Enter the step's quorum on the group and set this worker's compute speed."""
        self._quorum = plan.quorum
        self._step = step
        self.raw.enter(plan.quorum.id, plan.quorum.members)
        if plan.joining:
            self._meet_joiners(plan)
        factor = self.rates.speed_factor(self.slot, step=step, time=self.clock.now())
        self.clock.speed_factor = self.base_speed * factor
        if plan.lost and not plan.dropped and not plan.quorum.joined:
            # (A sync-round method: the survivors learn of the loss at the detection time.)
            self._detect_until = self.clock.now() + self.detection_s

    def _meet_joiners(self, plan: StepPlan) -> None:
        """A joiner's clock moves to the latest member's (an uncharged max over the quorum):
        a worker that was away has no time of its own, and its absence is no wait."""
        times = torch.tensor([self.clock.now()], dtype=torch.float64)
        self.raw.all_reduce(times, op="max", role=Role.OTHER).wait()
        latest = float(times[0])
        if plan.quorum.joined and latest > self.clock.now():
            state = self.clock.state_dict()
            state["now"] = latest
            self.clock.load_state_dict(state)

    def transfer_time(self, start: float, cost: float) -> float:
        """How long a transfer of modeled cost ``cost`` takes from ``start`` (the emulated
        link's model): ``cost / F`` on a link degraded to F; on a link that is down, it
        starts once the link is up again (a link down is placed by time)."""
        begin = start
        factor = self.rates.link_factor(step=self._step, time=begin)
        while factor == 0.0:
            begin = max(
                event.at + float(event.duration or 0.0)
                for event in self.rates.events
                if event.kind == "link_down"
                and event.at_time is not None
                and event.at <= begin < event.at + float(event.duration or 0.0)
            )
            factor = self.rates.link_factor(step=self._step, time=begin)
        return (begin - start) + cost / factor

    def kept_state(self, plan: StepPlan) -> bool:
        """Whether this joining worker rejoins with its own state (``rejoin``)."""
        return any(e.kind == "rejoin" and e.worker == self.slot for e in plan.events)

    def drop(self) -> None:
        """The dropped step's end: wait until the lost member is detected."""
        if self.clock.kind == "real":  # (the deadline read inside the wait: all of it exposed)
            with self.clock.blocked():
                self.clock.wait_until(self.clock.now() + self.detection_s)
        else:
            self.clock.wait_until(self.clock.now() + self.detection_s)
        self.dropped_steps += 1

    def account(
        self,
        tokens: int,
        *,
        committed_round: bool,
        settled: list[tuple[int, bool]] | None = None,
        launched_at: int | None = None,
    ) -> None:
        """Count a step's tokens: committed now (a step round, or the sync that ends a sync
        round, which commits the round's earlier inner steps too), or pending.

        A method whose syncs settle late passes ``settled``, the syncs settled at this step
        (launch step, applied), oldest first; then ``committed_round`` means the step
        launched a sync (at ``launched_at``), which closes the pending tokens into its bucket
        (before the settled ones are taken: a drain may launch and settle one sync at once).
        A settled bucket this worker does not hold (a joiner's inherited sync) commits none.
        """
        self.pending_tokens += tokens
        if settled is None:
            if self.round_kind == "step" or committed_round:
                self.committed_tokens += self.pending_tokens
                self.pending_tokens = 0
            return
        if committed_round:
            assert launched_at is not None
            self.awaiting[launched_at] = self.awaiting.get(launched_at, 0) + self.pending_tokens
            self.pending_tokens = 0
        for launch, applied in settled:
            bucket = self.awaiting.pop(launch, 0)
            if applied:
                self.committed_tokens += bucket

    def note_failed_syncs(self, step: int, count: int) -> None:
        """``count`` syncs failed on every member at ``step`` (rounds dropped)."""
        if count:
            self.failed_syncs[step] = self.failed_syncs.get(step, 0) + count

    def lose_pending(self) -> None:
        """This worker left the quorum: its uncommitted tokens are lost (its syncs in flight
        fail on every member)."""
        self.pending_tokens = 0
        self.awaiting.clear()
