"""The planner's goodput against simulated runs with faults (the goal: within 10% at
M = 16-256).

For each run directory (a `lowcomm train` run with a generated fault trace, its
``summary.json`` holding the measured ``goodput``), the planner is given the run's own
settings: its ``config.json`` (method and its options, workers, links, dtypes and the
``--fault-*`` options, which `train` and `plan` name alike), the parameters, tokens and steps
of its ``summary.json``, its modeled time as the horizon T (``--fault-horizon-s``), and one
worker's compute per step (``--seconds-per-microbatch`` times ``--microbatches-per-step``
of a run on the declared clock, or this script's ``--seconds-per-step``). Printed per run:
the measured goodput; the planner's expected goodput (over the trace's random draws: whether
a slot is slow, how many crash) and their ratio; and the planner's model given the faults
this run met (its crashes, joins, time away, its share of slow slots and whether one is slow,
the exchanges its crashes failed and whether its last sync failed) and their ratio. Then, per method
and M, the mean measured goodput over the runs given (one per --fault-seed) against the mean
expectation: a single run at M = 16 either has a straggler or not, which the expectation
mixes. The exit status is 1 when a run's ratio to its own faults' model, or a mean's ratio
to the expectation, lies outside 1 +- ``--tolerance``.

    python benchmarks/faults_plan_check.py runs/faults/ddp-m16 runs/faults/diloco-m16 ...
    python benchmarks/faults_plan_check.py runs/faults/* --json

With ``--expectation M ...`` it simulates nothing: per method of ``lowcomm bench faults``
(its default options), it averages the model given each generated trace's faults (their
steps derived from the trace: :func:`derived_summary`) over ``--seeds`` traces, against the
planner's expectation over the same runs' modeled times (:func:`trace_average`)::

    python benchmarks/faults_plan_check.py --expectation 16 64 256 --seeds 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowcomm.bench.faults import FaultsBench, _train_config, _with_faults, trace_timing
from lowcomm.config import TrainConfig
from lowcomm.faults.goodput import Exposure, absent_worker_seconds
from lowcomm.faults.run import run_trace
from lowcomm.faults.trace import FaultTrace
from lowcomm.plan import (
    FaultSteps,
    Plan,
    PlanConfig,
    _fault_options,
    _fault_step_costs,
    fault_model,
    make_plan,
    method_options,
    price_faults,
)
from lowcomm.plan import plan_for_run as plan_for_train_run


class RunError(ValueError):
    """A run directory the check cannot price (the message names the fix)."""


def plan_for_run(run: Path, *, seconds_per_step: float | None = None) -> PlanConfig:
    """The planner's configuration for the run in ``run``: the settings `train` and `plan`
    share (the --fault-* options among them) from ``config.json``, its size and length from
    ``summary.json``.

    Raises:
        RunError: when a file is missing, or the run's compute per step is not declared and
            ``seconds_per_step`` is None.
    """
    config_path, summary_path = run / "config.json", run / "summary.json"
    for path in (config_path, summary_path):
        if not path.is_file():
            raise RunError(f"{path}: no such file; pass the directory of a finished run")
    train = TrainConfig.from_dict(json.loads(config_path.read_text()))
    summary = json.loads(summary_path.read_text())
    if seconds_per_step is None:
        if train.comm.seconds_per_microbatch is None:
            raise RunError(
                f"{run}: --seconds-per-microbatch None (a calibrated clock): the planner needs "
                "one worker's compute per step; pass --seconds-per-step, or run on the declared "
                "clock"
            )
        seconds_per_step = train.comm.seconds_per_microbatch * train.run.microbatches_per_step
    steps = int(summary["steps"])
    tokens = float(summary.get("tokens") or summary.get("samples") or 0.0)
    if steps < 1 or not tokens > 0:
        raise RunError(f"{summary_path}: steps={steps}, tokens={tokens}; the run trained nothing")
    return plan_for_train_run(
        train, params=str(summary["num_params"]), tokens=tokens, steps=steps,
        seconds_per_step=seconds_per_step, horizon_s=float(summary["modeled_time_s"]),
    )  # fmt: skip


def measured_goodput(run: Path) -> float:
    """The run's goodput: against its fault-free twin when one lies beside it (``NAME-clean``
    for ``NAME-faults``, as ``lowcomm bench faults`` writes them: committed tokens per modeled
    second over the twin's), else its own summary's (from its steps without a fault, which a
    run with a straggler from the start has none of).

    Raises:
        RunError: when neither gives one.
    """
    summary = json.loads((run / "summary.json").read_text())
    twin = run.with_name(run.name.removesuffix("-faults") + "-clean")
    if run.name.endswith("-faults") and (twin / "summary.json").is_file():
        clean = json.loads((twin / "summary.json").read_text())
        rate = summary["committed_tokens"] / summary["modeled_time_s"]
        return float(rate / (clean["committed_tokens"] / clean["modeled_time_s"]))
    goodput = (summary.get("faults") or {}).get("goodput")
    if goodput is None:
        raise RunError(
            f"{run / 'summary.json'}: no faults.goodput; the run had no fault options, had no "
            "fault-free step to price its goodput by (pass its fault-free twin beside it as "
            "NAME-clean), or comes from a lowcomm that does not report it"
        )
    return float(goodput)


def _events_over(distinct_steps: int, steps: int) -> float:
    """n with K (1 - (1 - 1 / K)^n) = ``distinct_steps``: the events whose expected steps are
    those the run's events fell on (all of them: every step)."""
    if distinct_steps >= steps:
        return float(distinct_steps) * 50.0
    return math.log1p(-distinct_steps / steps) / math.log1p(-1.0 / steps)


