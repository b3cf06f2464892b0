"""The planner's fault pricing (`lowcomm plan --fault-*`): cases computed by hand from the
formulas of lowcomm.faults.goodput, fed by the plan's own costs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import types
from pathlib import Path

import pytest

from _cli import lowcomm
from lowcomm.faults.generate import FaultOptions
from lowcomm.faults.goodput import expected_exposure
from lowcomm.plan import (
    _FAULT_MODELS,
    FaultSteps,
    PlanConfig,
    fault_model,
    make_plan,
    price_faults,
    run_plan,
)
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.diloco import DiLoCoOptions
from test_plan import ALL_REDUCE, BASE  # the planner's arithmetic-friendly settings


def config(**overrides: object) -> PlanConfig:
    return PlanConfig(**{**BASE, **overrides})  # type: ignore[arg-type]


def priced(**overrides: object):  # type: ignore[no-untyped-def]
    planned = config(**overrides)
    return price_faults(planned, make_plan(planned))


def at_mean(**overrides: object):  # type: ignore[no-untyped-def]
    """The fault pricing at the expected exposure itself (its crash count not averaged over
    a trace's draws): the formulas of lowcomm.faults.goodput, one evaluation."""
    planned = config(**overrides)
    plan = make_plan(planned)
    options = FaultOptions.given(
        duration_s=planned.fault_horizon_s or plan.wall_clock_s,
        detection_s=planned.fault_detection_s, mtbf_s=planned.fault_mtbf_s,
        replace_after_s=planned.fault_replace_after_s,
        slow_fraction=planned.fault_slow_fraction, slow_factor=planned.fault_slow_factor,
    )  # fmt: skip
    exposure = expected_exposure(options, workers=planned.workers)
    return price_faults(planned, plan, exposure=exposure)


def healed_by_hand(joins: float, steps: float, step_s: float, heal_s: float) -> float:
    """The healings of ``joins`` joins drawn at uniform moments over the ``steps`` steps after
    R (K' = K (T - R) / T), a healing step lasting ``heal_s`` more than the ``step_s`` of the
    others, the joins during it landing together on the next step: d solving
    d = (K' - d)(1 - (1 - tau / L)^j) + d (1 - (1 - (tau + h) / L)^j), L = K' tau + d h, by
    bisection."""

    def excess(d: float) -> float:
        length = steps * step_s + d * heal_s
        caught = (steps - d) * (1 - (1 - step_s / length) ** joins)
        return caught + d * (1 - (1 - (step_s + heal_s) / length) ** joins) - d

    low, high = 0.0, steps
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return low


def test_ddp_under_crashes_by_hand() -> None:
    """One crash rate: lambda = 1/500 per worker, replaced after R = 100 s, detected after
    D = 5 s, over T = 1000 s; a join heals ddp's parameters and AdamW state (K = 12 bytes per
    parameter) over one hop of the link. The planner's expectation averages G over the
    trace's crash count k, Poisson with mean n (joins j k / n, time away (1 - a) k / n)."""
    result = at_mean(
        method="ddp",
        fault_mtbf_s=500.0,
        fault_replace_after_s=100.0,
        fault_detection_s=5.0,
        fault_horizon_s=1000.0,
    )
    m, rate, r, d, t = 4, 1 / 500, 100.0, 5.0, 1000.0
    # (A crash in the run's last R is empty until T: away R - R^2 / (2 T) on average.)
    a = 1 - rate / (1 + rate * r) * (r - r * r / (2 * t))
    crashes = m * a * rate * t
    joins = m * a * rate * (t - r)
    # 12 GB at 1e9 bytes/s in three broadcasts over the 4 workers (parameters and both
    # moments), each 3 hops of 1 ms.
    heal = 12e9 / 1e9 + 3 * 3 * 1e-3
    step = 1.0 + ALL_REDUCE  # c + m, no straggler

    def by_hand(crashes: float, joins: float, a: float) -> float:
        # The run's 10 steps: crashes on one step drop it once (each of k misses a given
        # step with probability 9/10); a dropped step costs each survivor its compute and
        # the detection (c + D, no exchange).
        dropped = 10 * (1 - 0.9**crashes)
        # (Joins on one step heal at once; they come R after a crash, so on the last
        # (T - R) / T = 9/10 of the steps, and those during a healing step on the next.)
        healed = healed_by_hand(joins, 9, step, heal)
        return a - (dropped * (m - 1) * a * (1.0 + d) + healed * m * a * heal) / (m * t)

    expected = by_hand(crashes, joins, a)
    # The expectation counts the crashes and joins that land on a step: none in the run's
    # last step (c + m).
    landed = crashes * (t - step) / t
    landed_joins = joins * (t - step - r) / (t - r)
    poisson = [math.exp(-landed) * landed**k / math.factorial(k) for k in range(60)]
    averaged = sum(
        p * max(0.0, by_hand(k, landed_joins * k / landed, 1 - (1 - a) * k / landed))
        for k, p in enumerate(poisson)
    )
    assert priced(
        method="ddp", fault_mtbf_s=500.0, fault_replace_after_s=100.0, fault_detection_s=5.0,
        fault_horizon_s=1000.0,
    ).goodput == pytest.approx(averaged / sum(poisson), rel=1e-9)  # fmt: skip
    assert abs(averaged - expected) > 1e-3  # (the average is not G at the mean)
    assert result.family == "synchronous"
    assert (result.compute_s, result.sync_s, result.sync_every) == pytest.approx(
        (1.0, ALL_REDUCE, 1)
    )
    assert result.heal_bytes == 12e9 and result.heal_s == pytest.approx(heal)
    assert (result.crashes, result.joins) == pytest.approx((crashes, joins))
    assert result.goodput == pytest.approx(expected)
    assert 0.5 < expected < 0.9  # the case prices something
    fault_free_rate = 10 * 4096 / (10 * step)  # the plan's tokens over its wall clock
    assert result.fault_free_tokens_per_s == pytest.approx(fault_free_rate)
    assert result.committed_tokens_per_s == pytest.approx(expected * fault_free_rate)
    assert result.worker_seconds_lost == pytest.approx(m * t * (1 - expected))
    assert result.wall_clock_s == pytest.approx(10 * step / expected)


def test_diloco_with_a_slow_fraction_by_hand() -> None:
    """One slow fraction: each of the 4 slots is 2x slow with probability 1/4, so some slot
    is slow with probability p = 1 - (3/4)^4 (the slowest worker's expected pace is
    S = 1 + (2 - 1) p); a round of H = 10 steps waits for it, at 2x with probability p:
    G = p (H c + m) / (2 H c + m) + (1 - p), m the round's blocking all-reduce."""
    result = priced(
        method="diloco",
        diloco=DiLoCoOptions(sync_every=10),
        fault_slow_fraction=0.25,
        fault_slow_factor=2.0,
    )
    pace = 1 + (2 - 1) * (1 - 0.75**4)
    assert result.family == "local" and result.sync_every == 10
    assert result.slowest_pace == pytest.approx(pace)
    assert result.sync_s == pytest.approx(ALL_REDUCE)
    p = 1 - 0.75**4
    slowed = (10 + ALL_REDUCE) / (10 * 2 + ALL_REDUCE)
    assert result.goodput == pytest.approx(p * slowed + (1 - p))
    # No crash: nothing is lost to membership, and T is the planned run's wall clock.
    assert result.crashes == result.joins == 0
    assert result.horizon_s == pytest.approx(10 + ALL_REDUCE)


def test_diloco_under_crashes_by_hand() -> None:
    """A crash at a uniform moment of a round of rho = H c + m loses the dead worker's half
    round; it lands at the start of the next step, k = 2 - p steps of c = 1 s before the
    sync: the round's first (p = 0) with probability (c + m) / rho (it takes the crashes
    during the sync), the second with c / rho, and the survivors wait D - k c for the
    detection (D > H c); a join heals
    the anchor and the outer momentum (8 bytes per parameter)."""
    result = at_mean(
        method="diloco",
        diloco=DiLoCoOptions(sync_every=2),
        fault_mtbf_s=2000.0,
        fault_replace_after_s=50.0,
        fault_detection_s=6.0,
        fault_horizon_s=500.0,
    )
    m, rate, r, d, t = 4, 1 / 2000, 50.0, 6.0, 500.0
    a = 1 - rate / (1 + rate * r) * (r - r * r / (2 * t))  # (slots start filled)
    crashes, joins = m * a * rate * t, m * a * rate * (t - r)
    rho = 2 * 1.0 + ALL_REDUCE  # 5.006 s < D
    wait = ((1.0 + ALL_REDUCE) * (d - 2.0) + 1.0 * (d - 1.0)) / rho
    heal = 8e9 / 1e9 + 2 * 3 * 1e-3  # (two broadcasts over the 4 workers, 3 hops of 1 ms)
    # (One healing a step, on the 9 of the plan's 10 steps after R: (T - R) / T = 9/10.)
    healed = healed_by_hand(joins, 9, rho / 2, heal)
    expected = a - (crashes * (rho / 2 + (m - 1) * a * wait) + healed * m * a * heal) / (m * t)
    assert result.heal_s == pytest.approx(heal)
    assert result.goodput == pytest.approx(expected)


def test_without_faults_goodput_is_one_and_the_plan_is_unchanged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = config(method="diloco")
    assert not plain.prices_faults()
    quiet = config(method="diloco", fault_detection_s=30.0, fault_replace_after_s=60.0)
    assert quiet.prices_faults()
    assert make_plan(quiet) == make_plan(plain)  # the fault options leave the plan alone
    assert price_faults(quiet, make_plan(quiet)).goodput == 1.0
    # Without a fault option the output has no goodput, in JSON and in the table.
    assert "goodput" not in run_plan(dataclasses.replace(plain, json=True))
    assert "goodput" not in json.loads(capsys.readouterr().out)
    run_plan(plain)
    assert "goodput" not in capsys.readouterr().out
    with_faults = dataclasses.replace(plain, fault_mtbf_s=3600.0, json=True)
    result = run_plan(with_faults)
    assert json.loads(capsys.readouterr().out)["goodput"] == result["goodput"]
    assert {k: v for k, v in result.items() if k != "goodput"} == run_plan(
        dataclasses.replace(plain, json=True)
    )
    capsys.readouterr()


def test_the_table_prints_goodput_after_utilisation() -> None:
    result = lowcomm(
        "plan", "--method", "ddp", "--workers", "16", "--fault-mtbf-s", "86400",
        "--fault-replace-after-s", "600", "--fault-slow-fraction", "0.1",
        "--fault-slow-factor", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()]
    assert rows[rows.index("utilisation") + 1] == "goodput"
    assert "(synchronous model)" in result.stdout


def test_ddp_loses_goodput_with_m_and_diloco_keeps_more_where_crashes_dominate() -> None:
    """Under crashes and stragglers, ddp's goodput falls as M grows: every crash stalls all
    M - 1 survivors for the detection and the dropped step. DiLoCo's survivors keep their
    round, so from M = 256 on it keeps more. (Stragglers alone do not order them so: both wait
    for the slowest at every sync, and ddp's larger exposed communication dilutes the
    straggler's compute.)"""
    goodputs: dict[str, list[float]] = {"ddp": [], "diloco": []}
    sizes = [16, 64, 256, 1024]
    for method, series in goodputs.items():
        for workers in sizes:
            value = priced(
                method=method, workers=workers, params="125m", network="ethernet",
                bandwidth_gbps=None, latency_ms=None, bytes_per_element=None,
                tokens=1e10, fault_mtbf_s=3600.0, fault_replace_after_s=300.0,
                fault_slow_fraction=0.01, fault_slow_factor=2.0,
            ).goodput  # fmt: skip
            assert value is not None
            series.append(value)
    ddp, diloco = goodputs["ddp"], goodputs["diloco"]
    assert all(later < earlier for earlier, later in itertools.pairwise(ddp)), ddp
    assert all(d > s for d, s in zip(diloco[2:], ddp[2:], strict=True)), (diloco, ddp)


def test_a_million_workers() -> None:
    for method in ("ddp", "diloco"):
        result = priced(
            method=method, workers=1_000_000, fault_mtbf_s=86400.0 * 365,
            fault_replace_after_s=600.0, fault_slow_fraction=0.01, fault_slow_factor=1.5,
        )  # fmt: skip
        assert result.goodput is not None and 0.0 <= result.goodput <= 1.0
        assert math.isfinite(result.worker_seconds_lost or 0.0)
        assert result.slowest_pace == pytest.approx(1.5)  # some slot is slow, surely


def test_every_method_has_a_fault_model_and_unpriced_ones_say_why() -> None:
    for name in STRATEGIES:
        assert name in _FAULT_MODELS, f"{name}: name its family in lowcomm.plan._FAULT_MODELS"
        model = fault_model(name)
        assert (model.family is None) == bool(model.reason), name
    assert fault_model("a_new_method").family is None
    result = priced(method="acco", fault_mtbf_s=3600.0)
    assert result.goodput is None and result.committed_tokens_per_s is None
    assert "sharded over the workers" in result.reason


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--fault-mtbf-s", "0", "a mean time between failures is > 0 seconds"),
        ("--fault-replace-after-s", "-1", "a replacement joins >= 0 seconds after the crash"),
        ("--fault-slow-fraction", "1.5", r"a fraction of the workers lies in \[0, 1\]"),
        ("--fault-slow-factor", "0.5", "a slowdown is a finite factor >= 1"),
        ("--fault-detection-s", "inf", "detection takes a finite time >= 0 seconds"),
        ("--fault-horizon-s", "0", "a run lasts a finite time > 0 seconds"),
    ],
)
def test_bad_fault_options_end_in_one_line(flag: str, value: str, rule: str) -> None:
    name = flag.removeprefix("--").replace("-", "_")
    with pytest.raises(
        ValueError, match=rf"^{flag}: {float(value)} is refused: {rule}.*; pass"
    ) as raised:
        PlanConfig(**{name: float(value)})  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    result = lowcomm("plan", flag, value)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(f"lowcomm: error: {flag}: ")


