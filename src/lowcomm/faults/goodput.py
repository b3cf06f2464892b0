"""Goodput: what a run with faults keeps of what its workers could have done.

**Accounting** (what a run reports). Goodput is the tokens a run committed divided by the
tokens its M workers would have computed in the same modeled time with no fault::

    fault_free_tokens = M * tokens_per_worker_step * T / fault_free_step_s
    goodput           = committed_tokens / fault_free_tokens
    worker_seconds_lost = M * T * (1 - goodput)

A worker-second lost is one worker's fault-free second that committed nothing: the slot was
empty, the work was dropped, or the worker waited. :func:`absent_worker_seconds` gives the
first part from a trace alone.

**The analytic model** (what ``lowcomm plan`` prices). Symbols, all in modeled seconds:

* M workers, a run of T; each live worker fails at rate lambda = 1 / mtbf_s; a replacement
  joins R = replace_after_s after a crash; the survivors learn of a crash D = detection_s
  after it; a join costs h = heal_s (the new quorum and the healing transfer);
* a fraction f of the slots is slow, by a factor s;
* a step computes for c seconds on one worker and exposes m seconds of communication per
  round of H steps (H = 1 for a method that talks every step). A collective of x seconds
  that overlaps y seconds of compute (streaming_diloco's tau steps, eager's N rounds)
  exposes max(0, x - y); when the slowest worker computes at pace S its compute hides more,
  max(0, x - y S), so m(S) falls with S (``StepCosts.overlapped``), and rho(S) = H c S + m(S).

Expected exposure (:func:`expected_exposure`)::

    a0 = 1 / (1 + lambda R)          fraction of slot-time a worker is alive at the steady
                                     state (up for 1/lambda, down for R, on average)
    a = 1 - lambda a0 (R - R^2 / (2 T))  over a run that starts with every slot filled (a
                                     crash in its last R is empty until T; T < R: R -> T / 2);
        (1 - exp(-lambda T)) / (lambda T) when R is infinite (no replacement)
    n = M a lambda T                 crashes in the run
    j = M a lambda max(0, T - R)     joins in the run (a crash in the last R is not replaced)
    p = 1 - (1 - f)^M                probability that some slot is slow
    S = 1 + (s - 1) p                expected pace of the slowest worker (compute multiplier)

Note that ``a = 1 - n (R - R^2 / (2 T)) / (M T)`` to first order: the empty slots cost
about R worker-seconds a crash, less for those near the run's end.

Each formula below is ``fault-free rate`` times ``worker-time kept``; lost worker-seconds are
divided by M T.

*Synchronous per step* (ddp; :func:`goodput_synchronous`). Every step waits for the
slowest worker, so a step takes tau = c S + m(S) against tau0 = c + m without faults (S the
slowest pace, s or 1: see *Stragglers* below). A crash drops the step it happens in on
every survivor: they compute it, wait the detection and discard it, c S + D each (no
exchange), and each of the other M - 1 slots is alive with probability a. Crashes that fall
on one step drop it once: over a run of K steps, n crashes drop d = K (1 - (1 - 1 / K)^n)
steps (n when crashes are rare). A join stalls every member for h, once per step however
many join at it (j joins heal on K (1 - (1 - 1 / K)^j) steps; G_local and G_late count them
alike)::

    G_sync = (tau0 / tau) * (a - (d (M - 1) a (c S + D) + j M a h) / (M T))

A join's h is the healing broadcast from one member over the quorum's group: each healed
tensor (one per 4 bytes per parameter of the method's global state) costs its transfer and
(M - 1) hops of latency, as the link prices a broadcast over M. An exchange in flight that
a healing passes on (eager's and diloco_delayed's) is sent only while live: the i-th newest
at a join has flown (H + 1) / 2 + (i - 1) H steps on average and is failed with probability
1 - (1 - that / K)^n, so h is priced with its expected tensors. Before they heal, the
members settle the collectives in flight (:meth:`StepCosts.settle_s`): a join u steps after
a launch waits max(0, x - u c S) for the rest of its flight, so every formula's j M a h is
j M a (h + settle(S)), the join at a uniform step of the round (a run's own healings: at
the steps of their rounds they fell on, ``StepCosts.join_phases``).

*Local and DiLoCo* (H inner steps, then a sync; :func:`goodput_local`). A round takes
rho = H c S + m(S) against rho0 = H c + m: stragglers make the others wait at each sync. A
crash loses the dead worker's partial round (rho / 2 on average). It lands at the start of
a step (a run places each event on the first step starting at or after it), step p of the
round with probability c S / rho (the first step, p = 0, (c S + m(S)) / rho: it takes the
crashes during the sync too), and the slowest survivor reaches the sync (H - p) c S later;
the survivors wait for the detection only if it has not happened yet::

    w = sum_{p=0}^{H-1} P(p) max(0, D - (H - p) c S)

(none behind a straggler whose step takes longer than D). The sync's quorum forms after
detection, so the survivors' round is kept. Given a run's own crashes
(``StepCosts.crash_phases``), each at step p of its round costs the dead worker p c S of
it and the survivors max(0, D - (H - p) c S)::

    G_local = (rho0 / rho) * (a - (n (rho / 2 + (M - 1) a w) + j M a h) / (M T))

*A sync that lands N rounds late* (eager and diloco_delayed, N = --diloco.outer-delay; co2,
N = 1; ``goodput_local(dropped_rounds=D)``). A round's tokens commit when its exchange is
applied, N rounds after its launch, and an exchange whose launch quorum lost a member fails
on every member (docs/ALGORITHMS.md, "Membership"), which drops that round of the dead worker
and of every survivor. Round r's exchange flies w_r = min(N, R - (r + 1)) of the run's R
rounds and fails when one of the n crashes, each at a uniform moment, falls in that window,
so the run drops D = sum_r (1 - (1 - w_r / R)^n) rounds (:func:`expected_dropped_rounds`:
N - N (N + 1) / (2 R) for one crash, at most one per exchange when they are many)::

    G_late = (rho0 / rho) * (a - (n (rho / 2 + (M - 1) a w) + D (1 + (M - 1) a) rho
                                  + j M a h) / (M T))

*A sync that overlaps tau steps* (streaming_diloco, cocodc: F fragments, one completing
every H / F steps, each in flight for tau steps; ``goodput_local(last_sync_lost=L)``). A
crash while a fragment's sync flies fails it on every member, but its tokens are not lost:
they wait for the next sync that completes. Only the run's last sync has no next one, so a
crash in the run's last tau steps (n crashes at uniform steps of K: probability
1 - (1 - tau / K)^n) loses every survivor's steps since the previous completed sync, H / F of
them, a fraction 1 / F of a round (:func:`expected_last_sync_lost`)::

    L       = (1 - (1 - tau / K)^n) / F
    G_stream = (rho0 / rho) * (a - (n (rho / 2 + (M - 1) a w) + L (M - 1) a rho
                                    + j M a h) / (M T))

*Stragglers.* A slot is slow with probability f, so some slot is slow with probability
p = 1 - (1 - f)^M, and a method that waits for its slowest worker then runs at its pace s
for the whole run; otherwise at 1. G_sync and G_local are the expectation over the two,
p G(s) + (1 - p) G(1): goodput goes as 1/pace, and 1/E[pace] would overstate a run with a
straggler (at M = 16, f = 0.1, s = 3: 0.38 for the 0.33 such a run keeps).

*Never waiting, with a quorum and a grace window* (decoupled_diloco;
:func:`goodput_decoupled`). Learners never wait for each other or for the synchronizer. A
crash loses only the dead learner's partial round (rho0 / 2); a join costs only the joiner
(h). A straggler computes at 1/s of the pace; its tokens commit when its fragment is merged:
within the grace window g (when (s - 1) H c <= g) it is waited for by the synchronizer; past
it the fragment is left out of that merge and, with ``late_fragments_commit``, merged into
the next one by its token count, otherwise dropped (r = 0)::

    r = 1 / s   (within the window, or late fragments commit);  0 otherwise
    G_dec = a (1 - f + f r) - (n rho0 / 2 + j h) / (M T)
    G_dec = 0 when M a < q (the minimum quorum cannot form)

A run of K ticks (``steps``) ends when its slowest learner ends its last inner step. A
straggler steps at a tick when its clock is less than one step past the others', so its j-th
step falls at tick floor(j s): it takes ceil(K / s) steps (r = ceil(K / s) / K) and the last
ends (ceil(K / s) s - K) c after the others' K rho0 / H. With a straggler (probability p)
the run's time stretches by that tail, in which nobody else computes::

    W = K rho0 / H,  tail = (ceil(K / s) s - K) c
    G_dec,K = (p W / (W + tail) + 1 - p) G_dec

The planner's expectation averages G over the trace's crash count, Poisson with mean n
(:func:`over_crash_counts`), as it averages over the stragglers: G is not linear in it. So
within that average n is a count, and the chance that none of n crashes at uniform moments
falls in a share q of the run is (1 - q)^n (:func:`none_in`), not the Poisson mean's
exp(-n q). It counts the crashes and joins that land on a step (:func:`landed`): those in
the run's last step land on none. A generated trace's joins come R after a crash, so they
heal on the steps after R, and a healing step lasts tau + h: the joins during it land
together on the next step (``Exposure.join_share``, :func:`_healings`).

Every G is clamped to [0, 1]. The model neglects the faults' interactions (a crash during a
stall, a straggler among the dead) and is checked against simulated runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from lowcomm.faults.generate import FaultOptions
from lowcomm.faults.trace import FaultTrace

__all__ = [
    "Exposure",
    "StepCosts",
    "absent_worker_seconds",
    "detection_wait",
    "expected_dropped_rounds",
    "expected_exposure",
    "expected_goodput",
    "expected_last_sync_lost",
    "fault_free_tokens",
    "goodput",
    "goodput_decoupled",
    "goodput_local",
    "goodput_synchronous",
    "landed",
    "none_in",
    "over_crash_counts",
    "worker_seconds_lost",
]


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r}: must be a finite number > 0; pass the measured value")


def _non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0; pass the measured value")


def _workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: a run has at least one worker; pass M >= 1")


# ---- accounting ----------------------------------------------------------------------------


def fault_free_tokens(
    *, workers: int, tokens_per_worker_step: float, fault_free_step_s: float, modeled_s: float
) -> float:
    """The tokens ``workers`` workers compute in ``modeled_s`` seconds with no fault.

    Args:
        workers: M.
        tokens_per_worker_step: the tokens one worker consumes per step.
        fault_free_step_s: the modeled seconds a step takes in the same run without faults.
        modeled_s: the run's modeled time.
    """
    _workers(workers)
    _positive("tokens_per_worker_step", tokens_per_worker_step)
    _positive("fault_free_step_s", fault_free_step_s)
    _non_negative("modeled_s", modeled_s)
    return workers * tokens_per_worker_step * modeled_s / fault_free_step_s


def goodput(*, committed_tokens: float, fault_free_tokens: float) -> float:
    """Committed tokens over the fault-free tokens of the same modeled time.

    Raises:
        ValueError: on negative tokens or a fault-free count that is not > 0.
    """
    _non_negative("committed_tokens", committed_tokens)
    _positive("fault_free_tokens", fault_free_tokens)
    return committed_tokens / fault_free_tokens


def worker_seconds_lost(*, workers: int, modeled_s: float, goodput: float) -> float:
    """``M T (1 - goodput)``: the worker-seconds that committed nothing."""
    _workers(workers)
    _non_negative("modeled_s", modeled_s)
    _non_negative("goodput", goodput)
    return workers * modeled_s * (1.0 - goodput)


def absent_worker_seconds(
    trace: FaultTrace,
    *,
    duration_s: float,
    step_time: Callable[[int], float] | None = None,
) -> float:
    """The worker-seconds in ``[0, duration_s]`` during which a slot had no live worker.

    Args:
        trace: the run's trace.
        duration_s: the run's modeled length.
        step_time: the modeled time at which the run reached a step; needed when the
            trace's membership events are placed by step.

    Raises:
        ValueError: when membership events use ``step=`` and ``step_time`` is None.
    """
    _non_negative("duration_s", duration_s)
    gone_since: dict[int, float] = {}
    absent = 0.0
    for event in trace.membership_events():
        if event.at_step is not None:
            if step_time is None:
                raise ValueError(
                    "step_time=None: this trace places crash/leave/join by step; pass the "
                    "function from a step to its modeled time"
                )
            at = step_time(event.at_step)
        else:
            at = event.at
        at = min(at, duration_s)
        assert event.worker is not None
        if event.kind in ("crash", "leave"):
            gone_since[event.worker] = at
        else:
            absent += at - gone_since.pop(event.worker)
    absent += sum(duration_s - since for since in gone_since.values())
    return absent


# ---- the analytic model --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """What a method's step costs without faults, for the analytic model.

    Attributes:
        compute_s: c, one worker's compute seconds per step.
        sync_s: the communication seconds a round exposes whatever the pace (blocking).
        sync_every: H, the steps per round (1 for a method that talks every step).
        heal_s: h, what a join costs: the new quorum and the healing transfer.
        overlapped: the round's collectives that overlap compute, each (count k, seconds x,
            compute seconds y it overlaps at pace 1): a round exposes k max(0, x - y S) of
            them when the slowest worker computes at pace S (its compute hides them).
        join_phases: the steps of their rounds (0 .. H - 1) at which a run's healings fell,
            to price what its joins waited for the collectives in flight (empty: a join at a
            uniform step, the expectation); read with ``launch_phases``.
        launch_phases: the steps of the round (0 .. H - 1) right after the launches of the
            round's overlapped collective, one per launch (empty: unknown, the expectation).
        detect_phases: the steps of the round at whose end the survivors of a crash wait for
            its detection: those that launch or complete a sync (empty: the round's last).
        crash_phases: the steps of their rounds at which a run's crashes fell, to price
            its dead workers' partial rounds and its detection waits (empty: a crash at a
            uniform moment, the expectation; :meth:`crash_costs`).
    """

    compute_s: float
    sync_s: float = 0.0
    sync_every: int = 1
    heal_s: float = 0.0
    overlapped: tuple[tuple[float, float, float], ...] = ()
    join_phases: tuple[int, ...] = ()
    launch_phases: tuple[int, ...] = ()
    detect_phases: tuple[int, ...] = ()
    crash_phases: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _positive("compute_s", self.compute_s)
        _non_negative("sync_s", self.sync_s)
        _non_negative("heal_s", self.heal_s)
        for count, seconds, hidden in self.overlapped:
            _non_negative("overlapped count", count)
            _non_negative("overlapped seconds", seconds)
            _non_negative("overlapped compute seconds", hidden)
        if (
            isinstance(self.sync_every, bool)
            or not isinstance(self.sync_every, int)
            or self.sync_every < 1
        ):
            raise ValueError(
                f"sync_every={self.sync_every!r}: a round has at least one step; pass H >= 1"
            )

    def exposed_s(self, pace: float = 1.0) -> float:
        """m(S): the communication a round exposes when its slowest worker's pace is S."""
        return self.sync_s + sum(
            count * max(0.0, seconds - hidden * pace) for count, seconds, hidden in self.overlapped
        )

    def settle_s(self, pace: float = 1.0) -> float:
        """What a join waits for the overlapped collectives in flight, which the members
        settle before they heal it: the join falls at a uniform step of the round, u steps
        after a launch (k per round of H steps, each in flight for y / c steps), and waits
        for the rest of its flight, max(0, x - u c S)::

            settle(S) = sum over collectives (k / H) sum_{u < y / c} max(0, x - u c S)

        With ``join_phases`` and ``launch_phases``, the mean over those healings instead: a
        healing at step q of its round is u = (q - l) mod H steps after the launch whose next
        step is l, and waits for it and for those launched H, 2 H, ... steps before it still
        in flight."""
        total = 0.0
        for count, seconds, hidden in self.overlapped:
            flight_steps = math.ceil(hidden / self.compute_s - 1e-9)

            def wait(u: int, seconds: float = seconds) -> float:
                return max(0.0, seconds - u * self.compute_s * pace)

            if self.join_phases and len(self.launch_phases) == count:
                waits = [
                    sum(
                        wait(u)
                        for launch in self.launch_phases
                        for u in range(
                            (phase - launch) % self.sync_every, flight_steps, self.sync_every
                        )
                    )
                    for phase in self.join_phases
                ]
                total += sum(waits) / len(waits)
            else:
                waits_uniform = sum(wait(u) for u in range(flight_steps))
                total += count / self.sync_every * waits_uniform
        return total

    def crash_costs(self, detection_s: float, pace: float = 1.0) -> tuple[float, float]:
        """What a crash costs a round of workers at pace S: the dead worker's partial round
        (rho / 2, a crash at a uniform moment) and the survivors' wait for its detection
        (:func:`detection_wait`, at the steps ``detect_phases``). With ``crash_phases``, the
        mean over a run's crashes instead: one at step p of its round has computed p c S of
        it, and the survivors wait max(0, D - k(p) c S) (:func:`steps_to_detection`)."""
        step = self.compute_s * pace
        if not self.crash_phases:
            wait = detection_wait(
                detection_s, step, self.sync_every, self.exposed_s(pace), self.detect_phases
            )
            return self.round_at(pace) / 2.0, wait
        count = len(self.crash_phases)
        partial = sum(phase * step for phase in self.crash_phases) / count
        to_detection = steps_to_detection(self.sync_every, self.detect_phases)
        waits = [max(0.0, detection_s - to_detection[p] * step) for p in self.crash_phases]
        return partial, sum(waits) / count

    def round_at(self, pace: float) -> float:
        """rho(S) = H c S + m(S), a round waiting for a worker at pace S."""
        return self.sync_every * self.compute_s * pace + self.exposed_s(pace)

    @property
    def round_s(self) -> float:
        """rho0 = H c + m, a fault-free round (m = m(1))."""
        return self.round_at(1.0)