def run_exposure(run: Path) -> Exposure | None:
    """The faults the run met, as the model's exposure (:func:`exposure_met` of its
    summary.json and trace). None: the run had no fault options."""
    train = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    trace = run_trace(train)
    if trace is None:
        return None
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ends = {int(r["step"]): float(r["clock_s"]) for r in records}
    return exposure_met(
        summary, trace, workers=train.placement.workers, method=train.method,
        detection_s=train.fault.fault_detection_s,
        step_time=lambda step: ends.get(step - 1, 0.0),
    )  # fmt: skip


def _changes(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return list((summary.get("faults") or {}).get("membership_changes", []))


def exposure_met(
    summary: dict[str, Any],
    trace: FaultTrace,
    *,
    workers: int,
    method: str,
    detection_s: float,
    step_time: Callable[[int], float] | None = None,
) -> Exposure:
    """The faults a run met, as the model's exposure: its crashes and joins (its summary's
    membership changes), the slot-time its workers were away (its trace, placed by time, over
    its modeled time), and whether a slot was slow (a generated trace makes a slot slow for
    the whole run). ``step_time``: a step's start on the run's clock, for a trace placed by
    step."""
    duration = float(summary["modeled_time_s"])
    changes = _changes(summary)
    kinds = [event["kind"] for change in changes for event in change["events"]]
    absent = absent_worker_seconds(trace, duration_s=duration, step_time=step_time)
    slow = [e for e in trace.events if e.kind == "slow" and (e.factor or 1.0) > 1.0]
    # The model counts the steps events share by expectation, K (1 - (1 - 1 / K)^n); given the
    # run's own, it takes the count whose expectation is the steps they fell on: the joins'
    # (one healing a step) in every model, the crashes' (one dropped step) in ddp's.
    steps = int(summary["steps"])
    crash_steps, join_steps = set(), set()
    for change in changes:
        kinds_here = {event["kind"] for event in change["events"]}
        if "crash" in kinds_here:
            crash_steps.add(int(change["step"]))
        if kinds_here & {"join", "rejoin"}:
            join_steps.add(int(change["step"]))
    crashes = float(kinds.count("crash"))
    if fault_model(method).family == "synchronous":
        crashes = _events_over(len(crash_steps), steps)
    # The run's slots are known: the share that is slow (decoupled_diloco's learners do not
    # wait, and lose that share's pace), and whether any is (the others wait for it).
    slow_slots = {e.worker for e in slow}
    return Exposure(
        workers=workers,
        duration_s=duration,
        alive_fraction=1.0 - absent / (workers * duration),
        crashes=crashes,
        joins=_events_over(len(join_steps), steps),
        detection_s=detection_s,
        slow_fraction=len(slow_slots) / workers,
        slow_factor=max((float(e.factor or 1.0) for e in slow), default=1.0),
        slow_present=1.0 if slow else 0.0,
    )


def run_dropped_rounds(run: Path, config: PlanConfig) -> float:
    """:func:`dropped_rounds_met` of the run's summary.json."""
    return dropped_rounds_met(json.loads((run / "summary.json").read_text()), config)


def dropped_rounds_met(summary: dict[str, Any], config: PlanConfig) -> float:
    """The exchanges a run's crashes failed, for a method whose sync lands N rounds late
    (0 for the others): a crash in round r fails those of rounds r - N .. r - 1 (those
    launched before it and not yet applied), each once however many crashes it meets."""
    model = fault_model(config.method)
    _, options = method_options(config)
    late, period = model.in_flight(options), model.period(options)
    failed: set[int] = set()
    for change in _changes(summary):
        if any(event["kind"] == "crash" for event in change["events"]):
            round_index = int(change["step"]) // period
            failed.update(range(max(0, round_index - late), round_index))
    return float(len(failed))


def run_last_sync_lost(run: Path, config: PlanConfig) -> float:
    """:func:`last_sync_lost_met` of the run's summary.json."""
    return last_sync_lost_met(json.loads((run / "summary.json").read_text()), config)


def last_sync_lost_met(summary: dict[str, Any], config: PlanConfig) -> float:
    """The rounds of every survivor a run's last sync lost, for a method whose overlapped
    syncs' tokens wait for the next completed one (0 for the others): 1 / F when a crash fell
    in the run's last tau steps, while the last sync flew."""
    model = fault_model(config.method)
    _, options = method_options(config)
    overlap = model.overlap(options)
    if overlap == 0:
        return 0.0
    steps = int(summary["steps"])
    late_crash = any(
        int(change["step"]) >= steps - overlap
        for change in _changes(summary)
        if any(event["kind"] == "crash" for event in change["events"])
    )
    return 1.0 / model.fragments(options) if late_crash else 0.0


def run_steps_met(run: Path) -> FaultSteps:
    """:func:`steps_met` of the run's summary.json."""
    return steps_met(json.loads((run / "summary.json").read_text()))


def steps_met(summary: dict[str, Any]) -> FaultSteps:
    """The steps a run's crashes fell on, and those at which it healed joiners."""
    crashes: list[int] = []
    healings: list[int] = []
    for change in _changes(summary):
        kinds = [event["kind"] for event in change["events"]]
        crashes += [int(change["step"])] * kinds.count("crash")
        if {"join", "rejoin"} & set(kinds):
            healings.append(int(change["step"]))
    return FaultSteps(crashes=tuple(crashes), healings=tuple(healings))


def check_run(run: Path, *, seconds_per_step: float | None = None) -> dict[str, Any]:
    """The run's measured goodput; the planner's expected goodput (over the trace's random
    draws) and its ratio; the planner's model given the faults this run met, and its ratio."""
    config = plan_for_run(run, seconds_per_step=seconds_per_step)
    measured = measured_goodput(run)
    plan = make_plan(config)
    priced = price_faults(config, plan)
    exposure = run_exposure(run)
    given = price_faults(
        config, plan, exposure=exposure, dropped_rounds=run_dropped_rounds(run, config),
        last_sync_lost=run_last_sync_lost(run, config), steps_met=run_steps_met(run),
    ).goodput  # fmt: skip
    predicted = priced.goodput
    return {
        "run": str(run),
        "method": config.method,
        "workers": config.workers,
        "seed": TrainConfig.from_dict(
            json.loads((run / "config.json").read_text())
        ).fault.fault_seed,
        "family": priced.family,
        "measured": measured,
        "predicted": predicted,
        "ratio": math.nan if not predicted else measured / predicted,
        "given": given,
        "straggler": exposure is not None and exposure.slow_fraction > 0,
        "some_slow": 1.0 - (1.0 - (config.fault_slow_fraction or 0.0)) ** config.workers,
        "ratio_given": math.nan if not given else measured / given,
        "horizon_s": priced.horizon_s,
    }


def seed_means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and M, the measured goodput over its runs (each a seed of the trace)
    against the mean planned one: the planner gives an expectation over the trace's draws.

    Whether some slot is slow splits the runs in two (at M = 16, f = 0.1 a run keeps about
    1/3 or all), so a plain mean over a few seeds mostly samples how many drew a straggler;
    with runs on both sides the measured goodput is the stratified mean p mean(slow) +
    (1 - p) mean(not slow), p = 1 - (1 - f)^M the trace's own probability."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["workers"]), []).append(row)
    means = []
    for (method, workers), group in groups.items():
        planned = [r["predicted"] for r in group if r["predicted"] is not None]
        predicted = sum(planned) / len(planned) if len(planned) == len(group) else None
        slow = [r["measured"] for r in group if r["straggler"]]
        fast = [r["measured"] for r in group if not r["straggler"]]
        p = group[0]["some_slow"]
        if slow and fast:
            measured = p * sum(slow) / len(slow) + (1 - p) * sum(fast) / len(fast)
        else:
            measured = sum(r["measured"] for r in group) / len(group)
        means.append(
            {
                "method": method, "workers": workers, "runs": len(group),
                "with_straggler": len(slow), "some_slow": p, "measured": measured,
                "predicted": predicted,
                "ratio": math.nan if not predicted else measured / predicted,
            }
        )  # fmt: skip
    return means


def trace_exposures(rows: list[dict[str, Any]], traces: int) -> list[dict[str, Any]]:
    """Per M, the exposure the planner expects (crashes n, joins j, slot-seconds away) against
    its mean over ``traces`` generated traces (seeds 0 ..) of the same options over the same
    horizon: the expectation's side of the check, without simulated runs (a run meets one
    trace, whose crash count alone varies by about sqrt(n))."""
    import dataclasses
    import statistics

    from lowcomm.faults.generate import FaultOptions, generate_trace
    from lowcomm.faults.goodput import expected_exposure

    found = []
    for workers in sorted({row["workers"] for row in rows}):
        row = next(r for r in rows if r["workers"] == workers)
        config = plan_for_run(Path(row["run"]))
        options = FaultOptions.given(
            duration_s=row["horizon_s"], detection_s=config.fault_detection_s,
            mtbf_s=config.fault_mtbf_s, replace_after_s=config.fault_replace_after_s,
            slow_fraction=config.fault_slow_fraction, slow_factor=config.fault_slow_factor,
        )  # fmt: skip
        expected = expected_exposure(options, workers=workers)
        counts: dict[str, list[float]] = {"crashes": [], "joins": [], "away_s": []}
        for seed in range(traces):
            trace = generate_trace(dataclasses.replace(options, seed=seed), workers=workers)
            events = [e for e in trace.membership_events() if e.at <= options.duration_s]
            counts["crashes"].append(sum(e.kind == "crash" for e in events))
            counts["joins"].append(sum(e.kind in ("join", "rejoin") for e in events))
            counts["away_s"].append(absent_worker_seconds(trace, duration_s=options.duration_s))
        away = (1.0 - expected.alive_fraction) * workers * options.duration_s
        found.append(
            {
                "workers": workers, "horizon_s": options.duration_s, "traces": traces,
                "expected": {"crashes": expected.crashes, "joins": expected.joins, "away_s": away},
                "mean": {k: statistics.fmean(v) for k, v in counts.items()},
                "sd": {k: statistics.stdev(v) if traces > 1 else 0.0 for k, v in counts.items()},
            }
        )  # fmt: skip
    return found


# ---- the expectation against the model given each trace's faults, without runs ------------


def bench_plan_config(bench: FaultsBench, method: str, workers: int) -> PlanConfig:
    """The planner's configuration of ``lowcomm bench faults``' run of ``method`` at M =
    ``workers`` (its model's parameters counted on the meta device, its nominal tokens), with
    the benchmark's trace options: the MTBF and replacement delay from the longest
    fault-free run of ``bench.methods`` (:func:`lowcomm.bench.faults.trace_timing`, as
    ``lowcomm bench faults`` sets them), that run's modeled time taken as its plan's wall
    clock (equal to the run's)."""

    def configure(name: str) -> tuple[TrainConfig, PlanConfig]:
        train = _train_config(bench, name, workers, Path(bench.out) / "unused")
        steps = train.run.steps
        tokens = steps * workers * train.run.microbatches_per_step * train.tokens_per_microbatch()
        assert train.comm.seconds_per_microbatch is not None
        return train, plan_for_train_run(
            train, params=str(_parameters(train)), tokens=float(tokens), steps=steps,
            seconds_per_step=train.comm.seconds_per_microbatch * train.run.microbatches_per_step,
            horizon_s=1.0,
        )  # fmt: skip

    longest = max(make_plan(configure(name)[1]).wall_clock_s for name in bench.methods)
    mtbf, replace = trace_timing(bench, longest)
    train, _ = configure(method)
    _with_faults(train, bench, mtbf, replace)
    return configure_faults(configure(method)[1], train)


def configure_faults(config: PlanConfig, train: TrainConfig) -> PlanConfig:
    """``config`` with ``train``'s --fault-* options."""
    fault = train.fault
    return dataclasses.replace(
        config, fault_mtbf_s=fault.fault_mtbf_s, fault_replace_after_s=fault.fault_replace_after_s,
        fault_slow_fraction=fault.fault_slow_fraction, fault_slow_factor=fault.fault_slow_factor,
        fault_detection_s=fault.fault_detection_s,
    )  # fmt: skip


def _parameters(train: TrainConfig) -> int:
    import torch

    from lowcomm.models import build_model

    with torch.device("meta"):
        model = build_model(train.model, train.data.vocab_size)
    return sum(p.numel() for p in model.parameters())


def derived_summary(config: PlanConfig, plan: Plan, trace: FaultTrace) -> dict[str, Any]:
    """The fields of summary.json the model given a run's faults reads (its steps, modeled
    time and membership changes by step), derived from ``trace`` without running it.

    A run places an event given by time on the first step whose start, on the run's clock, is
    at or after it; the run's clock at a step's start is its slowest member's. So the steps
    are walked on the method's schedule at the slowest slot's pace S (the trace's slow
    factor, when it makes a slot slow): a step computes c S, and a round's sync exposes m(S)
    at its last step (``StepCosts``); a step-round method's step with a crash takes c S + D
    (computed, then the detection waited) in place of its exchange; a sync-round method's
    step at which a member is lost ends no sooner than D after its start when its end waits
    for a pending detection; a step that heals joiners takes h and the wait for the
    collectives in flight more (:func:`_healing_s`); decoupled_diloco's ticks wait for
    nobody, its clock the straggler's (its j-th step at tick floor(j s)). A method that ends
    by draining its last exchange ends the plan's drain after its last step.

    The sync and a healing run over the live quorum, whose (size - 1) hops of latency
    outweigh the bytes at the benchmark's sizes: they take (live - 1) / (M - 1) of their
    time over M. Checked against simulated runs: seeds 12 and 15 at M = 16 and seed 0 of
    ddp at M = 256 land every event on the run's step and end within 0.03 s of its modeled
    time (``test_plan_faults`` runs two); seed 0 of every method of docs/results/faults.md
    at M = 16, 64 and 256 meets the table's crash count and ends within 0.1 s of its time.
    """
    model = fault_model(config.method)
    _, options = method_options(config)
    period = model.period(options)
    costs, _ = _fault_step_costs(config, plan, model, period, 0.0)
    slow = [float(e.factor or 1.0) for e in trace.events if e.kind == "slow"]
    pace = max(slow, default=1.0)
    step_s = costs.compute_s * pace
    detection = config.fault_detection_s
    detect_at = set(costs.detect_phases or (period - 1,))
    steps = math.floor(plan.steps + 1e-9)
    events = sorted(trace.membership_events(), key=lambda e: e.at)
    changes: list[dict[str, Any]] = []
    crashes: list[int] = []
    now, cursor, detect_until, done_slow = 0.0, 0, -math.inf, 0
    live = config.workers
    for step in range(steps):
        if model.family == "decoupled":
            # (The straggler's steps before this tick, each s c of its clock.)
            if pace > 1.0:
                done_slow = math.floor((step - 1) / pace + 1e-9) + 1 if step > 0 else 0
            now = max(step * costs.compute_s, done_slow * step_s)
        start, here = now, []
        while cursor < len(events) and events[cursor].at <= start:
            here.append(events[cursor])
            cursor += 1
        if here:
            changes.append({"step": step, "events": [{"kind": e.kind} for e in here]})
        crash = any(e.kind == "crash" for e in here)
        crashes += [step] * sum(e.kind == "crash" for e in here)
        live += sum(e.kind in ("join", "rejoin") for e in here) - sum(
            e.kind in ("crash", "leave") for e in here
        )
        # (The link prices a collective over the quorum with (size - 1) hops of latency,
        # which at these sizes outweighs its bytes: the sync and the healing over the live
        # workers take that share of their time over M.)
        hops = (live - 1) / (config.workers - 1) if config.workers > 1 else 1.0
        heal = 0.0
        if any(e.kind in ("join", "rejoin") for e in here):
            heal = hops * _healing_s(config, plan, model, period, pace, tuple(crashes), step)
        if model.family == "synchronous":
            exchange = detection if crash else hops * costs.exposed_s(pace)
            now = start + heal + step_s + exchange
        elif model.family == "local":
            if crash:
                detect_until = max(detect_until, start + heal + detection)
            now = start + heal + step_s
            if step % period in detect_at:
                now, detect_until = max(now, detect_until), -math.inf
            if step % period == period - 1:
                now += hops * costs.exposed_s(pace)
        else:
            now = start + costs.compute_s
    if model.family == "decoupled":
        now = max(steps * costs.compute_s, math.ceil(steps / pace - 1e-9) * step_s)
    return {
        "steps": steps,
        "modeled_time_s": now + plan.final_drain_s,
        "faults": {"membership_changes": changes},
    }


def _healing_s(
    config: PlanConfig,
    plan: Plan,
    model: Any,
    period: int,
    pace: float,
    crashes: tuple[int, ...],
    step: int,
) -> float:
    """What a healing at ``step`` stalls the members, as the model given a run's faults
    prices it: h, without the exchanges in flight that the crashes so far failed, and the
    wait for the collectives in flight at that step of the round."""
    met = FaultSteps(crashes=crashes, healings=(step,))
    costs, _ = _fault_step_costs(config, plan, model, period, 0.0, met)
    return costs.heal_s + costs.settle_s(pace)


def model_given_trace(config: PlanConfig, plan: Plan, trace: FaultTrace) -> tuple[float, float]:
    """The planner's model given the faults a run of ``trace`` meets (:func:`derived_summary`:
    (a), what matches each simulated run within 1%) and its expectation over the trace's
    draws over that run's modeled time (b, what ``lowcomm plan`` prints)."""
    summary = derived_summary(config, plan, trace)
    config = dataclasses.replace(config, fault_horizon_s=float(summary["modeled_time_s"]))
    exposure = exposure_met(
        summary, trace, workers=config.workers, method=config.method,
        detection_s=config.fault_detection_s,
    )  # fmt: skip
    given = price_faults(
        config, plan, exposure=exposure, dropped_rounds=dropped_rounds_met(summary, config),
        last_sync_lost=last_sync_lost_met(summary, config), steps_met=steps_met(summary),
    ).goodput  # fmt: skip
    expected = price_faults(config, plan).goodput
    assert given is not None and expected is not None
    return given, expected


def trace_average(
    bench: FaultsBench, *, workers: int, methods: tuple[str, ...], seeds: range
) -> list[dict[str, Any]]:
    """Per method at M = ``workers``: the mean over the generated traces of ``seeds`` of the
    planner's model given each trace's faults (a), its standard error, and the mean of the
    expectation (b) over the same runs' modeled times, with their ratio (a) / (b). No run is
    simulated: each trace's steps come from :func:`derived_summary`.

    Whether some slot is slow splits the traces in two (a run keeps about 1/s or all of its
    rate), so the means are stratified by it with the trace's own probability p = 1 -
    (1 - f)^M, as :func:`seed_means` does for runs: p mean(slow) + (1 - p) mean(not slow),
    whose standard error is sqrt(p^2 var(slow) / n_slow + (1 - p)^2 var(not) / n_not)."""
    from lowcomm.faults.generate import generate_trace

    rows = []
    for method in methods:
        config = bench_plan_config(bench, method, workers)
        plan = make_plan(config)
        options = _fault_options(config, _TRACE_HORIZON * plan.wall_clock_s)
        strata: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
        for seed in seeds:
            trace = generate_trace(dataclasses.replace(options, seed=seed), workers=workers)
            given, expected = model_given_trace(config, plan, trace)
            slow = any(e.kind == "slow" for e in trace.events)
            strata[slow][0].append(given)
            strata[slow][1].append(expected)
        p = 1.0 - (1.0 - options.slow_fraction) ** workers
        mean_given, error = _stratified(strata[True][0], strata[False][0], p)
        mean_expected, _ = _stratified(strata[True][1], strata[False][1], p)
        rows.append(
            {
                "workers": workers, "method": method, "traces": len(seeds),
                "with_straggler": len(strata[True][0]), "some_slow": p,
                "expected": mean_expected, "given": mean_given, "given_se": error,
                "ratio": mean_given / mean_expected if mean_expected else math.nan,
            }
        )  # fmt: skip
    return rows


#: The terms of :func:`local_terms`, in the order they are printed.
TERMS = (
    "alive", "partial", "detection", "dropped", "last_sync", "healing", "crashes", "healings",
    "dropped_rounds", "horizon_s",
)  # fmt: skip


def local_terms(
    config: PlanConfig,
    plan: Plan,
    exposure: Exposure,
    *,
    steps_met: FaultSteps | None = None,
    given: tuple[float | None, float | None] = (None, None),
) -> dict[str, float]:
    """The terms of G_local (:func:`lowcomm.faults.goodput.goodput_local`) for ``exposure``
    at its slowest worker's pace, each a share of the run's M T as G counts it (times the
    fault-free round over the round at that pace): what the live slot-time keeps (alive),
    and what the dead workers' partial rounds, the survivors' detection waits, the failed
    exchanges, the failed last sync and the healings take; then the counts behind them.
    ``steps_met`` and ``given`` (the dropped rounds and the last sync's lost rounds): a
    run's own, as :func:`price_faults` takes them (None: expected)."""
    from lowcomm.faults.goodput import _healings, expected_dropped_rounds

    model = fault_model(config.method)
    _, options = method_options(config)
    period = model.period(options)
    costs, _ = _fault_step_costs(config, plan, model, period, exposure.crashes, steps_met)
    e, pace = exposure, exposure.slowest_pace
    round_s = costs.round_at(pace)
    heal = costs.heal_s + costs.settle_s(pace)
    healings = _healings(e, plan.steps, round_s / costs.sync_every, heal)
    partial, wait = costs.crash_costs(e.detection_s, pace)
    dropped, last = given
    if dropped is None:
        dropped = expected_dropped_rounds(e.crashes, model.in_flight(options), plan.steps / period)
    if last is None:
        last = 0.0
        if model.overlap(options) > 0:
            from lowcomm.faults.goodput import expected_last_sync_lost

            last = expected_last_sync_lost(
                e.crashes, overlap_steps=model.overlap(options),
                fragments=model.fragments(options), steps=plan.steps,
            )  # fmt: skip
    survivors = (e.workers - 1) * e.alive_fraction
    share = costs.round_s / round_s / (e.workers * e.duration_s)
    return {
        "alive": costs.round_s / round_s * e.alive_fraction,
        "partial": share * e.crashes * partial,
        "detection": share * e.crashes * survivors * wait,
        "dropped": share * dropped * (1.0 + survivors) * round_s,
        "last_sync": share * last * survivors * round_s,
        "healing": share * healings * e.live_workers * heal,
        "crashes": e.crashes,
        "healings": healings,
        "dropped_rounds": dropped,
        "horizon_s": e.duration_s,
    }


def _expected_terms(config: PlanConfig, plan: Plan, slow: bool) -> dict[str, float]:
    """:func:`local_terms` of the expectation (b), as :func:`price_faults` prices it: the
    expected exposure landed on the steps, over the crash count (Poisson, the joins and the
    time away scaled with it), at the straggler's pace when ``slow`` (else at 1)."""
    from lowcomm.faults.goodput import expected_exposure
    from lowcomm.plan import _landed

    model = fault_model(config.method)
    horizon = config.fault_horizon_s or plan.wall_clock_s
    exposure = expected_exposure(_fault_options(config, horizon), workers=config.workers)
    costs, _ = _fault_step_costs(
        config, plan, model, model.period(method_options(config)[1]), exposure.crashes
    )
    if plan.final_drain_s > 0.0 and plan.final_drain_s < min(horizon, plan.wall_clock_s):
        exposure = dataclasses.replace(exposure, duration_s=horizon - plan.final_drain_s)
    exposure = _landed(config, model, costs, exposure)
    exposure = dataclasses.replace(exposure, slow_present=1.0 if slow else 0.0)
    n = exposure.crashes
    total: dict[str, float] = dict.fromkeys(TERMS, 0.0)
    weight = 0.0
    spread = 8.0 * math.sqrt(n) + 8.0
    for k in range(max(0, math.floor(n - spread)), math.ceil(n + spread) + 1):
        probability = math.exp(k * math.log(n) - n - math.lgamma(k + 1)) if n > 0 else 1.0
        scaled = dataclasses.replace(
            exposure, crashes=float(k), joins=exposure.joins * k / n if n > 0 else 0.0,
            alive_fraction=max(0.0, 1.0 - (1.0 - exposure.alive_fraction) * k / n)
            if n > 0 else exposure.alive_fraction,
        )  # fmt: skip
        for key, value in local_terms(config, plan, scaled).items():
            total[key] += probability * value
        weight += probability
        if n == 0:
            break
    return {key: value / weight for key, value in total.items()}


def term_breakdown(
    bench: FaultsBench, *, workers: int, method: str, seeds: range
) -> list[dict[str, Any]]:
    """For a method of the local family at M = ``workers``: per stratum (whether a slot is
    slow), the mean over the generated traces of ``seeds`` of each term of G given the
    trace's faults (a) and of the expectation's (b) over the same runs' modeled times
    (:func:`local_terms`), with the standard error of (a)'s mean: where (b) prices a trace
    differently from its own faults."""
    import statistics

    from lowcomm.faults.generate import generate_trace

    config = bench_plan_config(bench, method, workers)
    if fault_model(method).family != "local":
        raise ValueError(
            f"--terms {method}: the breakdown is of G_local's terms; pick a method of the "
            "local family (diloco, streaming_diloco, eager, diloco_delayed, co2, ...)"
        )
    plan = make_plan(config)
    options = _fault_options(config, _TRACE_HORIZON * plan.wall_clock_s)
    strata: dict[bool, tuple[list[dict[str, float]], list[dict[str, float]]]] = {
        True: ([], []),
        False: ([], []),
    }
    for seed in seeds:
        trace = generate_trace(dataclasses.replace(options, seed=seed), workers=workers)
        summary = derived_summary(config, plan, trace)
        run = dataclasses.replace(config, fault_horizon_s=float(summary["modeled_time_s"]))
        exposure = exposure_met(
            summary, trace, workers=workers, method=method, detection_s=run.fault_detection_s
        )
        if plan.final_drain_s > 0.0:
            exposure = dataclasses.replace(
                exposure, duration_s=exposure.duration_s - plan.final_drain_s
            )
        given = (dropped_rounds_met(summary, run), last_sync_lost_met(summary, run))
        slow = exposure.slow_present == 1.0
        strata[slow][0].append(
            local_terms(run, plan, exposure, steps_met=steps_met(summary), given=given)
        )
        strata[slow][1].append(_expected_terms(run, plan, slow))
    rows = []
    for slow, (given_terms, expected_terms) in strata.items():
        if not given_terms:
            continue
        for key in TERMS:
            values = [t[key] for t in given_terms]
            error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
            rows.append(
                {
                    "workers": workers, "method": method, "slow": slow,
                    "traces": len(values), "term": key,
                    "given": statistics.fmean(values), "given_se": error,
                    "expected": statistics.fmean(t[key] for t in expected_terms),
                }
            )  # fmt: skip
    return rows


def _stratified(slow: list[float], fast: list[float], p: float) -> tuple[float, float]:
    """The mean over two strata weighed p and 1 - p, and its standard error (the plain
    mean and its standard error when a stratum has fewer than two values)."""
    import statistics

    if len(slow) < 2 or len(fast) < 2:
        values = slow + fast
        error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        return statistics.fmean(values), error
    mean = p * statistics.fmean(slow) + (1.0 - p) * statistics.fmean(fast)
    variance = p**2 * statistics.variance(slow) / len(slow) + (1.0 - p) ** 2 * statistics.variance(
        fast
    ) / len(fast)
    return mean, math.sqrt(variance)


#: A generated trace covers this many times the method's fault-free run: past every run's end
#: (a run behind a 3x straggler, and its crashes' costs), as a run's own trace grows.
_TRACE_HORIZON = 8.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories")
    parser.add_argument(
        "--seconds-per-step",
        type=float,
        default=None,
        help="one worker's compute per step (default: the run's declared clock)",
    )
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed |ratio - 1|")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument(
        "--traces",
        type=int,
        default=0,
        help="also compare, per M, the expected crashes, joins and time away with their mean "
        "over this many generated traces of the first run's options (0: no)",
    )
    parser.add_argument(
        "--expectation",
        type=int,
        nargs="+",
        default=[],
        metavar="M",
        help="instead of runs: per method of `lowcomm bench faults` (its default options, "
        "--methods), the expectation against the mean of the model given each of --seeds "
        "generated traces' faults at these M, without simulating a run",
    )
    parser.add_argument("--seeds", type=int, default=1000, help="traces per M (--expectation)")
    parser.add_argument(
        "--terms",
        action="store_true",
        help="with --expectation: per method of the local family, the terms of G given each "
        "trace's faults (mean over the traces) against the expectation's",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(EXPECTATION_METHODS),
        help="methods of --expectation",
    )
    args = parser.parse_args(argv)
    if not args.runs and not args.expectation:
        parser.error("runs: give run directories, or --expectation M ...")
    return args


