"""The planner against hand-computed values, and against a measured virtual-clock run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from _cli import lowcomm
from lowcomm.plan import PlanConfig, make_plan, parse_params, solve_bandwidth
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions

# 8 Gbit/s = 1e9 bytes/s and 1 ms latency keep the arithmetic readable.
BASE = {
    "params": "1e9",
    "workers": 4,
    "tokens": 10 * 4096.0,
    "tokens_per_step": 4096.0,
    "seconds_per_step": 1.0,
    "network": "wan",
    "bandwidth_gbps": 8.0,
    "latency_ms": 1.0,
    # 2 bytes per element, as bf16 (not --comm-dtype bf16, which acco refuses: its
    # communication thread does not cast)
    "bytes_per_element": 2.0,
}
ALL_REDUCE = 2 * 3 / 4 * 2e9 / 1e9 + 2 * 3 * 1e-3  # one bf16 model on 4 workers: 3.006 s


def plan(**overrides: object):  # type: ignore[no-untyped-def]
    return make_plan(PlanConfig(**{**BASE, **overrides}))  # type: ignore[arg-type]


def test_ddp_by_hand() -> None:
    result = plan(method="ddp")
    assert result.steps == 10
    assert result.compute_s == pytest.approx(10.0)
    assert result.comm_exposed_s == pytest.approx(10 * ALL_REDUCE)
    assert result.comm_hidden_s == pytest.approx(0.0)
    assert result.utilization == pytest.approx(10 / (10 + 10 * ALL_REDUCE))
    assert result.comm_bytes_per_worker_per_step == pytest.approx(3e9)
    assert result.memory_per_worker_bytes == pytest.approx(16e9)  # (2+2+K) Psi


def test_memory_follows_acco_table_one() -> None:
    # (K, M, Psi) = (12, 64, 7.5B): 120, 31, 150, 150, 180, 46, 46, 46 GB.
    expected = {
        "ddp": 120,
        "zero1": 31.4,
        "slowmo": 150,
        "diloco": 150,
        "co2": 180,
        "dpu": 46.4,
        "wp": 46.4,
        "acco": 46.4,
    }
    for method, gigabytes in expected.items():
        result = make_plan(PlanConfig(method=method, params="7.5b", workers=64))
        assert result.memory_per_worker_bytes / 1e9 == pytest.approx(gigabytes, abs=0.1), method


def test_overlap_hides_what_fits_in_the_window() -> None:
    own_d = LocalOptions(sync_every=4, shared_displacement=False)  # one payload per round
    hidden = plan(method="co2", local=own_d)  # 3.006 s of comm under 4 s of compute
    # Every round's all-reduce hides; the last one (its trailing partial round closed at the
    # 10th step) is drained after the last step, with nothing left to hide behind.
    assert hidden.final_drain_s == pytest.approx(ALL_REDUCE)
    assert hidden.comm_exposed_s == pytest.approx(ALL_REDUCE)
    assert hidden.utilization == pytest.approx(10 / (10 + ALL_REDUCE))
    partial = plan(method="co2", local=LocalOptions(sync_every=2, shared_displacement=False))
    # 2 s to hide behind, and the last drain waits the 2 s the link had hidden.
    assert partial.final_drain_s == pytest.approx(2.0)
    assert partial.comm_exposed_s == pytest.approx(10 * (ALL_REDUCE - 2) / 2 + 2.0)
    blocking = plan(method="slowmo", local=LocalOptions(sync_every=2))
    assert blocking.comm_exposed_s == pytest.approx(10 * ALL_REDUCE / 2)
    # By default CO2 sends the shared displacement d in the same all-reduce: twice the payload.
    shared = plan(method="co2", local=LocalOptions(sync_every=4))
    assert shared.comm_bytes_per_worker_per_step == pytest.approx(
        2 * hidden.comm_bytes_per_worker_per_step
    )


def test_periods_scale_the_bytes() -> None:
    ddp = plan(method="ddp").comm_bytes_per_worker_per_step
    assert plan(
        method="diloco", diloco=DiLoCoOptions(sync_every=16)
    ).comm_bytes_per_worker_per_step == pytest.approx(ddp / 16)
    assert plan(
        method="favg_opt", desloc=DeslocOptions(param_period=8)
    ).comm_bytes_per_worker_per_step == pytest.approx(ddp / 8)
    assert plan(
        method="local_adam", desloc=DeslocOptions(param_period=8)
    ).comm_bytes_per_worker_per_step == pytest.approx(3 * ddp / 8)
    desloc = plan(
        method="desloc", desloc=DeslocOptions(param_period=4)
    )  # K_u = 12, K_v = 24 by default
    assert desloc.comm_bytes_per_worker_per_step == pytest.approx((1 / 4 + 1 / 12 + 1 / 24) * ddp)
    assert plan(method="acco").comm_bytes_per_worker_per_step == pytest.approx(2 * ddp)


def test_acco_never_idles_and_stretches_steps_when_comm_dominates() -> None:
    result = plan(method="acco")  # phase compute 0.5 s, phase comm 3.006 s
    assert result.comm_exposed_s == 0.0 and result.utilization == 1.0
    assert result.compute_s == pytest.approx(10.0)
    assert result.steps == pytest.approx(10 / (ALL_REDUCE / 0.5))


FRAGMENT_ALL_REDUCE = 2 * 3 / 4 * 0.5e9 / 1e9 + 2 * 3 * 1e-3  # a quarter of the model: 0.756 s


@pytest.mark.parametrize("method", ["streaming_diloco", "cocodc"])
def test_fragment_methods_by_hand(method: str) -> None:
    # K = 4 fragments of Psi/4, one sync each per H = 8 steps, each overlapping tau = 1 step of
    # 0.25 s. CoCoDC's N = max(K, floor(gamma H T_c / T_s)) = max(4, floor(0.4 * 8 * 0.25 /
    # 0.756)) = 4 syncs per H here, so it matches Streaming DiLoCo.
    result = plan(
        method=method, diloco=DiLoCoOptions(fragments=4, sync_every=8), seconds_per_step=0.25
    )
    syncs = 10 / 8 * 4
    assert result.compute_s == pytest.approx(2.5)
    assert result.comm_total_s == pytest.approx(syncs * FRAGMENT_ALL_REDUCE)
    assert result.comm_exposed_s == pytest.approx(syncs * (FRAGMENT_ALL_REDUCE - 0.25))
    assert result.comm_hidden_s == pytest.approx(syncs * 0.25)
    assert result.wall_clock_s == pytest.approx(2.5 + syncs * (FRAGMENT_ALL_REDUCE - 0.25))
    # Each sync puts 2 (M-1)/M of a fragment's bf16 payload on the wire.
    assert result.comm_bytes_per_worker_per_step == pytest.approx(4 * 1.5 * 0.5e9 / 8)
    assert result.comm_bytes_per_worker == pytest.approx(syncs * 1.5 * 0.5e9)
    # A deeper overlap of longer steps (tau = 2 steps of 0.5 s, H = 16 so that tau < H/K) hides
    # every fragment sync.
    deep_options = DiLoCoOptions(fragments=4, sync_every=16, overlap_steps=2)
    deep = plan(method=method, diloco=deep_options, seconds_per_step=0.5)
    assert deep.comm_exposed_s == pytest.approx(0.0)
    assert deep.comm_hidden_s == pytest.approx(10 / 16 * 4 * FRAGMENT_ALL_REDUCE)


def test_a_quantized_outer_exchange_is_two_steps_of_encoded_shards_by_hand() -> None:
    """--diloco.quantization int4: every worker encodes its M shards (0.5 byte per element in
    rows of 256, plus a 4-byte scale per row), reduce-scatters them and all-gathers the
    re-encoded mean shards, as training does (lowcomm.strategies.two_step): 2 (M-1) shards
    sent, instead of an all-reduce of 2-byte elements."""
    int4 = plan(method="diloco", diloco=DiLoCoOptions(sync_every=10, quantization="int4"))
    rows = math.ceil(1e9 / (4 * 256))  # rows of one worker's shard
    shard = rows * 256 / 2 + 4 * rows  # bytes of one encoded shard
    assert int4.comm_bytes_per_worker_per_step == pytest.approx(2 * 3 * shard / 10)
    step = 3 / 4 * (4 * shard) / 1e9 + 3 * 1e-3  # a ring reduce-scatter (or all-gather)
    assert int4.comm_total_s == pytest.approx(2 * step)  # one sync in the 10 steps
    assert int4.comm_exposed_s == pytest.approx(2 * step)
    plain = plan(method="diloco", diloco=DiLoCoOptions(sync_every=10))
    assert plain.comm_total_s == pytest.approx(ALL_REDUCE)
    # fp8's shard: a byte per element plus the scales.
    fp8 = plan(method="diloco", diloco=DiLoCoOptions(sync_every=10, quantization="fp8"))
    assert fp8.comm_bytes_per_worker_per_step == pytest.approx(2 * 3 * (rows * 256 + 4 * rows) / 10)


def test_cocodc_plan_counts_the_adaptive_syncs() -> None:
    # With a slow step, CoCoDC's adaptive transmission makes N = floor(gamma H T_c / T_s) > K
    # syncs per H (its declared cost model), where Streaming DiLoCo stays at K.
    gamma = DiLoCoOptions().transmission_gamma  # 0.4
    # T_c = 1 s, T_s = 0.756 s, H = 40: N = max(4, floor(0.4 * 40 / 0.756)) = 21, h = 1.
    syncs_per_h = max(4, math.floor(gamma * 40 * 1.0 / FRAGMENT_ALL_REDUCE))
    assert syncs_per_h > 4
    interval = max(1, 40 // syncs_per_h)
    options = DiLoCoOptions(fragments=4, sync_every=40, overlap_steps=1)
    result = plan(method="cocodc", diloco=options)
    assert result.comm_bytes_per_worker_per_step == pytest.approx(1.5 * 0.5e9 / interval)
    assert result.syncs_per_step == pytest.approx(1 / interval)
    streaming = plan(method="streaming_diloco", diloco=options)
    assert streaming.comm_bytes_per_worker_per_step == pytest.approx(1.5 * 0.5e9 * 4 / 40)


@pytest.mark.parametrize("method", ["dpu", "wp"])
def test_one_step_delay_hides_one_step_of_compute_by_hand(method: str) -> None:
    # One RS + AG of the model per step (= one all-reduce, 3.006 s) behind one step of compute.
    slow = plan(method=method)  # 1 s per step: 2.006 s of each exchange stays exposed
    assert slow.comm_total_s == pytest.approx(10 * ALL_REDUCE)
    assert slow.comm_exposed_s == pytest.approx(10 * (ALL_REDUCE - 1.0))
    assert slow.comm_hidden_s == pytest.approx(10 * 1.0)
    assert slow.utilization == pytest.approx(10 / (10 + 10 * (ALL_REDUCE - 1.0)))
    assert slow.comm_bytes_per_worker_per_step == pytest.approx(3e9)
    assert slow.memory_per_worker_bytes == pytest.approx((2 + 2 + 2 + 12 / 4) * 1e9)
    hidden = plan(method=method, seconds_per_step=4.0)  # the exchange fits behind a 4 s step
    assert hidden.comm_exposed_s == pytest.approx(0.0)
    assert hidden.comm_hidden_s == pytest.approx(10 * ALL_REDUCE)
    assert hidden.utilization == pytest.approx(1.0)


def test_solve_bandwidth_reaches_the_target() -> None:
    config = PlanConfig(**{**BASE, "method": "ddp"})  # type: ignore[arg-type]
    bandwidth = solve_bandwidth(config, 0.8)
    assert bandwidth is not None
    assert make_plan(config, bandwidth_gbps=bandwidth).utilization == pytest.approx(0.8, abs=1e-6)
    assert make_plan(config, bandwidth_gbps=bandwidth * 0.9).utilization < 0.8
    latency_bound = PlanConfig(**{**BASE, "method": "ddp", "latency_ms": 500.0})  # type: ignore[arg-type]
    assert solve_bandwidth(latency_bound, 0.9) is None


def test_every_registered_method_declares_its_cost_model() -> None:
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.declaration import CostModel

    for name, cls in STRATEGIES.items():
        assert isinstance(cls.__dict__.get("cost"), CostModel), f"{name} declares no cost model"
        result = plan(method=name)
        assert result.syncs_per_step > 0 and result.schedule, name


def test_bad_planner_input() -> None:
    with pytest.raises(ValueError, match="--params"):
        parse_params("lots")
    with pytest.raises(ValueError, match="--mfu"):
        PlanConfig(mfu=1.5)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        make_plan(PlanConfig(method="nope"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "options"),
    [("ddp", []), ("diloco", ["--diloco.sync-every", "3", "--diloco.quantization", "int4"])],
)
def test_plan_agrees_with_a_measured_virtual_run(
    method: str, options: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = [
        "--workers", "2", "--model.n-layer", "1", "--model.n-embd", "64", "--model.n-head", "2",
        "--model.block-size", "32", "--micro-batch-size", "4", "--eval-batches", "2",
        "--progress", "False", "--plot", "False", "--steps", "6", "--network", "wan",
        "--seconds-per-microbatch", "0.05", "--max-grad-norm", "None",
    ]  # fmt: skip
    result = lowcomm("train", "--method", method, *options, *args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    tokens_per_step = 2 * 4 * 32
    quantized = {"quantization": "int4", "sync_every": 3} if method == "diloco" else {}
    predicted = make_plan(
        PlanConfig(
            method=method, params=str(summary["num_params"]), workers=2,
            tokens=6 * tokens_per_step, tokens_per_step=tokens_per_step,
            seconds_per_step=0.05, network="wan", bytes_per_element=4.0,
            diloco=DiLoCoOptions(**quantized),
        )
    )  # fmt: skip
    assert summary["modeled_time_s"] == pytest.approx(predicted.wall_clock_s, rel=0.10)
    assert summary["bytes_sent_per_worker"] == pytest.approx(
        predicted.comm_bytes_per_worker, rel=0.01
    )
    assert summary["utilization"] == pytest.approx(predicted.utilization, rel=0.10)


@pytest.mark.parametrize("method", ["acco", "dpu", "wp"])
@pytest.mark.parametrize(("bandwidth", "step_s"), [("1", 1.0), ("0.01", 0.1)])
def test_the_plan_of_a_run_of_the_acco_family_computes_the_micro_batches_it_took(
    method: str, bandwidth: str, step_s: float, tmp_path: Path
) -> None:
    """Each phase of ACCO, DPU and WP takes micro-batches until its chain is done, at least
    one, two phases a step for ACCO, and the first step also computes a priming one: 6 steps
    of one micro-batch a phase compute 13 (ACCO) or 7 (DPU, WP) micro-batches, not the 6 of
    the run's --microbatches-per-step; on a slow link (a chain of about 0.6 s behind 0.1-s
    micro-batches) each phase takes several. The plan of the run (its settings, tokens and
    steps, and the declared compute per micro-batch) has its modeled time, steps and bytes."""
    from lowcomm.config import TrainConfig
    from lowcomm.plan import plan_for_run

    out = tmp_path / "run"
    result = lowcomm(
        "train", "--method", method, "--workers", "4", "--model.n-layer", "1",
        "--model.n-embd", "32", "--model.n-head", "2", "--model.block-size", "32",
        "--micro-batch-size", "2", "--eval-batches", "2", "--progress", "False", "--plot",
        "False", "--steps", "6", "--network", "wan", "--bandwidth-gbps", bandwidth,
        "--seconds-per-microbatch", str(step_s), "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    train = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    planned = make_plan(
        plan_for_run(
            train, params=str(summary["num_params"]), tokens=float(summary["tokens"]),
            steps=int(summary["steps"]), seconds_per_step=step_s,
            horizon_s=float(summary["modeled_time_s"]),
        )
    )  # fmt: skip
    if bandwidth == "1":
        phases = {"acco": 2 * 6 + 1, "dpu": 6 + 1, "wp": 6 + 1}[method]
        assert summary["modeled_time_s"] == pytest.approx(phases * step_s, rel=1e-9)
    assert planned.steps == summary["steps"] == 6
    assert planned.wall_clock_s == pytest.approx(summary["modeled_time_s"], rel=1e-6)
    assert planned.comm_bytes_per_worker == pytest.approx(
        summary["bytes_sent_per_worker"], rel=0.01
    )


# --- one declaration: plan reads train's options ----------------------------------------------


def _registered() -> list[str]:
    from lowcomm.strategies import STRATEGIES

    return sorted(STRATEGIES)


@pytest.mark.parametrize("method", _registered())
def test_plan_and_train_share_every_default(method: str) -> None:
    """Every field plan and train both have (the method option groups included) defaults to the
    same value, and the options the planner prices are the ones train would build the method
    with."""
    import dataclasses

    from lowcomm.config import TrainConfig, option_names, option_value
    from lowcomm.plan import method_options
    from lowcomm.strategies import strategy_class

    train, planned = TrainConfig(method=method), PlanConfig(method=method)
    shared = option_names() & {f.name for f in dataclasses.fields(PlanConfig)}
    assert {"method", "workers", "network", "ranks_per_worker"} <= shared
    for name in sorted(shared):
        assert getattr(planned, name) == option_value(train, name), f"{method}: --{name} differs"
    field = strategy_class(method).options_field
    _, options = method_options(planned)
    assert options == (None if field is None else getattr(train, field))


def test_both_configs_hold_exactly_the_declared_option_groups() -> None:
    import dataclasses

    from lowcomm.config import TrainConfig
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import option_groups

    groups = option_groups(STRATEGIES)
    assert set(groups) == {
        "acco", "local", "diloco", "desloc", "sparseloco", "demo", "sparta", "decoupled",
    }  # fmt: skip
    for config in (TrainConfig, PlanConfig):
        fields = {f.name: f for f in dataclasses.fields(config)}
        for name, kind in groups.items():
            assert fields[name].default_factory is kind, (config.__name__, name)  # type: ignore[comparison-overlap]


def test_plan_diloco_uses_train_default_period_and_says_so() -> None:
    from lowcomm.strategies.diloco import DiLoCoOptions

    h = DiLoCoOptions().sync_every
    assert h == 16
    ddp, diloco = plan(method="ddp"), plan(method="diloco")
    assert diloco.comm_bytes_per_worker_per_step == pytest.approx(
        ddp.comm_bytes_per_worker_per_step / h
    )
    assert diloco.schedule.startswith("H = 16")
    assert diloco.options is not None and diloco.options["sync_every"] == 16


@pytest.mark.parametrize(
    ("method", "group", "options"),
    [
        ("diloco", "diloco", {"fragments": 4}),
        ("streaming_diloco", "diloco", {"sync_every": 8, "overlap_steps": 2}),
        ("cocodc", "diloco", {"fragments": 8, "sync_every": 4}),
        ("local_adam", "desloc", {"first_moment_period": 3}),
    ],
)
def test_plan_refuses_what_train_refuses(
    method: str, group: str, options: dict[str, object]
) -> None:
    from lowcomm.config import ConfigError, TrainConfig
    from lowcomm.launch.run import check_method_options

    kind = type(getattr(TrainConfig(), group))
    train = TrainConfig(method=method, **{group: kind(**options)})  # type: ignore[arg-type]
    train.validate()  # the options alone are fine: the method refuses them when built
    with pytest.raises(ConfigError) as refused:
        check_method_options(train)  # train's pre-flight step
    with pytest.raises(ValueError) as planned:
        make_plan(PlanConfig(**{**BASE, "method": method, group: kind(**options)}))  # type: ignore[arg-type]
    assert str(planned.value) == str(refused.value)


def test_plan_command_line_takes_train_option_names() -> None:
    shown = lowcomm("plan", "--method", "diloco")
    assert shown.returncode == 0, shown.stderr
    assert "H = 16" in shown.stdout
    longer = lowcomm("plan", "--method", "diloco", "--diloco.sync-every", "32", "--json")
    assert longer.returncode == 0, longer.stderr
    assert json.loads(longer.stdout)["schedule"].startswith("H = 32")
    refused = lowcomm("plan", "--method", "diloco", "--diloco.fragments", "4")
    assert (
        refused.returncode == 2
        and "--diloco.fragments: 4 is not allowed for diloco" in refused.stderr
    )
    other = lowcomm("plan", "--method", "co2", "--diloco.sync-every", "2")
    assert other.returncode == 2 and "use --local.sync-every" in other.stderr