@dataclass(frozen=True, kw_only=True)
class Exposure:
    """The expected faults of a run, as the formulas use them (see the module docstring).

    Attributes:
        workers: M.
        duration_s: T.
        alive_fraction: a, the fraction of slot-time a worker is alive.
        crashes: n, crashes in the run.
        joins: j, joins in the run.
        detection_s: D.
        slow_fraction: f.
        slow_factor: s.
        slow_present: p, the probability that some slot is slow (None: 1 - (1 - f)^M, the
            generated trace's; 1 or 0 for a run whose slots are known).
        join_share: for joins drawn at uniform moments (a generated trace's expectation),
            the share of the run's steps on which they can land, over which those that
            share a step heal once: they come R after a crash, so none in the first R of T
            ((T - R) / T); and a healing step lasts longer, so the joins during it land
            together on the next step (:func:`_healings`). None: a run's own joins, counted
            from the steps they fell on (over all K, uniform).
    """

    workers: int
    duration_s: float
    alive_fraction: float = 1.0
    crashes: float = 0.0
    joins: float = 0.0
    detection_s: float = 0.0
    slow_fraction: float = 0.0
    slow_factor: float = 1.0
    slow_present: float | None = None
    join_share: float | None = None

    def __post_init__(self) -> None:
        _workers(self.workers)
        _positive("duration_s", self.duration_s)
        if not 0 <= self.alive_fraction <= 1:
            raise ValueError(
                f"alive_fraction={self.alive_fraction!r}: a fraction of slot-time is in [0, 1]"
            )
        _non_negative("crashes", self.crashes)
        _non_negative("joins", self.joins)
        _non_negative("detection_s", self.detection_s)
        if not 0 <= self.slow_fraction <= 1:
            raise ValueError(f"slow_fraction={self.slow_fraction!r}: must be in [0, 1]")
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1):
            raise ValueError(f"slow_factor={self.slow_factor!r}: a slowdown is >= 1")
        if self.slow_present is not None and not 0 <= self.slow_present <= 1:
            raise ValueError(f"slow_present={self.slow_present!r}: a probability is in [0, 1]")
        if self.join_share is not None and not 0 < self.join_share <= 1:
            raise ValueError(f"join_share={self.join_share!r}: a share of the steps in (0, 1]")

    @property
    def some_slow(self) -> float:
        """p = 1 - (1 - f)^M (or ``slow_present``): the probability that some slot is slow."""
        if self.slow_present is not None:
            return self.slow_present
        return 1.0 - (1.0 - self.slow_fraction) ** self.workers

    @property
    def slowest_pace(self) -> float:
        """S = 1 + (s - 1) p: the expected compute multiplier of the slowest worker."""
        return 1.0 + (self.slow_factor - 1.0) * self.some_slow

    @property
    def live_workers(self) -> float:
        """M a, the expected live workers."""
        return self.workers * self.alive_fraction