#: The methods docs/results/faults.md measures.
EXPECTATION_METHODS = (
    "ddp", "diloco", "streaming_diloco", "decoupled_diloco", "eager", "diloco_delayed", "co2",
)  # fmt: skip


def expectation_main(args: argparse.Namespace) -> int:
    """Print the --expectation table; exit status 1 when a ratio lies outside 1 +-
    ``--tolerance``."""
    bench = FaultsBench(methods=tuple(args.methods))
    if args.terms:
        return terms_main(args, bench)
    rows = [
        row
        for workers in args.expectation
        for row in trace_average(
            bench, workers=workers, methods=bench.methods, seeds=range(args.seeds)
        )
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print("| M | method | expectation (b) | mean of (a) | standard error | (a) / (b) |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['workers']} | {row['method']} | {row['expected']:.4f} | "
                f"{row['given']:.4f} | {row['given_se']:.4f} | {row['ratio']:.3f} |"
            )
    return 1 if any(_outside(row["ratio"], args.tolerance) for row in rows) else 0


def terms_main(args: argparse.Namespace, bench: FaultsBench) -> int:
    """Print the --terms table (:func:`term_breakdown`) of the local family's methods."""
    methods = [m for m in bench.methods if fault_model(m).family == "local"]
    print("| M | method | slow | term | given (a) | standard error | expectation (b) | (b) - (a) |")
    print("|---|---|---|---|---|---|---|---|")
    for workers in args.expectation:
        for method in methods:
            for row in term_breakdown(
                bench, workers=workers, method=method, seeds=range(args.seeds)
            ):
                if args.json:
                    print(json.dumps(row))
                    continue
                print(
                    f"| {workers} | {method} | {row['slow']} | {row['term']} | "
                    f"{row['given']:.5f} | {row['given_se']:.5f} | {row['expected']:.5f} | "
                    f"{row['expected'] - row['given']:+.5f} |"
                )
    return 0


def _outside(ratio: float, tolerance: float) -> bool:
    return not abs(ratio - 1.0) <= tolerance


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.expectation:
        return expectation_main(args)
    rows: list[dict[str, Any]] = []
    for run in args.runs:
        try:
            rows.append(check_run(run, seconds_per_step=args.seconds_per_step))
        except (RunError, ValueError, KeyError) as error:
            print(f"faults_plan_check: {run}: {error}", file=sys.stderr)
            return 2
    means = seed_means(rows)
    outside = [r for r in rows if _outside(r["ratio_given"], args.tolerance)]
    outside += [m for m in means if _outside(m["ratio"], args.tolerance)]
    if args.json:
        for row in rows:
            print(json.dumps({**row, "within": not _outside(row["ratio_given"], args.tolerance)}))
        for mean in means:
            print(json.dumps({**mean, "within": not _outside(mean["ratio"], args.tolerance)}))
        return 1 if outside else 0
    print(
        f"{'run':34} {'method':16} {'M':>4} {'seed':>4} {'measured':>8} {'planned':>8} "
        f"{'ratio':>6} {'given':>6} {'ratio':>6}"
    )
    for row in rows:
        mark = "  outside" if _outside(row["ratio_given"], args.tolerance) else ""
        print(
            f"{row['run'][-34:]:34} {row['method']:16} {row['workers']:>4} {row['seed']!s:>4} "
            f"{row['measured']:>8.3f} {_cell(row['predicted'])} {row['ratio']:>6.3f} "
            f"{_cell(row['given'], 6)} {row['ratio_given']:>6.3f}{mark}"
        )
    print(
        "\nper method and M, the measured goodput over seeds (stratified by whether a slot "
        "was slow) against the planner's expectation:"
    )
    print(
        f"{'method':16} {'M':>4} {'runs':>4} {'slow':>4} {'p':>5} {'measured':>8} "
        f"{'planned':>8} {'ratio':>6}"
    )
    for mean in means:
        mark = "  outside" if _outside(mean["ratio"], args.tolerance) else ""
        print(
            f"{mean['method']:16} {mean['workers']:>4} {mean['runs']:>4} "
            f"{mean['with_straggler']:>4} {mean['some_slow']:>5.3f} {mean['measured']:>8.3f} "
            f"{_cell(mean['predicted'])} {mean['ratio']:>6.3f}{mark}"
        )
    for found in trace_exposures(rows, args.traces) if args.traces > 0 else []:
        cells = ", ".join(
            f"{key} {found['expected'][key]:.2f} against {found['mean'][key]:.2f} "
            f"(sd {found['sd'][key]:.2f})"
            for key in ("crashes", "joins", "away_s")
        )
        print(
            f"M = {found['workers']}, T = {found['horizon_s']:.1f} s, expected against the mean "
            f"over {found['traces']} generated traces: {cells}"
        )
    print(
        f"{len(rows) + len(means) - len(outside)} of {len(rows) + len(means)} within "
        f"{args.tolerance:.0%} (each run against the model given its own faults; each mean "
        "over seeds against the expectation)"
    )
    return 1 if outside else 0


def _cell(value: float | None, width: int = 8) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.3f}"


if __name__ == "__main__":
    sys.exit(main())
