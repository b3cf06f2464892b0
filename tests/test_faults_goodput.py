"""Goodput accounting and the analytic goodput model, on cases computed by hand from the
formulas in lowcomm.faults.goodput's docstring."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lowcomm.faults import (
    Exposure,
    FaultOptions,
    StepCosts,
    absent_worker_seconds,
    expected_exposure,
    expected_goodput,
    fault_free_tokens,
    generate_trace,
    parse_trace,
    worker_seconds_lost,
)
from lowcomm.faults.goodput import (
    detection_wait,
    expected_dropped_rounds,
    goodput,
    goodput_decoupled,
    goodput_local,
    goodput_synchronous,
)


def test_the_package_attribute_goodput_is_the_module() -> None:
    import lowcomm.faults.goodput as module

    assert module.goodput is goodput


def test_goodput_is_committed_over_fault_free_tokens() -> None:
    # 4 workers, 1000 tokens a step, 0.5 s a step, 10 s: 4 * 1000 * 20 tokens without faults.
    reference = fault_free_tokens(
        workers=4, tokens_per_worker_step=1000, fault_free_step_s=0.5, modeled_s=10.0
    )
    assert reference == 80_000
    assert goodput(committed_tokens=60_000, fault_free_tokens=reference) == 0.75
    assert worker_seconds_lost(workers=4, modeled_s=10.0, goodput=0.75) == 10.0


def test_bad_accounting_inputs_end_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^fault_free_tokens=0: must be a finite number > 0"):
        goodput(committed_tokens=1, fault_free_tokens=0)
    with pytest.raises(ValueError, match=r"^workers=0: a run has at least one worker"):
        fault_free_tokens(workers=0, tokens_per_worker_step=1, fault_free_step_s=1, modeled_s=1)


def test_absent_worker_seconds_from_a_trace() -> None:
    trace = parse_trace("t=2 worker=0 crash\nt=5 worker=0 join\nt=8 worker=1 leave\n", workers=3)
    assert absent_worker_seconds(trace, duration_s=10.0) == 3.0 + 2.0
    assert absent_worker_seconds(trace, duration_s=6.0) == 3.0  # the leave is after the end
    by_step = parse_trace("step=4 worker=0 crash\nstep=10 worker=0 join\n", workers=2)
    assert absent_worker_seconds(by_step, duration_s=10.0, step_time=lambda s: 0.5 * s) == 3.0
    with pytest.raises(ValueError, match="pass the function from a step to its modeled time"):
        absent_worker_seconds(by_step, duration_s=10.0)


def test_no_faults_keep_all_the_goodput_in_every_family() -> None:
    options = FaultOptions(duration_s=100.0)
    costs = StepCosts(compute_s=1.0, sync_s=0.5, sync_every=10, heal_s=3.0)
    for family in ("synchronous", "local", "decoupled"):
        assert expected_goodput(family, options, workers=8, costs=costs) == 1.0


# One crash of one of 4 workers, replaced after R = 20 s, in a run of T = 100 s, detected
# after D = 5 s: the slot is empty 20 of the 400 worker-seconds, so a = 0.95; each of the
# other 3 slots is alive with probability a, so (M - 1) a = 2.85 survivors wait.
ONE_CRASH = Exposure(
    workers=4, duration_s=100.0, alive_fraction=0.95, crashes=1.0, joins=1.0, detection_s=5.0
)


def test_one_crash_synchronous_by_hand() -> None:
    # tau = 0.8 + 0.2 = 1 s; the survivors compute the dropped step, wait the detection and
    # discard it: c + D = 5.8 s each (no exchange).
    costs = StepCosts(compute_s=0.8, sync_s=0.2)
    expected = 0.95 - 2.85 * 5.8 / 400.0
    assert goodput_synchronous(ONE_CRASH, costs) == pytest.approx(expected, rel=1e-12)
    # Counted exactly: 20 empty worker-seconds and 3 survivors stalled 5.8 s: 1 - 37.4/400.
    assert goodput_synchronous(ONE_CRASH, costs) == pytest.approx(0.9065, abs=0.003)
    # A join that costs 2 s stalls the 3.8 live workers once more.
    healing = StepCosts(compute_s=0.8, sync_s=0.2, heal_s=2.0)
    assert goodput_synchronous(ONE_CRASH, healing) == pytest.approx(expected - 3.8 * 2 / 400)
    # Crashes that fall on one step drop it once: 2 crashes at uniform moments of 4 steps
    # drop 4 (1 - (3/4)^2) = 1.75 (the second misses the first's step with probability 3/4).
    two = Exposure(workers=4, duration_s=100.0, alive_fraction=0.95, crashes=2.0, detection_s=5.0)
    dropped = 1.75
    assert goodput_synchronous(two, costs, steps=4) == pytest.approx(
        0.95 - dropped * 2.85 * 5.8 / 400.0, rel=1e-12
    )


def test_joins_on_one_step_heal_once() -> None:
    # 3 joins at uniform moments of a run of 4 steps fall on 4 (1 - (3/4)^3) = 2.3125 steps,
    # each healing once (h = 2 s for the 4 live workers), in both models.
    joins = Exposure(workers=4, duration_s=100.0, joins=3.0)
    healed = 2.3125
    costs = StepCosts(compute_s=0.8, sync_s=0.2, heal_s=2.0)
    expected = 1 - healed * 4 * 2.0 / 400.0
    assert goodput_synchronous(joins, costs, steps=4) == pytest.approx(expected, rel=1e-12)
    assert goodput_local(joins, costs, steps=4) == pytest.approx(expected, rel=1e-12)
    assert goodput_local(joins, costs) == pytest.approx(1 - 3 * 4 * 2.0 / 400.0, rel=1e-12)


def test_one_crash_local_by_hand() -> None:
    # rho = 10 * 0.8 + 2 = 10 s. The crash lands at the start of the next step, k = 10 - p
    # steps of 0.8 s before the sync: at step p >= 1 with probability 0.8 / 10, at the first
    # (k = 10, which also takes the crashes during the 2-s sync) with 2.8 / 10. The
    # survivors wait max(0, D - 0.8 k): w = (4.2 + 3.4 + 2.6 + 1.8 + 1.0 + 0.2) 0.08 =
    # 1.056 s; the dead worker loses half a round, 5 s.
    costs = StepCosts(compute_s=0.8, sync_s=2.0, sync_every=10)
    assert detection_wait(5.0, 0.8, 10, 2.0) == pytest.approx(1.056, rel=1e-12)
    # D past the round, no sync time: D - (H + 1) / 2 c.
    assert detection_wait(15.0, 1.0, 10) == pytest.approx(15.0 - 5.5, rel=1e-12)
    expected = 0.95 - (5.0 + 2.85 * 1.056) / 400.0
    assert goodput_local(ONE_CRASH, costs) == pytest.approx(expected, rel=1e-12)
    # A run's own crash, at the round's last step (phase 9): the dead worker computed 9 of
    # its steps, and the sync comes one step later, so the survivors wait 5 - 0.8 s.
    at_last = dataclasses.replace(costs, crash_phases=(9,))
    assert at_last.crash_costs(5.0) == pytest.approx((9 * 0.8, 4.2), rel=1e-12)
    expected = 0.95 - (9 * 0.8 + 2.85 * 4.2) / 400.0
    assert goodput_local(ONE_CRASH, at_last) == pytest.approx(expected, rel=1e-12)


def test_one_crash_decoupled_by_hand() -> None:
    # Nobody waits: only the dead learner's half round is lost besides its empty slot.
    costs = StepCosts(compute_s=0.8, sync_s=2.0, sync_every=10)
    expected = 0.95 - 5.0 / 400.0
    assert goodput_decoupled(ONE_CRASH, costs, min_quorum=2, grace_s=0.0) == pytest.approx(
        expected, rel=1e-12
    )
    # A quorum the live workers cannot form commits nothing.
    assert goodput_decoupled(ONE_CRASH, costs, min_quorum=4, grace_s=0.0) == 0.0


def test_stragglers_by_hand() -> None:
    # 10 workers, each slow with probability 0.1 by 3x: some slot is slow with probability
    # p = 1 - 0.9^10, and the slowest paces at S = 1 + 2 p on average.
    stragglers = Exposure(workers=10, duration_s=100.0, slow_fraction=0.1, slow_factor=3.0)
    p = 1.0 - 0.9**10
    pace = 1.0 + 2.0 * p
    assert stragglers.slowest_pace == pytest.approx(pace, rel=1e-12)
    costs = StepCosts(compute_s=1.0, sync_s=1.0, sync_every=4)
    # A run waits for a slow slot (pace 3) with probability p, else runs at pace 1: the
    # expectation is p G(3) + (1 - p) G(1), not G at the mean pace.
    expected = p / 3.0 + (1.0 - p)
    assert goodput_synchronous(stragglers, StepCosts(compute_s=1.0)) == pytest.approx(expected)
    assert goodput_synchronous(stragglers, StepCosts(compute_s=1.0)) > 1 / pace
    assert goodput_local(stragglers, costs) == pytest.approx(p * 5.0 / 13.0 + (1.0 - p))
    # Every run has a straggler when every slot is slow.
    every = Exposure(workers=10, duration_s=100.0, slow_fraction=1.0, slow_factor=3.0)
    assert goodput_local(every, costs) == pytest.approx(5.0 / 13.0)
    # Decoupled: a straggler's tokens come at a third of the pace and nobody waits for it.
    assert goodput_decoupled(stragglers, costs, min_quorum=1, grace_s=0.0) == pytest.approx(
        0.9 + 0.1 / 3
    )
    # If late fragments were dropped, a straggler 8 s behind a 5 s window commits nothing,
    # and one inside a 10 s window still commits its third.
    dropped = goodput_decoupled(
        stragglers, costs, min_quorum=1, grace_s=5.0, late_fragments_commit=False
    )
    assert dropped == pytest.approx(0.9)
    waited = goodput_decoupled(
        stragglers, costs, min_quorum=1, grace_s=10.0, late_fragments_commit=False
    )
    assert waited == pytest.approx(0.9 + 0.1 / 3)


def test_a_sync_landing_rounds_late_loses_the_rounds_it_drops_of_every_member() -> None:
    # ONE_CRASH: 4 workers, 100 s, one crash, a = 0.95, D = 5 s. A round of 10 steps of
    # 0.8 s and 2 s exposed: rho = 10 s. The crash loses the dead worker's half round and the
    # survivors' wait for the detection, 1.056 s each (test_one_crash_local_by_hand); each
    # dropped round, a round rho of the dead worker and of each of the (M - 1) a survivors.
    costs = StepCosts(compute_s=0.8, sync_s=2.0, sync_every=10)
    survivors = 3 * 0.95
    base = 5.0 + survivors * 1.056
    for dropped in (0.0, 0.5, 2.0):
        lost = base + dropped * (1.0 + survivors) * 10.0
        expected = 0.95 - lost / 400.0
        assert goodput_local(ONE_CRASH, costs, dropped_rounds=dropped) == pytest.approx(
            expected, rel=1e-12
        )
    with pytest.raises(ValueError, match=r"^dropped_rounds=-1: must be a finite number >= 0"):
        goodput_local(ONE_CRASH, costs, dropped_rounds=-1)


def test_the_expected_dropped_rounds_by_hand() -> None:
    # R = 5 rounds, N = 1: the exchanges of rounds 0-3 fly one round each, round 4's none
    # (the run ends); each of n crashes at uniform moments falls in a given round with
    # probability 1/5, so an exchange survives all n with probability (4/5)^n (3 crashes:
    # 4 (1 - 0.512) = 1.952; the Poisson form 4 (1 - e^(-3/5)) = 1.805 is the mean over a
    # Poisson count, which the planner draws itself: lowcomm.faults.goodput.none_in).
    assert expected_dropped_rounds(3.0, 1, 5.0) == pytest.approx(1.952, rel=1e-12)
    assert expected_dropped_rounds(0.5, 1, 5.0) == pytest.approx(4 * (1 - 0.8**0.5), rel=1e-12)
    # One crash drops the mean number in flight at a uniform moment, N - N (N + 1) / (2 R).
    assert expected_dropped_rounds(1.0, 2, 10.0) == pytest.approx(2 - 3 / 10, rel=1e-12)
    # Many crashes drop each exchange once: at most those that fly.
    assert expected_dropped_rounds(1e4, 1, 5.0) == pytest.approx(4.0)
    assert expected_dropped_rounds(3.0, 0, 5.0) == 0.0


def test_expected_exposure_of_generated_options_by_hand() -> None:
    options = FaultOptions(duration_s=1000.0, mtbf_s=100.0, replace_after_s=25.0)
    exposure = expected_exposure(options, workers=4)
    # 1 - 0.01 * 0.8 * (25 - 25^2 / 2000): the steady state's a0 = 1 / (1 + 0.01 * 25) = 0.8,
    # but a crash in the last 25 s is empty only until T.
    assert exposure.alive_fraction == pytest.approx(0.8025)
    assert exposure.crashes == pytest.approx(32.1)  # 4 * 0.8025 * 0.01 * 1000
    assert exposure.joins == pytest.approx(31.2975)  # 4 * 0.8025 * 0.01 * 975
    never_replaced = expected_exposure(FaultOptions(duration_s=1000.0, mtbf_s=100.0), workers=4)
    assert never_replaced.alive_fraction == pytest.approx((1 - math.exp(-10.0)) / 10.0)
    assert never_replaced.joins == 0.0


def test_the_models_alive_fraction_matches_generated_traces() -> None:
    options = FaultOptions(duration_s=1000.0, mtbf_s=100.0, replace_after_s=25.0, seed=11)
    workers = 2000
    trace = generate_trace(options, workers=workers)
    empty = absent_worker_seconds(trace, duration_s=options.duration_s)
    measured = 1.0 - empty / (workers * options.duration_s)
    assert measured == pytest.approx(
        expected_exposure(options, workers=workers).alive_fraction, abs=0.02
    )
    crashes = sum(event.kind == "crash" for event in trace.events)
    assert crashes == pytest.approx(expected_exposure(options, workers=workers).crashes, rel=0.05)


def test_a_short_run_starts_with_every_slot_filled() -> None:
    """Over T = 100 s with R = 50 s and an MTBF of 100 s, the steady state's alive fraction,
    1 / (1 + 0.5) = 0.667, undercounts a run that starts with every slot filled: 4000
    generated slots are alive 0.725 of the time, and the model's 1 - 0.01 (1 / 1.5)
    (50 - 50^2 / 200) = 0.75 is the closer."""
    options = FaultOptions(duration_s=100.0, mtbf_s=100.0, replace_after_s=50.0, seed=3)
    trace = generate_trace(options, workers=4000)
    measured = 1.0 - absent_worker_seconds(trace, duration_s=100.0) / (4000 * 100.0)
    alive = expected_exposure(options, workers=4000).alive_fraction
    assert alive == pytest.approx(0.75)
    assert abs(alive - measured) < abs(1 / 1.5 - measured)


def test_a_crash_costs_the_synchronous_method_most_and_the_decoupled_one_least() -> None:
    options = FaultOptions(duration_s=3600.0, mtbf_s=36_000.0, replace_after_s=300.0)
    costs = StepCosts(compute_s=1.0, sync_s=1.0, sync_every=30, heal_s=5.0)
    by_family = {
        family: expected_goodput(family, options, workers=64, costs=costs, min_quorum=16)
        for family in ("synchronous", "local", "decoupled")
    }
    assert by_family["synchronous"] < by_family["local"] < by_family["decoupled"] < 1.0
    # Stragglers: only the method that never waits keeps more than the slow slots' loss.
    slow = FaultOptions(duration_s=3600.0, slow_fraction=0.1, slow_factor=3.0)
    kept = {
        family: expected_goodput(family, slow, workers=64, costs=costs, min_quorum=16)
        for family in ("synchronous", "local", "decoupled")
    }
    assert max(kept["synchronous"], kept["local"]) < 0.6 < kept["decoupled"]


def test_bad_model_inputs_end_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^sync_every=0: a round has at least one step"):
        StepCosts(compute_s=1.0, sync_every=0)
    with pytest.raises(ValueError, match=r"^compute_s=0.0: must be a finite number > 0"):
        StepCosts(compute_s=0.0)
    with pytest.raises(ValueError, match=r"^family='async': the model knows synchronous"):
        expected_goodput(
            "async", FaultOptions(duration_s=1.0), workers=2, costs=StepCosts(compute_s=1.0)
        )


def test_a_count_of_crashes_misses_a_share_binomially() -> None:
    """none_in: each of k crashes at a uniform moment misses a share q with probability
    1 - q, so all miss it with (1 - q)^k; averaged over a Poisson count of mean n that is
    exp(-n q), the form a mean takes (which the planner's average over the count must not
    apply a second time)."""
    from lowcomm.faults.goodput import none_in

    assert none_in(2.0, 0.25) == pytest.approx(0.5625, rel=1e-12)
    assert none_in(0.0, 0.5) == 1.0 and none_in(3.0, 1.0) == 0.0
    n, q = 4.0, 0.3
    poisson = sum(math.exp(-n) * n**k / math.factorial(k) * none_in(float(k), q) for k in range(80))
    assert poisson == pytest.approx(math.exp(-n * q), rel=1e-12)


def test_only_the_events_before_the_last_step_land_and_joins_heal_after_r() -> None:
    """landed: over T = 100 s with a last step of 5 s, 10 expected crashes land 9.5 and,
    replaced after R = 20 s, 8 joins land 8 (95 - 20) / (100 - 20) = 7.5. A generated trace's
    joins come R after a crash, so they heal on the K' = K (T - R) / T steps after R; a
    healing step lasts tau + h, and the joins during it land together on the next step: d
    healings of j joins solve d = (K' - d)(1 - (1 - tau / L)^j) + d (1 - (1 - (tau + h) / L)^j),
    L = K' tau + d h (here solved by bisection). A run's own joins (join_share None) heal on
    K (1 - (1 - 1 / K)^j) steps."""
    from lowcomm.faults.goodput import landed

    exposure = Exposure(workers=4, duration_s=100.0, crashes=10.0, joins=8.0)
    moved = landed(exposure, last_step_s=5.0, replace_after_s=20.0)
    assert (moved.crashes, moved.joins) == pytest.approx((9.5, 7.5), rel=1e-12)
    options = FaultOptions(duration_s=100.0, mtbf_s=400.0, replace_after_s=50.0)
    assert expected_exposure(options, workers=4).join_share == pytest.approx(0.5)
    never = dataclasses.replace(options, replace_after_s=math.inf)
    assert expected_exposure(never, workers=4).join_share is None  # (no join to place)
    costs = StepCosts(compute_s=0.8, sync_s=0.2, heal_s=2.0)
    j, steps, tau, h = 3.0, 5.0, 1.0, 2.0  # (K' = 10 steps x 1/2)

    def excess(d: float) -> float:
        length = steps * tau + d * h
        caught = (steps - d) * (1 - (1 - tau / length) ** j)
        return caught + d * (1 - (1 - (tau + h) / length) ** j) - d

    low, high = 0.0, steps
    for _ in range(200):
        low, high = (
            ((low + high) / 2, high) if excess((low + high) / 2) > 0 else (low, (low + high) / 2)
        )
    healed = low
    assert healed < 5 * (1 - 0.8**3)  # (fewer than over uniform steps)
    drawn = Exposure(workers=4, duration_s=100.0, joins=j, join_share=0.5)
    expected = 1 - healed * 4 * 2.0 / 400.0
    assert goodput_synchronous(drawn, costs, steps=10) == pytest.approx(expected, rel=1e-9)
    assert goodput_local(drawn, costs, steps=10) == pytest.approx(expected, rel=1e-9)
    own = dataclasses.replace(drawn, join_share=None)
    expected_own = 1 - 10 * (1 - 0.9**3) * 4 * 2.0 / 400.0
    assert goodput_synchronous(own, costs, steps=10) == pytest.approx(expected_own, rel=1e-12)
    with pytest.raises(ValueError, match=r"^join_share=0\.0: a share of the steps in \(0, 1\]$"):
        Exposure(workers=4, duration_s=100.0, join_share=0.0)