def expected_exposure(options: FaultOptions, *, workers: int) -> Exposure:
    """The expected faults of a generated trace's run (see the module docstring)."""
    _workers(workers)
    rate = options.failure_rate
    duration = options.duration_s
    if rate == 0.0:
        alive = 1.0
    elif math.isinf(options.replace_after_s):
        alive = (1.0 - math.exp(-rate * duration)) / (rate * duration)
    else:
        # (A slot empties at rate lambda a0, a0 = 1 / (1 + lambda R) alive at the steady
        # state, for R; a run starts with every slot filled, so a crash in its last R is
        # empty only until T: away for R - R^2 / (2 T) on average, T / 2 when T < R.)
        replace_after = options.replace_after_s
        away = replace_after - replace_after**2 / (2.0 * duration)
        if duration < replace_after:
            away = duration / 2.0
        alive = 1.0 - rate / (1.0 + rate * replace_after) * away
    crashes = workers * alive * rate * duration
    joins = workers * alive * rate * max(0.0, duration - options.replace_after_s)
    return Exposure(
        workers=workers,
        duration_s=duration,
        alive_fraction=alive,
        crashes=crashes,
        joins=joins,
        detection_s=options.detection_s,
        slow_fraction=options.slow_fraction,
        slow_factor=options.slow_factor,
        join_share=max(0.0, duration - options.replace_after_s) / duration or None,
    )