def _check_script() -> types.ModuleType:
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "faults_plan_check.py"
    spec = importlib.util.spec_from_file_location("faults_plan_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_script_plans_a_run_as_it_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/faults_plan_check.py gives the planner a run's own settings: the plan of a
    fault-free run on the declared clock has the run's modeled time and bytes. A summary
    without goodput is refused in one line; with one (summary.json's faults.goodput, written
    here), the script prints measured / planned."""
    script = _check_script()
    run = tmp_path / "run"
    result = lowcomm(
        "train", "--method", "diloco", "--diloco.sync-every", "3", "--workers", "4",
        "--model.n-layer", "1", "--model.n-embd", "64", "--model.n-head", "2",
        "--model.block-size", "32", "--micro-batch-size", "4", "--eval-batches", "2",
        "--progress", "False", "--plot", "False", "--steps", "6", "--network", "wan",
        "--seconds-per-microbatch", "0.05", "--out", str(run),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "summary.json").read_text())
    planned = script.plan_for_run(run)
    assert planned.workers == 4 and planned.diloco.sync_every == 3
    assert planned.fault_horizon_s == summary["modeled_time_s"]
    plan = make_plan(planned)
    assert plan.wall_clock_s == pytest.approx(summary["modeled_time_s"], rel=1e-6)
    assert plan.comm_bytes_per_worker == pytest.approx(summary["bytes_sent_per_worker"], rel=0.01)
    assert script.main([str(run)]) == 2
    assert "summary.json: no faults.goodput" in capsys.readouterr().err
    (run / "summary.json").write_text(json.dumps({**summary, "faults": {"goodput": 0.8}}))
    assert script.main([str(run), "--json"]) == 1  # planned 1.0 without faults: 20% off
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (row["measured"], row["predicted"], row["ratio"]) == (0.8, 1.0, 0.8)
    assert script.main([str(run), "--tolerance", "0.25"]) == 0


def test_a_sync_landing_a_round_late_is_priced_with_the_rounds_it_drops_by_hand() -> None:
    """eager (N = 1) over 10 steps of H = 2 (R = 5 rounds): the exchanges of rounds 0-3 each
    fly one round and fail if a crash falls in it, D = 4 (1 - (4/5)^n) of them, each a
    round rho of the dead worker and of the (M - 1) a survivors. A join is healed with phi,
    the outer momentum and the exchange in flight (its mean and the sender's own), which is
    sent only while live: at a join it has flown (H + 1) / 2 steps on average, failed with
    probability 1 - (1 - 1.5 / 10)^n. Before healing, the members settle it: a join u steps
    after its launch (u = 0 or 1, each with probability 1/2) waits max(0, x - u c) for its
    x = 3.006 s all-reduce, which overlaps the round's H c = 2 s of compute. Both runs end by
    draining the last exchange, launched at the last step: E = min(x, H c) = 2 s past the
    busy link, in which nobody computes, so the rounds are priced over T - E, the drain
    commits nothing ((T - E) / T), and the fault-free rate is the plan's W = 10 c + 5 (x - 2)
    + E (W / (W - E))."""
    options = DiLoCoOptions(sync_every=2, outer_delay=1)
    eager = at_mean(
        method="eager", diloco=options, fault_mtbf_s=500.0, fault_replace_after_s=100.0,
        fault_detection_s=5.0, fault_horizon_s=1000.0,
    )  # fmt: skip
    m, rate, r, d, t = 4, 1 / 500, 100.0, 5.0, 1000.0
    a = 1 - rate / (1 + rate * r) * (r - r * r / (2 * t))  # (slots start filled)
    crashes, joins = m * a * rate * t, m * a * rate * (t - r)
    rho = 2 * eager.compute_s + eager.sync_s
    # (The crash lands k = 2 - p steps of 1 s before the sync, p = 0 also for a crash during
    # the round's exposed sync.)
    wait = ((1.0 + eager.sync_s) * (d - 2.0) + 1.0 * (d - 1.0)) / rho
    dropped = 4 * (1 - 0.8**crashes)
    lost = crashes * (rho / 2 + (m - 1) * a * wait) + dropped * (1 + (m - 1) * a) * rho
    failed = 1 - 0.85**crashes
    tensors = 4 - 2 * failed  # phi, momentum, and the mean and own in flight when live
    heal = 4e9 * tensors / 1e9 + tensors * 3 * 1e-3  # (a model per tensor; 3 hops of 1 ms)
    settle = (ALL_REDUCE + (ALL_REDUCE - 1.0)) / 2
    # (One healing a step, on the 9 of the plan's 10 steps after R: (T - R) / T = 9/10.)
    healed = healed_by_hand(joins, 9, rho / 2, heal + settle)
    drain = 2.0
    wall = 10.0 + 5 * (ALL_REDUCE - 2.0) + drain
    kept = a - (lost + healed * m * a * (heal + settle)) / (m * (t - drain))
    expected = kept * (t - drain) / t * wall / (wall - drain)
    assert eager.family == "local" and eager.sync_every == 2
    assert eager.sync_s == pytest.approx(ALL_REDUCE - 2.0)  # (its exposed part)
    assert eager.heal_s == pytest.approx(heal, rel=1e-12)
    assert eager.goodput == pytest.approx(expected, rel=1e-12)
    assert eager.heal_bytes == (8 + 4 * 2) * 1e9  # phi, momentum, the mean and own in flight
    diloco = at_mean(
        method="diloco", diloco=options, fault_mtbf_s=500.0, fault_replace_after_s=100.0,
        fault_detection_s=5.0, fault_horizon_s=1000.0,
    )  # fmt: skip
    # Over the rounds it computes, the dropped rounds outweigh the hidden sync; its goodput
    # itself is measured against a fault-free rate that its final drain, 2 s of its 17-s
    # run, slows too.
    assert kept < diloco.goodput < eager.goodput


def test_a_run_of_a_one_block_model_is_planned_with_the_fragments_it_used() -> None:
    """streaming_diloco's default of 4 fragments is capped at the model's blocks in training:
    a 1-block model trains with 1, and H = 4, tau = 1 fit it where they do not fit 4."""
    from lowcomm.config import PlacementConfig, TrainConfig
    from lowcomm.models import ModelConfig
    from lowcomm.plan import plan_for_run

    options = DiLoCoOptions(sync_every=4, overlap_steps=1)
    train = TrainConfig(
        method="streaming_diloco", placement=PlacementConfig(workers=4), diloco=options,
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
    )  # fmt: skip
    planned = plan_for_run(
        train, params="1e6", tokens=4096.0, steps=8, seconds_per_step=1.0, horizon_s=10.0
    )
    assert planned.diloco.fragments == 1
    assert make_plan(planned).steps == 8
    with pytest.raises(ValueError, match=r"--diloco\.overlap-steps: 1 must be < H/K"):
        make_plan(dataclasses.replace(planned, diloco=options))


def test_streaming_diloco_loses_only_its_last_sync_by_hand() -> None:
    """streaming_diloco, H = 4, F = 2 fragments, tau = 1, over the plan's K = 10 steps: a
    failed sync's tokens wait for the next that completes, so a crash costs what diloco's
    does, plus, when one falls in the run's last tau steps (1 - (1 - tau / K)^n), every
    survivor's steps since the previous completed sync: H / F steps, 1 / F of a round. A
    join waits for a sync launched at the step before it (F of the H steps: probability
    F / H) for its whole x: each fragment's all-reduce (half the model, x = 1.506 s) overlaps
    tau c = 1 s of compute."""
    from lowcomm.faults.goodput import expected_last_sync_lost

    options = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
    result = at_mean(
        method="streaming_diloco", diloco=options, fault_mtbf_s=200.0,
        fault_replace_after_s=100.0, fault_detection_s=5.0, fault_horizon_s=1000.0,
    )  # fmt: skip
    m, rate, r, d, t = 4, 1 / 200, 100.0, 5.0, 1000.0
    a = 1 - rate / (1 + rate * r) * (r - r * r / (2 * t))  # (slots start filled)
    crashes, joins = m * a * rate * t, m * a * rate * (t - r)
    rho = 4 * result.compute_s + result.sync_s
    # (The survivors wait for the detection at each launch and each completion of a sync:
    # fragment 1 launches after step 0 of the round and completes after step 1, fragment 2
    # after steps 2 and 3, so the crash, at the start of a step, waits at its end.)
    wait = d - 1.0
    last = (1 - 0.9**crashes) / 2
    lost = crashes * (rho / 2 + (m - 1) * a * wait) + last * (m - 1) * a * rho
    x = 2 * 3 / 4 * 1e9 / 1e9 + 2 * 3 * 1e-3  # (half a bf16 model on 4 workers)
    settle = 2 / 4 * x
    healed = healed_by_hand(joins, 9, rho / 4, result.heal_s + settle)  # (9/10 after R)
    expected = a - (lost + healed * m * a * (result.heal_s + settle)) / (m * t)
    assert result.family == "local" and result.sync_every == 4
    assert result.sync_s == pytest.approx(2 * (x - 1.0))
    assert expected_last_sync_lost(
        crashes, overlap_steps=1, fragments=2, steps=10
    ) == pytest.approx(last)
    assert result.goodput == pytest.approx(expected, rel=1e-12)
    assert 0.1 < last < 0.5  # (the case prices the last sync)
    # Without overlap nothing waits for a later sync: no loss at the end.
    flat = at_mean(
        method="streaming_diloco", diloco=dataclasses.replace(options, overlap_steps=0),
        fault_mtbf_s=200.0, fault_replace_after_s=100.0, fault_detection_s=5.0,
        fault_horizon_s=1000.0,
    )  # fmt: skip
    assert flat.goodput is not None and result.goodput is not None
    assert flat.goodput > result.goodput


def test_a_decoupled_run_ends_with_its_straggler_by_hand() -> None:
    """decoupled_diloco over K = 10 ticks, each slot 3x slow with probability 1/4: a
    straggler steps at ticks floor(3 j), so it takes ceil(10 / 3) = 4 inner steps (r = 4/10)
    and its last ends (4 * 3 - 10) c = 2 c after the others' K rho0 / H; with a straggler
    (p = 1 - (3/4)^4) the run stretches by that tail, in which nobody else computes."""
    from lowcomm.strategies.decoupled_diloco import DecoupledOptions

    result = priced(
        method="decoupled_diloco", decoupled=DecoupledOptions(sync_every=2, fragments=1),
        fault_slow_fraction=0.25, fault_slow_factor=3.0,
    )  # fmt: skip
    c = result.compute_s
    run_s = 10 * (2 * c + result.sync_s) / 2
    p, f = 1 - 0.75**4, 0.25
    expected = (p * run_s / (run_s + 2 * c) + 1 - p) * (1 - f + f * 4 / 10)
    assert result.family == "decoupled" and result.crashes == 0
    assert result.goodput == pytest.approx(expected, rel=1e-12)
    assert expected < 1 - f + f / 3  # (the tail costs more than the share gains)


def test_a_straggler_hides_an_overlapped_sync_by_hand() -> None:
    """streaming_diloco, H = 4, F = 2, tau = 1: each fragment's all-reduce (x = 1.506 s)
    overlaps tau c = 1 s of compute and exposes x - 1 without faults. Behind a 2x straggler
    the overlapped compute is the straggler's, 2 s, which hides it whole: a round takes
    H c 2 + 0, not H c 2 + 2 (x - 1)."""
    options = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
    result = priced(
        method="streaming_diloco", diloco=options, fault_slow_fraction=0.25,
        fault_slow_factor=2.0,
    )  # fmt: skip
    x = 2 * 3 / 4 * 1e9 / 1e9 + 2 * 3 * 1e-3
    rho0 = 4 * 1.0 + 2 * (x - 1.0)
    p = 1 - 0.75**4
    assert result.goodput == pytest.approx(p * rho0 / (4 * 2.0) + (1 - p), rel=1e-12)
    assert rho0 / (4 * 2.0) > rho0 / (4 * 2.0 + 2 * (x - 1.0))  # (the blocking reading)


@pytest.mark.parametrize(
    ("method", "options", "steps"),
    [
        ("eager", ["--diloco.sync-every", "4"], 9),
        ("diloco_delayed", ["--diloco.sync-every", "4", "--diloco.outer-delay", "2"], 9),
        ("co2", ["--local.sync-every", "4"], 12),
        ("overlap_local_sgd", ["--local.sync-every", "4"], 12),
    ],
)
def test_the_plan_of_an_overlapping_method_ends_with_the_runs_final_drain(
    method: str, options: list[str], steps: int, tmp_path: Path
) -> None:
    """A run whose exchange overlaps the next rounds (H = 4 steps of 0.25 s, on a link where
    an exchange takes about 0.44 s, co2's twice that) ends by waiting for the last one still
    in flight: launched at the last step (12 steps) or one step before it (9 steps), it is
    waited for x or x - 0.25 s. The plan's wall clock is the run's modeled time, that drain
    included."""
    script = _check_script()
    run = tmp_path / "run"
    result = lowcomm(
        "train", "--method", method, *options, "--workers", "4", "--model.n-layer", "1",
        "--model.n-embd", "32", "--model.n-head", "2", "--model.block-size", "32",
        "--micro-batch-size", "2", "--eval-batches", "2", "--progress", "False", "--plot",
        "False", "--steps", str(steps), "--network", "wan", "--bandwidth-gbps", "0.01",
        "--seconds-per-microbatch", "0.25", "--out", str(run),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "summary.json").read_text())
    plan = make_plan(script.plan_for_run(run))
    assert plan.final_drain_s > 0.0
    assert plan.wall_clock_s == pytest.approx(summary["modeled_time_s"], rel=1e-6)


def test_the_final_drain_by_hand() -> None:
    """D_end = max(0, min(x, y) - u c): the last exchange (x = 3.006 s, overlapping y = N H c
    of compute) launched u steps before the run's end (10 steps of c = 1 s). eager, H = 4:
    launches at steps 4 and 8, u = 2, so 1.006 s; H = 5: u = 0, x; H = 2, N = 1: the link
    busy (x > y = 2), u = 0, y. co2 closes its trailing partial round at the last step (u = 0).
    The wall clock is compute, the rounds' exposed max(0, x - y) and D_end."""
    cases = [
        ("eager", DiLoCoOptions(sync_every=4), ALL_REDUCE - 2.0, 0.0),
        ("diloco_delayed", DiLoCoOptions(sync_every=5), ALL_REDUCE, 0.0),
        ("eager", DiLoCoOptions(sync_every=2), 2.0, 5 * (ALL_REDUCE - 2.0)),
        ("diloco_delayed", DiLoCoOptions(sync_every=2, outer_delay=2), ALL_REDUCE, 0.0),
    ]
    for method, options, drain, rounds in cases:
        plan = make_plan(config(method=method, diloco=options))
        assert plan.final_drain_s == pytest.approx(drain), (method, options)
        assert plan.comm_exposed_s == pytest.approx(rounds + drain), (method, options)
        assert plan.wall_clock_s == pytest.approx(10.0 + rounds + drain), (method, options)
    for method in ("diloco", "streaming_diloco", "cocodc", "ddp", "acco"):
        assert make_plan(config(method=method)).final_drain_s == 0.0, method


def test_a_drained_run_keeps_its_rate_behind_a_straggler_by_hand() -> None:
    """No crash, one slot 3x slow: the rounds keep rho0 / rho of the fault-free pace, but both
    runs end by waiting D = x for the last exchange (eager, H = 5: x = 3.006 s under y = 5 s),
    so over the faulted run's T the rounds take T - D, and the fault-free rate is W's:

        G = (rho0 / rho) (T - D) / T * W / (W - D)"""
    options = DiLoCoOptions(sync_every=5)
    planned = config(method="eager", diloco=options, fault_horizon_s=40.0)
    plan = make_plan(planned)
    exposure = expected_exposure(
        FaultOptions.given(duration_s=40.0, detection_s=5.0, slow_fraction=0.25, slow_factor=3.0),
        workers=4,
    )
    exposure = dataclasses.replace(exposure, slow_present=1.0)
    goodput = price_faults(planned, plan, exposure=exposure).goodput
    rho0, rho = 5 * 1.0, 5 * 3.0  # (x hides under both rounds' compute)
    drain, wall, t = ALL_REDUCE, 10.0 + ALL_REDUCE, 40.0
    assert plan.wall_clock_s == pytest.approx(wall)
    assert goodput == pytest.approx(rho0 / rho * (t - drain) / t * wall / (wall - drain))


#: A straggler's run meeting the faults whose pricing depends on where in a round they
#: fall: crashes in mid-round (their detection done before the straggler's sync), one at a
#: round's last step (the survivors wait for its detection), two in one round, two joiners
#: healed at the step right after a launch (they wait for the whole exchange) and joins at
#: other steps (they wait for none), one while the exchange in flight has failed (its
#: healing does not send it: eager).
_ROUNDS_TRACE = """\
step=0      worker=1  slow factor=3
step=5      worker=2  crash
step=10     worker=2  join
step=14     worker=3  crash
step=15     worker=2  crash
step=16     worker=3  join
step=16     worker=2  join
step=21     worker=3  crash
step=23     worker=3  join
"""


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("eager", ["--diloco.sync-every", "4"]),
        ("co2", ["--local.sync-every", "4"]),
        ("diloco", ["--diloco.sync-every", "4"]),
        ("streaming_diloco", ["--diloco.sync-every", "4"]),
    ],
)
def test_the_model_given_a_runs_faults_prices_where_in_the_round_they_fell(
    method: str, options: list[str], tmp_path: Path
) -> None:
    """M = 4, H = 4, 28 steps of 1 s, worker 1 3x slow, a 0.5 s latency (an exchange of
    about 3 s, hidden behind the straggler's round; a healing broadcast 1.5 s per tensor).
    A crash lands at the start of a step: the survivors wait for its detection (5 s) only
    when the straggler's next sync (streaming_diloco: its next launch or completion) comes
    sooner, and a join waits for the exchange in flight only at the step right after its
    launch (eager and co2 launch after a round's last step, streaming_diloco after its
    third, tau = 1 step before the sync completes). The planner's model given the run's faults, and the
    steps they fell on, prices the goodput measured against the fault-free run (its
    committed tokens per modeled second) to 1%."""
    script = _check_script()
    trace = tmp_path / "faults.txt"
    trace.write_text(_ROUNDS_TRACE)
    for kind, faults in (("clean", []), ("faults", ["--faults", str(trace)])):
        result = lowcomm(
            "train", "--method", method, *options, "--workers", "4", "--model.n-layer", "1",
            "--model.n-embd", "32", "--model.n-head", "2", "--model.block-size", "32",
            "--micro-batch-size", "2", "--eval-batches", "2", "--progress", "False", "--plot",
            "False", "--steps", "28", "--network", "wan", "--latency-ms", "500",
            "--seconds-per-microbatch", "1.0", "--out", str(tmp_path / f"{method}-{kind}"),
            *faults,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    run = tmp_path / f"{method}-faults"
    assert script.run_steps_met(run) == FaultSteps(crashes=(5, 14, 15, 21), healings=(10, 16, 23))
    row = script.check_run(run)
    assert row["ratio_given"] == pytest.approx(1.0, abs=0.01), row


def test_a_runs_steps_and_time_are_derived_from_its_trace(tmp_path: Path) -> None:
    """benchmarks/faults_plan_check.py derives, without running it, where each event of a
    generated trace lands and how long the run lasts: on the method's schedule at the
    slowest slot's pace, with the costs of the crashes and healings met so far. Seed 12 of
    the benchmark's options at M = 16 has a 3x straggler, three or four crashes (two on
    successive steps; ddp's two joins on one step): the derived membership changes are the
    run's step for step, its modeled
    time within 0.5 s of the run's (271.8 s and 242.4 s), and the model given the derived
    faults equals the
    model given the run's."""
    from lowcomm.bench.faults import FaultsBench, run_faults
    from lowcomm.config import TrainConfig
    from lowcomm.faults.run import run_trace

    script = _check_script()
    bench = FaultsBench(workers=(16,), methods=("ddp", "eager"), fault_seed=12, out=str(tmp_path))
    run_faults(bench)
    for method in bench.methods:
        run = tmp_path / "runs" / f"{method}-m16-faults"
        summary = json.loads((run / "summary.json").read_text())
        config = script.bench_plan_config(bench, method, 16)
        plan = make_plan(config)
        trace = run_trace(TrainConfig.from_dict(json.loads((run / "config.json").read_text())))
        assert trace is not None
        derived = script.derived_summary(config, plan, trace)
        changes = summary["faults"]["membership_changes"]
        assert [(c["step"], [e["kind"] for e in c["events"]]) for c in changes] == [
            (c["step"], [e["kind"] for e in c["events"]])
            for c in derived["faults"]["membership_changes"]
        ]
        assert sum(e["kind"] == "crash" for c in changes for e in c["events"]) >= 3
        assert derived["modeled_time_s"] == pytest.approx(summary["modeled_time_s"], abs=0.5)
        given, _ = script.model_given_trace(config, plan, trace)
        assert given == pytest.approx(script.check_run(run)["given"], rel=1e-3)


def test_the_expectation_is_the_mean_over_traces_of_the_model_given_each() -> None:
    """The planner's expectation over a generated trace's draws (what `lowcomm plan
    --fault-*` prints) against the mean, over 400 traces of the benchmark's options at
    M = 16, of the model given each trace's own faults (which matches each simulated run
    to 1%): within three standard errors of that mean (a band a correct expectation leaves
    with probability 0.997; the mean is stratified by whether a slot is slow, as the
    trace draws it with probability 1 - 0.9^16)."""
    from lowcomm.bench.faults import FaultsBench

    script = _check_script()
    methods = ("ddp", "diloco", "streaming_diloco", "decoupled_diloco", "eager", "co2")
    bench = FaultsBench(methods=(*methods, "diloco_delayed"))
    rows = script.trace_average(bench, workers=16, methods=methods, seeds=range(400))
    for row in rows:
        assert 0.0 < row["given_se"] < 0.01, row
        assert abs(row["given"] - row["expected"]) <= 3.0 * row["given_se"], row


def test_the_term_breakdown_adds_up_to_the_model_given_a_trace() -> None:
    """The check's per-term breakdown of G given a trace's faults (what its --terms table
    compares with the expectation's) prices what the model given that trace prices: the
    live slot-time less its terms, times the final drain's factor, is that G, for every
    overlapped method of the local family at M = 16."""
    from lowcomm.bench.faults import FaultsBench
    from lowcomm.faults.generate import generate_trace
    from lowcomm.plan import _drained, _fault_options

    script = _check_script()
    bench = FaultsBench(methods=script.EXPECTATION_METHODS)
    for method in ("eager", "diloco_delayed", "co2", "streaming_diloco"):
        config = script.bench_plan_config(bench, method, 16)
        plan = make_plan(config)
        options = _fault_options(config, script._TRACE_HORIZON * plan.wall_clock_s)
        checked = 0
        for seed in range(12):
            trace = generate_trace(dataclasses.replace(options, seed=seed), workers=16)
            summary = script.derived_summary(config, plan, trace)
            if not script.steps_met(summary).crashes:
                continue
            horizon = float(summary["modeled_time_s"])
            run = dataclasses.replace(config, fault_horizon_s=horizon)
            exposure = script.exposure_met(
                summary, trace, workers=16, method=method, detection_s=run.fault_detection_s
            )
            drained = _drained(plan, horizon)
            if drained is not None:
                exposure = dataclasses.replace(exposure, duration_s=horizon - plan.final_drain_s)
            terms = script.local_terms(
                run, plan, exposure, steps_met=script.steps_met(summary),
                given=(
                    script.dropped_rounds_met(summary, run),
                    script.last_sync_lost_met(summary, run),
                ),
            )  # fmt: skip
            lost = sum(
                terms[k] for k in ("partial", "detection", "dropped", "last_sync", "healing")
            )
            value = min(1.0, max(0.0, terms["alive"] - lost)) * (drained or 1.0)
            given, _ = script.model_given_trace(config, plan, trace)
            assert value == pytest.approx(given, rel=1e-9), (method, seed)
            checked += 1
        assert checked >= 3, method