def landed(exposure: Exposure, *, last_step_s: float, replace_after_s: float) -> Exposure:
    """The expected crashes and joins that land on a step of the run: a run places an event
    on the first step that starts at or after it, so those in its last step (of
    ``last_step_s`` seconds: the slowest worker's compute and the sync it exposes) land on
    none and cost nothing. Over a run of T, the n crashes of the window T - t_last land
    (n (T - t_last) / T), and the joins of those that were replaced within it,
    j (T - t_last - R) / (T - R). The time away is the trace's over all of T (as a run's
    own is counted)."""
    _non_negative("last_step_s", last_step_s)
    duration = exposure.duration_s
    window = max(0.0, duration - last_step_s)
    joins = exposure.joins
    if joins > 0.0 and duration > replace_after_s:
        joins *= max(0.0, window - replace_after_s) / (duration - replace_after_s)
    return replace(exposure, crashes=exposure.crashes * window / duration, joins=joins)


def _clamp(value: float) -> float:
    return min(1.0, max(0.0, value))


def _over_stragglers(exposure: Exposure, goodput_at: Callable[[float], float]) -> float:
    """E[G] over the slowest worker's pace: s when some slot is slow (probability p), else
    1. A run that waits for its slowest worker keeps 1/pace of its rate, and E[1/S] is not
    1/E[S]: at M = 16 and f = 0.1 the slowest pace averages 2.6 (s = 3), but a run goes at 1
    or at 1/3 of its rate, never at 1/2.6."""
    e = exposure
    some_slow = e.some_slow
    if e.slow_factor == 1.0 or some_slow == 0.0:
        return goodput_at(1.0)
    if some_slow == 1.0:
        return goodput_at(e.slow_factor)
    return some_slow * goodput_at(e.slow_factor) + (1.0 - some_slow) * goodput_at(1.0)


def goodput_synchronous(
    exposure: Exposure, costs: StepCosts, *, steps: float | None = None
) -> float:
    """G_sync: a method that waits for every worker at every step (ddp). ``steps``: the run's
    K steps, over which crashes that fall on one step drop it once (None: every crash drops
    a step of its own)."""
    e = exposure
    dropped = _per_step(e.crashes, steps)

    def at(pace: float) -> float:
        fault_free_step = costs.round_s / costs.sync_every
        step = costs.round_at(pace) / costs.sync_every
        joins = _healings(e, steps, step, costs.heal_s + costs.settle_s(pace))
        survivors = (e.workers - 1) * e.alive_fraction
        lost = dropped * survivors * (
            costs.compute_s * pace + e.detection_s
        ) + joins * e.live_workers * (costs.heal_s + costs.settle_s(pace))
        return _clamp(
            fault_free_step / step * (e.alive_fraction - lost / (e.workers * e.duration_s))
        )

    return _over_stragglers(e, at)


def detection_wait(
    detection_s: float,
    step_s: float,
    steps: int,
    sync_s: float = 0.0,
    detect_phases: tuple[int, ...] = (),
) -> float:
    """w: how long the survivors of a crash wait at the round's sync for its detection (D =
    ``detection_s``), in a round of H = ``steps`` steps of c S = ``step_s`` (the slowest
    worker's) and ``sync_s`` = m(S) of exposed sync. A crash at a uniform moment lands at the
    start of the next step: at step p of the round with probability c S / rho, or
    (c S + m) / rho for the round's first step (it takes the crashes that fall during the
    sync too; rho = H c S + m). The survivors wait at the end of the next step that waits for
    a pending detection (``detect_phases``; none given: the round's last, its sync), k(p)
    steps later, max(0, D - k(p) c S)::

        w = sum_{p=0}^{H-1} P(p) max(0, D - k(p) c S)
    """
    round_s = steps * step_s + sync_s
    if not round_s > 0:
        return detection_s
    waits = [max(0.0, detection_s - k * step_s) for k in steps_to_detection(steps, detect_phases)]
    return ((step_s + sync_s) * waits[0] + step_s * sum(waits[1:])) / round_s


def steps_to_detection(steps: int, detect_phases: tuple[int, ...] = ()) -> list[int]:
    """k(p) for p = 0 .. H - 1: the steps from the start of step p of a round of H = ``steps``
    steps to the end of the next step at which the survivors wait for a pending detection
    (``detect_phases``, the steps of the round whose end launches or completes a sync; none
    given: the round's last step)."""
    ends = detect_phases or (steps - 1,)
    return [min((end - phase) % steps for end in ends) + 1 for phase in range(steps)]


def expected_dropped_rounds(crashes: float, rounds_late: int, rounds: float) -> float:
    """D, the expected number of exchanges that fail in a run of ``rounds`` rounds (R) with
    ``crashes`` crashes (n) at uniform moments, when each round's exchange lands
    ``rounds_late`` (N) rounds after its launch and fails if a crash falls while it flies.
    Round r's exchange flies w_r = min(N, R - (r + 1)) rounds, so

        D = sum_{r=0}^{floor(R)-1} (1 - (1 - w_r / R)^n),

    the mean number in flight at a crash (N - N (N + 1) / (2 R)) for one crash, and at most
    the exchanges a run launches when they are many: crashes that fall on one exchange drop
    it once. n is a count (:func:`none_in`)."""
    _non_negative("crashes", crashes)
    _non_negative("rounds", rounds)
    if isinstance(rounds_late, bool) or not isinstance(rounds_late, int) or rounds_late < 0:
        raise ValueError(
            f"rounds_late={rounds_late!r}: a count of rounds >= 0; pass 0 for a sync that "
            "lands where it is launched"
        )
    if rounds_late == 0 or crashes == 0.0 or rounds <= 1.0:
        return 0.0
    # (The launches whose exchange flies all N rounds share one term; the last few, cut by
    # the run's end, are summed one by one.)
    launches = int(rounds)
    whole = min(launches, max(0, math.floor(rounds - 1 - rounds_late) + 1))
    total = whole * (1.0 - none_in(crashes, rounds_late / rounds))
    for launch in range(whole, launches):
        window = max(0.0, min(float(rounds_late), rounds - (launch + 1)))
        total += 1.0 - none_in(crashes, window / rounds)
    return total


def expected_last_sync_lost(
    crashes: float, *, overlap_steps: int, fragments: int, steps: float
) -> float:
    """L, the expected fraction of a round every survivor loses at the run's end, for a
    method whose syncs overlap ``overlap_steps`` (tau) steps and whose tokens wait for the
    next sync that completes (streaming_diloco, cocodc): the run's last sync fails when a
    crash falls in its last tau steps (n crashes at uniform steps of K), and then the steps
    since the previous completed sync, 1 / F of a round (``fragments`` = F), never commit::

        L = (1 - (1 - tau / K)^n) / F
    """
    _non_negative("crashes", crashes)
    _positive("steps", steps)
    for name, value, least in (("overlap_steps", overlap_steps, 0), ("fragments", fragments, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r}: a count >= {least}; pass the run's option")
    window = min(float(overlap_steps), steps)
    return (1.0 - none_in(crashes, window / steps)) / fragments


def _per_step(events: float, steps: float | None) -> float:
    """The steps on which ``events`` events at uniform moments of a run of ``steps`` steps
    fall, K (1 - (1 - 1 / K)^n) (:func:`none_in`): events on one step count once (a step
    drops once, one healing heals every joiner of a step). None: each event on a step of its
    own."""
    if steps is None:
        return events
    _positive("steps", steps)
    return steps * (1.0 - none_in(events, 1.0 / steps))


def _healings(
    exposure: Exposure, steps: float | None, step_s: float = 0.0, heal_s: float = 0.0
) -> float:
    """The steps on which the run's joins heal (:func:`_per_step`). Joins drawn at uniform
    moments (``join_share`` given) land on the K' = K share steps after R, and a healing step
    lasts tau + h against tau (``step_s``, ``heal_s``): the joins that come during it land
    together on the next step, so d healings of j joins satisfy, over L = K' tau + d h
    seconds::

        d = (K' - d) (1 - (1 - tau / L)^j) + d (1 - (1 - (tau + h) / L)^j)
    """
    j = exposure.joins
    if j == 0.0 or steps is None:
        return j
    if exposure.join_share is None:
        return _per_step(j, steps)
    window = steps * exposure.join_share
    healed = _per_step(j, window)
    if not (step_s > 0.0 and heal_s > 0.0):
        return healed
    for _ in range(50):
        length = window * step_s + healed * heal_s
        following = healed * (1.0 - none_in(j, (step_s + heal_s) / length))
        updated = (window - healed) * (1.0 - none_in(j, step_s / length)) + following
        if abs(updated - healed) < 1e-12:
            break
        healed = updated
    return updated


def none_in(events: float, share: float) -> float:
    """The probability that none of ``events`` events at independent uniform moments of a
    run falls in a ``share`` of it, (1 - q)^n (0 when q >= 1 and n > 0).

    The count n is given, not a Poisson mean: the planner's expectation averages over the
    trace's crash count itself (:func:`over_crash_counts`), and the Poisson form
    exp(-n q), averaged over a Poisson count again, would put exp(-n (1 - exp(-q))) where
    the trace has exp(-n q): too few dropped steps and failed exchanges when q is large
    (a round of a run of few rounds)."""
    if events <= 0.0:
        return 1.0
    if share >= 1.0:
        return 0.0
    return math.exp(events * math.log1p(-share))


def goodput_local(
    exposure: Exposure,
    costs: StepCosts,
    *,
    dropped_rounds: float = 0.0,
    last_sync_lost: float = 0.0,
    steps: float | None = None,
) -> float:
    """G_local: H steps alone, then a sync that waits for every live worker (local SGD,
    DiLoCo, streaming DiLoCo); with ``dropped_rounds`` = D > 0, G_late: a method whose round
    lands rounds after its launch (eager, diloco_delayed, co2) loses D rounds of every member
    of their quorums to the exchanges that failed (:func:`expected_dropped_rounds`); with
    ``last_sync_lost`` = L > 0, G_stream: a method whose overlapped syncs' tokens wait for
    the next completed one loses L rounds of every survivor when the run's last sync fails
    (:func:`expected_last_sync_lost`)."""
    e = exposure
    _non_negative("dropped_rounds", dropped_rounds)
    _non_negative("last_sync_lost", last_sync_lost)

    def at(pace: float) -> float:
        round_s = costs.round_at(pace)
        heal = costs.heal_s + costs.settle_s(pace)
        joins = _healings(e, steps, round_s / costs.sync_every, heal)
        partial, wait = costs.crash_costs(e.detection_s, pace)
        survivors = (e.workers - 1) * e.alive_fraction
        dropped = (dropped_rounds * (1.0 + survivors) + last_sync_lost * survivors) * round_s
        lost = e.crashes * (partial + survivors * wait) + dropped + joins * e.live_workers * heal
        return _clamp(
            costs.round_s / round_s * (e.alive_fraction - lost / (e.workers * e.duration_s))
        )

    return _over_stragglers(e, at)


def goodput_decoupled(
    exposure: Exposure,
    costs: StepCosts,
    *,
    min_quorum: int,
    grace_s: float,
    late_fragments_commit: bool = True,
    steps: float | None = None,
) -> float:
    """G_dec: learners that never wait, merged by a quorum with a grace window
    (decoupled_diloco).

    Args:
        exposure: the run's expected faults.
        costs: the method's fault-free costs.
        min_quorum: q, the fewest learners a merge needs.
        grace_s: g, how long the synchronizer waits past the quorum for more fragments.
        late_fragments_commit: whether a fragment that misses the window is merged later
            (its tokens commit) rather than dropped.
        steps: the run's K ticks, which end when its slowest learner ends its last inner
            step (None: a run long enough for that tail not to count).
    """
    e = exposure
    if isinstance(min_quorum, bool) or not isinstance(min_quorum, int) or min_quorum < 1:
        raise ValueError(f"min_quorum={min_quorum!r}: a merge needs at least one learner")
    _non_negative("grace_s", grace_s)
    if e.live_workers < min_quorum:
        return 0.0
    lag = (e.slow_factor - 1.0) * costs.sync_every * costs.compute_s
    commits = lag <= grace_s or late_fragments_commit
    share, stretch = 1.0 / e.slow_factor, 1.0
    if steps is not None:
        _positive("steps", steps)
        done, tail_s = _straggler_steps(steps, e.slow_factor, costs.compute_s)
        share = done / steps
        run_s = steps * costs.round_s / costs.sync_every
        stretch = e.some_slow * run_s / (run_s + tail_s) + (1.0 - e.some_slow)
    pace = 1.0 - e.slow_fraction + e.slow_fraction * (share if commits else 0.0)
    lost = e.crashes * costs.round_s / 2.0 + e.joins * costs.heal_s
    return _clamp(stretch * (e.alive_fraction * pace - lost / (e.workers * e.duration_s)))


def _straggler_steps(steps: float, slow_factor: float, compute_s: float) -> tuple[float, float]:
    """A learner s times slower over a run of K ticks: its inner steps, ceil(K / s) (it steps
    at a tick when its clock is less than one step past the others', so its j-th step at tick
    floor(j s)), and how long its last one runs past the others' end, (ceil(K / s) s - K) c."""
    done = float(math.ceil(steps / slow_factor - 1e-9))
    return done, max(0.0, done * slow_factor - steps) * compute_s


#: Up to this many expected crashes, :func:`over_crash_counts` averages over the count.
POISSON_UP_TO = 400.0


def over_crash_counts(exposure: Exposure, goodput_of: Callable[[Exposure], float]) -> float:
    """E[G] over the run's crash count k, Poisson with mean n, the joins and the time away
    scaled with it (j k / n; 1 - a as (1 - a) k / n): a generated trace's crashes are
    independent draws, and G is not linear in them (crashes that fall on one step or
    exchange count once; G is clamped at 0), so G at the mean count is not the mean G. Past
    :data:`POISSON_UP_TO` crashes (a relative spread under 5%) G at the mean is taken."""
    n = exposure.crashes
    if n == 0.0 or n > POISSON_UP_TO:
        return goodput_of(exposure)
    spread = 8.0 * math.sqrt(n) + 8.0
    total = weight = 0.0
    for k in range(max(0, math.floor(n - spread)), math.ceil(n + spread) + 1):
        probability = math.exp(k * math.log(n) - n - math.lgamma(k + 1))
        scaled = replace(
            exposure,
            crashes=float(k),
            joins=exposure.joins * k / n,
            alive_fraction=max(0.0, 1.0 - (1.0 - exposure.alive_fraction) * k / n),
        )
        total += probability * goodput_of(scaled)
        weight += probability
    return total / weight


def expected_goodput(
    family: str,
    options: FaultOptions,
    *,
    workers: int,
    costs: StepCosts,
    min_quorum: int = 1,
    grace_s: float = 0.0,
) -> float:
    """The planner's expected goodput of a method family under a generated trace's options.

    Args:
        family: ``synchronous`` (ddp), ``local`` (local SGD, the DiLoCo family) or
            ``decoupled`` (decoupled_diloco).
        options: the generated trace's options.
        workers: M.
        costs: the method's fault-free step costs.
        min_quorum: q, for ``decoupled``.
        grace_s: g, for ``decoupled``.

    Raises:
        ValueError: on an unknown family.
    """
    exposure = expected_exposure(options, workers=workers)
    if family == "synchronous":
        return over_crash_counts(exposure, lambda e: goodput_synchronous(e, costs))
    if family == "local":
        return over_crash_counts(exposure, lambda e: goodput_local(e, costs))
    if family == "decoupled":
        return over_crash_counts(
            exposure,
            lambda e: goodput_decoupled(e, costs, min_quorum=min_quorum, grace_s=grace_s),
        )
    raise ValueError(
        f"family={family!r}: the model knows synchronous, local and decoupled; pick the one "
        "whose waiting the method shares"
    )
