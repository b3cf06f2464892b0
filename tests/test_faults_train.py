"""Declared faults in a training run with every worker a thread of one process: the round's
quorum, the dropped round, healing, the records, and the one-line refusals."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import TINY, lowcomm
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import Role
from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.comm.runtime import Quorum
from lowcomm.config import (
    CommConfig,
    ConfigError,
    FaultConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
    with_options,
)
from lowcomm.data import DataConfig
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight
from lowcomm.models import ModelConfig
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.strategies import StrategyContext
from lowcomm.strategies.co2 import LocalAdamW, LocalOptions, OverlapLocalSGD
from lowcomm.strategies.cocodc import CoCoDC
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCo, DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions
from lowcomm.strategies.streaming import StreamingDiLoCo

WORKERS = 3
DETECTION_S = 2.5
SECONDS_PER_MICROBATCH = 0.01


def _config(method: str, out: Path, faults: Path | None, **overrides: Any) -> TrainConfig:
    config = TrainConfig(
        method=method,
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        diloco=DiLoCoOptions(sync_every=2),
        local=LocalOptions(sync_every=2),
        desloc=DeslocOptions(param_period=2),
        sparseloco=SparseLoCoOptions(sync_every=2),
        placement=PlacementConfig(workers=WORKERS, workers_per_process=WORKERS),
        run=RunConfig(
            steps=8,
            eval_every=4,
            eval_batches=3,
            log_every=1,
            progress=False,
            plot=False,
            out=str(out),
        ),
        comm=CommConfig(
            network="wan", clock="virtual", seconds_per_microbatch=SECONDS_PER_MICROBATCH
        ),
        fault=FaultConfig(
            faults=None if faults is None else str(faults), fault_detection_s=DETECTION_S
        ),
    )
    if method == "sparta_diloco":  # (a round of 2 steps; a tenth of the parameters a step)
        config.sparta = SpartaOptions(sync_every=2, fraction=0.1)
    if method in ("streaming_diloco", "cocodc"):  # (two fragments, each flying one step)
        config.model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
        config.diloco = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
    config = with_options(config, **overrides)
    return config


def _run(
    config: TrainConfig, *, deployed: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any], list[torch.Tensor]]:
    """The run's metrics records, summary and every worker's final parameters (``deployed``:
    those the method deploys, which a fragmented method's workers share once synchronized)."""
    config.validate()
    preflight(config)
    summaries = train_in_process(config, keep_parameters=True)
    out = Path(str(config.run.out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    kept = [s.deployed_parameters if deployed else s.parameters for s in summaries]
    return records, summary, [p for p in kept if p is not None]


def _trace(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.txt"
    path.write_text(text)
    return path


def _tokens_per_step() -> int:
    return 2 * 16  # micro-batch of 2 sequences of 16 tokens, one micro-batch a step


# --- the whole run -------------------------------------------------------------------------


def test_a_trace_replayed_twice_gives_the_same_run_bit_for_bit(tmp_path: Path) -> None:
    trace = _trace(
        tmp_path,
        "step=3 worker=2 crash\nstep=5 worker=2 join\nstep=1 worker=0 slow factor=3 for=2\n",
    )
    first = _run(_config("ddp", tmp_path / "a", trace))
    second = _run(_config("ddp", tmp_path / "b", trace))
    assert first[0] == second[0]
    for a, b in zip(first[2], second[2], strict=True):
        assert torch.equal(a, b)
    assert first[1]["faults"] == second[1]["faults"]


@pytest.mark.parametrize(
    "method",
    [
        "ddp",
        "diloco",
        "local_sgd",
        "local_adamw",
        "slowmo",
        "desloc",
        "favg_reset",
        "sparseloco",
        "demo",
        "sparta",
        "streaming_diloco",
        "overlap_local_sgd",
        "cocodc",
        "sparta_diloco",
    ],
)
def test_an_empty_trace_gives_the_run_without_faults_exactly(method: str, tmp_path: Path) -> None:
    # (A run with faults commits tokens at its syncs: each run here ends on one; cocodc's
    # adaptive schedule syncs every 2 steps from t = 2, each completing a step later.)
    steps = {"steps": 7} if method == "cocodc" else {}
    plain = _run(_config(method, tmp_path / "plain", None, **steps))
    empty = _run(_config(method, tmp_path / "empty", _trace(tmp_path, "# no event\n"), **steps))
    for with_faults, without in zip(empty[0], plain[0], strict=True):
        assert with_faults.pop("quorum") == WORKERS
        assert with_faults == without
    for a, b in zip(empty[2], plain[2], strict=True):
        assert torch.equal(a, b)
    assert empty[1]["faults"]["rounds_dropped"] == 0
    assert empty[1]["faults"]["membership_changes"] == []
    assert empty[1]["final_val_loss"] == plain[1]["final_val_loss"]
    assert empty[1]["modeled_time_s"] == plain[1]["modeled_time_s"]
    assert empty[1]["committed_tokens"] == plain[1]["committed_tokens"]


def test_ddp_drops_the_crash_step_waits_for_detection_and_goes_on_without_the_dead_worker(
    tmp_path: Path,
) -> None:
    records, summary, _ = _run(
        _config("ddp", tmp_path / "out", _trace(tmp_path, "step=3 worker=2 crash\n"))
    )
    per_step = _tokens_per_step()
    assert [r["quorum"] for r in records] == [3, 3, 3, 2, 2, 2, 2, 2]
    assert records[3]["dropped"] is True and "dropped" not in records[4]
    assert records[3]["membership_events"] == [{"worker": 2, "kind": "crash"}]
    # The survivors computed the dropped step's gradient, then waited the detection time.
    step_s = records[2]["clock_s"] - records[1]["clock_s"]
    assert records[3]["clock_s"] - records[2]["clock_s"] >= DETECTION_S + SECONDS_PER_MICROBATCH
    assert records[3]["clock_s"] - records[2]["clock_s"] < DETECTION_S + step_s
    # Every step but the dropped one commits its members' tokens.
    committed = 3 * 3 * per_step + 4 * 2 * per_step
    faults = summary["faults"]
    assert summary["committed_tokens"] == committed == faults["committed_tokens"]
    assert faults["rounds_dropped"] == 1
    assert faults["membership_changes"] == [
        {"step": 3, "events": [{"worker": 2, "kind": "crash"}], "quorum": 2}
    ]
    # Goodput, from its definition: the fault-free step is the first steps' (every worker).
    free = WORKERS * per_step * summary["modeled_time_s"] / step_s
    assert math.isclose(faults["goodput"], committed / free, rel_tol=1e-9)
    assert math.isclose(
        faults["worker_seconds_lost"],
        WORKERS * summary["modeled_time_s"] * (1 - faults["goodput"]),
        rel_tol=1e-9,
    )


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("ddp", "join"),
        ("diloco", "join"),
        ("diloco", "rejoin"),
        ("local_adamw", "join"),
        ("slowmo", "rejoin"),
        ("desloc", "join"),
        ("local_adam", "rejoin"),
        ("sparseloco", "join"),
        ("demo", "join"),
        ("streaming_diloco", "join"),
        ("streaming_diloco", "rejoin"),
        ("cocodc", "join"),
        ("sparta_diloco", "join"),
    ],
)
def test_a_worker_that_joins_is_healed_to_the_others_parameters_bit_for_bit(
    method: str, kind: str, tmp_path: Path
) -> None:
    gone = "crash" if kind == "join" else "leave"
    trace = _trace(tmp_path, f"step=2 worker=1 {gone}\nstep=5 worker=1 {kind}\n")
    # (streaming_diloco: each worker keeps a local drift alpha theta_p of its own, so its
    # workers agree on the model they deploy, every fragment's theta^g_p.)
    deployed = method in ("streaming_diloco", "cocodc")
    records, summary, parameters = _run(_config(method, tmp_path / "out", trace), deployed=deployed)
    assert len(parameters) == WORKERS
    # (diloco, local: step 7 ends a round, after which every worker holds the same model.)
    assert all(torch.equal(parameters[0], p) for p in parameters[1:])
    assert [r["quorum"] for r in records] == [3, 3, 2, 2, 2, 3, 3, 3]
    # The healing transfer is charged on the link: the join step costs more than a plain one.
    plain = records[7]["clock_s"] - records[6]["clock_s"]
    assert records[5]["clock_s"] - records[4]["clock_s"] > plain
    assert records[5]["bytes_sent_per_worker"] > records[7]["bytes_sent_per_worker"]
    if gone == "crash":  # the survivors waited to detect it; the joiner's absence is no wait
        exposed = summary["per_worker"]["exposed_comm_s"]
        assert exposed[0] > DETECTION_S / 2 > exposed[1]


# --- the quorum and the outer step, written from the equation ---------------------------------


CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
)


def _threads(work: Callable[[int], None], count: int) -> None:
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as error:  # (re-raised on the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]


class _Tap:
    """A member's communicator that keeps a copy of each pseudo-gradient it sends."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.sent: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_reduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        if kwargs.get("role") == Role.PSEUDO_GRADIENT:
            self.sent.append(tensor.clone())
        return self._comm.all_reduce(tensor, **kwargs)


def test_diloco_after_a_crash_steps_with_the_mean_of_the_survivors_pseudo_gradients() -> None:
    lr, mu = 0.7, 0.9
    options = DiLoCoOptions(sync_every=2, outer_lr=lr, outer_momentum=mu, outer_nesterov=True)
    group = InProcessGroup(WORKERS)
    taps = [_Tap(group.comm(k)) for k in range(WORKERS)]
    strategies = [DiLoCo(tiny_gpt(), taps[k], CONTEXT, options) for k in range(WORKERS)]
    before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        rows = slice(k * 4, (k + 1) * 4)  # (worker k's rows of each global batch)
        batches = [global_batch(s, WORKERS) for s in range(4)]
        closure = closure_for(strategy, [(x[rows], y[rows]) for x, y in batches])
        for step in range(4):
            if step == 2:
                if k == 2:
                    return  # worker 2 crashes at step 2, inside the second round
                group.enter(k, 1, (0, 1))
                before[k] = (
                    strategy.globals_[0].clone(),
                    strategy.outer[0].momentum_buffer.clone(),
                )
            strategy.step(closure)

    _threads(work, WORKERS)
    anchor, momentum = before[0]
    assert torch.equal(anchor, before[1][0])
    deltas = [taps[k].sent[-1] for k in (0, 1)]  # each survivor's Delta = anchor - local
    mean = (deltas[0] + deltas[1]) / 2
    b = mu * momentum + mean
    expected = anchor - lr * (mean + mu * b)
    for k in (0, 1):
        assert torch.allclose(strategies[k].globals_[0], expected, atol=1e-6)
        assert torch.equal(flat_params(strategies[k].model), strategies[k].globals_[0])
    assert len(taps[2].sent) == 1  # the crashed worker sent the first round's only


@pytest.mark.parametrize("kept", [False, True])
def test_diloco_healing_copies_the_global_state_and_starts_the_inner_state_by_the_rule(
    kept: bool,
) -> None:
    options = DiLoCoOptions(sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    group = InProcessGroup(2)
    strategies = [DiLoCo(tiny_gpt(seed=k), group.comm(k), CONTEXT, options) for k in range(2)]
    batches = [global_batch(s, 1) for s in range(3)]
    # Worker 0 trained through a round; worker 1 took one inner step of its own and left.
    strategies[0].step(closure_for(strategies[0], batches))
    strategies[1].inner_step(closure_for(strategies[1], batches))
    own_moment = strategies[1].inner.states()[Role.FIRST_MOMENT].clone()
    strategies[0].inner_step(closure_for(strategies[0], batches[1:]))  # (mid-round)

    def work(k: int) -> None:
        strategies[k].heal(0, joining=k == 1, kept=kept)

    _threads(work, 2)
    source, joiner = strategies
    assert torch.equal(joiner.globals_[0], source.globals_[0])
    assert torch.equal(joiner.outer[0].momentum_buffer, source.outer[0].momentum_buffer)
    assert (joiner.step_index, joiner.outer_steps) == (source.step_index, source.outer_steps)
    assert torch.equal(flat_params(joiner.model), joiner.globals_[0])  # restarts at theta^g
    moment = joiner.inner.states()[Role.FIRST_MOMENT]
    if kept:
        assert torch.equal(moment, own_moment) and bool(own_moment.abs().sum() > 0)
    else:
        assert not moment.any() and joiner.inner.state_dict()["step_count"] == 0


def test_a_collective_completes_over_the_quorum_and_a_mean_divides_by_its_size() -> None:
    group = InProcessGroup(3)
    values = {0: 1.0, 1: 5.0, 2: 100.0}
    results: dict[int, float] = {}

    def work(k: int) -> None:
        if k == 1:
            return  # not in the quorum: posts nothing
        comm = group.comm(k)
        comm.enter(4, (0, 2))
        tensor = torch.tensor([values[k]])
        assert (comm.world_size, comm.rank) == (2, 0 if k == 0 else 1)
        comm.all_reduce(tensor, op="mean", role=Role.GRADIENT).wait()
        results[k] = float(tensor[0])

    _threads(work, 3)
    assert results == {0: 50.5, 2: 50.5}


# --- refusals --------------------------------------------------------------------------------


def _error(result: Any) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error: "), result.stderr
    return str(lines[0])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("step=2 worker=7 crash\n", "worker=7"),
        ("step=2 worker=0 crash\nstep=2 worker=1 crash\n", "no worker is alive from step 2"),
        ("# a comment\nstep=2 worker=0 crash\nstep=x worker=1 join\n", ":3: "),
        ("t=2 worker=0 crash\nstep=4 worker=0 join\n", "must all use one clock"),
        ("step=2 link down for=3\n", "a link down placed by step would stop the step"),
    ],
)
def test_a_bad_trace_ends_in_one_line_before_any_worker_starts(
    text: str, expected: str, tmp_path: Path
) -> None:
    trace = _trace(tmp_path, text)
    result = lowcomm(
        "train", *TINY, "--workers-per-process", "2", "--faults", str(trace), "--out",
        str(tmp_path / "out"),
    )  # fmt: skip
    assert expected in _error(result)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"method": "zero1"}, "--method zero1 keeps its optimizer state sharded"),
        ({"method": "acco"}, "--method acco keeps its optimizer state sharded"),
        (
            {"method": "eager", "diloco": DiLoCoOptions(sync_every=2, quantization="int4")},
            "not yet supported with --diloco.quantization int4",
        ),
        ({"fault_seed": 3}, "a run replays one trace, a file or a generated one"),
        ({"fault_detection_s": -1.0}, "--fault-detection-s: -1.0 is not valid"),
        ({"faults": None, "fault_slow_factor": 0.5}, "--fault-slow-factor: 0.5 is not valid"),
    ],
)
def test_what_faults_do_not_run_with_yet_is_refused_in_one_line(
    overrides: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    overrides = dict(overrides)
    method = overrides.pop("method", "ddp")
    faults = overrides.pop("faults", tmp_path / "trace.txt")
    config = _config(method, tmp_path / "out", faults, **overrides)
    with pytest.raises(ConfigError, match=expected) as caught:
        config.validate()
    assert "\n" not in str(caught.value)


def test_a_generated_trace_of_slow_workers_runs_and_replays_alike(tmp_path: Path) -> None:
    def run(out: str) -> list[dict[str, Any]]:
        config = _config(
            "diloco", tmp_path / out, None, fault_slow_fraction=0.5, fault_slow_factor=3.0,
            fault_seed=0,  # (slots 0 and 2 are slow)
        )  # fmt: skip
        return _run(config)[0]

    first = run("a")
    assert first == run("b")
    plain = _run(_config("diloco", tmp_path / "plain", None))[0]
    assert first[-1]["clock_s"] > plain[-1]["clock_s"]  # a straggler slows the synchronous rounds


def test_a_worker_that_leaves_costs_no_detection_and_drops_no_step(tmp_path: Path) -> None:
    records, summary, _ = _run(
        _config("ddp", tmp_path / "out", _trace(tmp_path, "step=3 worker=2 leave\n"))
    )
    assert [r["quorum"] for r in records] == [3, 3, 3, 2, 2, 2, 2, 2]
    assert not any("dropped" in r for r in records)
    assert records[3]["clock_s"] - records[2]["clock_s"] < DETECTION_S
    assert summary["faults"]["rounds_dropped"] == 0
    assert summary["committed_tokens"] == (3 * 3 + 5 * 2) * _tokens_per_step()


def test_local_adamw_after_a_crash_averages_the_survivors_models() -> None:
    group = InProcessGroup(WORKERS)
    strategies = [
        LocalAdamW(tiny_gpt(), group.comm(k), CONTEXT, LocalOptions(sync_every=2))
        for k in range(WORKERS)
    ]
    before_sync: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        rows = slice(k * 4, (k + 1) * 4)
        batches = [global_batch(s, WORKERS) for s in range(4)]
        closure = closure_for(strategy, [(x[rows], y[rows]) for x, y in batches])
        for step in range(4):
            if step == 2:
                if k == 2:
                    return  # worker 2 crashes inside the second round
                group.enter(k, 1, (0, 1))
            if step == 3:  # (the step's phases: the inner step, then the mean)
                strategy.inner_step(closure)
                before_sync[k] = flat_params(strategy.model)
                strategy.average()
                continue
            strategy.step(closure)

    _threads(work, WORKERS)
    mean = (before_sync[0] + before_sync[1]) / 2
    for k in (0, 1):
        assert torch.allclose(flat_params(strategies[k].model), mean, atol=1e-7)


def test_a_degraded_link_stretches_each_transfer_and_a_down_link_holds_it(tmp_path: Path) -> None:
    plain = _run(_config("ddp", tmp_path / "plain", None))[0]
    half = _run(_config("ddp", tmp_path / "half", _trace(tmp_path, "t=0 link factor=0.5\n")))[0]
    (tmp_path / "down.txt").write_text("t=0.05 link down for=1\n")
    down = _run(_config("ddp", tmp_path / "down", tmp_path / "down.txt"))[0]
    # ddp's step: one micro-batch of compute, then its all-reduce, fully exposed.
    transfer = plain[0]["clock_s"] - SECONDS_PER_MICROBATCH
    assert transfer > 0
    assert math.isclose(half[0]["clock_s"] - SECONDS_PER_MICROBATCH, 2 * transfer, rel_tol=1e-9)
    # The all-reduce launched while the link is down starts at t = 1.05.
    held = next(r for r in down if r["clock_s"] > 1.05)
    assert math.isclose(held["clock_s"], 1.05 + transfer, rel_tol=1e-9)
    assert [r["clock_s"] for r in down if r["step"] < held["step"]] == [
        r["clock_s"] for r in plain if r["step"] < held["step"]
    ]


@pytest.mark.parametrize("method", ["demo", "sparta"])
def test_a_step_round_method_drops_the_crash_step_and_commits_the_others(
    method: str, tmp_path: Path
) -> None:
    trace = _trace(tmp_path, "step=3 worker=2 crash\nstep=5 worker=2 join\n")
    records, summary, _ = _run(_config(method, tmp_path / "out", trace))
    assert [r["quorum"] for r in records] == [3, 3, 3, 2, 2, 3, 3, 3]
    assert [r.get("dropped", False) for r in records] == [False] * 3 + [True] + [False] * 4
    assert summary["committed_tokens"] == (6 * 3 + 1 * 2) * _tokens_per_step()
    assert summary["faults"]["rounds_dropped"] == 1


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_crash_placed_by_time_lands_on_the_first_step_that_starts_after_it(
    method: str, tmp_path: Path
) -> None:
    """The step's start on the run's clock is the end of the step before (its members'
    latest clock): the crash lands on the first step starting at or after its time, and the
    join likewise; two replays give the same run."""
    plain = _run(_config(method, tmp_path / "plain", None))[0]
    crash_at = (plain[1]["clock_s"] + plain[2]["clock_s"]) / 2  # (inside step 2)
    join_at = crash_at + 0.1
    trace = _trace(tmp_path, f"t={crash_at!r} worker=2 crash\nt={join_at!r} worker=2 join\n")
    first, summary, params = _run(_config(method, tmp_path / "a", trace, fault_detection_s=0.05))
    second, _, again = _run(_config(method, tmp_path / "b", trace, fault_detection_s=0.05))
    assert first == second
    for a, b in zip(params, again, strict=True):
        assert torch.equal(a, b)
    crash_step = 3  # step 2 started before the crash, step 3 at step 2's end, after it
    starts = [0.0] + [r["clock_s"] for r in first[:-1]]
    assert starts[crash_step - 1] < crash_at <= starts[crash_step]
    assert first[crash_step]["membership_events"] == [{"worker": 2, "kind": "crash"}]
    assert [r["quorum"] for r in first[:crash_step]] == [WORKERS] * crash_step
    join_step = next(s for s, start in enumerate(starts) if start >= join_at)
    assert starts[join_step - 1] < join_at
    assert first[join_step]["membership_events"] == [{"worker": 2, "kind": "join"}]
    assert [r["quorum"] for r in first[crash_step:join_step]] == [2] * (join_step - crash_step)
    assert first[join_step]["quorum"] == WORKERS
    assert [c["step"] for c in summary["faults"]["membership_changes"]] == [crash_step, join_step]


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_generated_trace_with_crashes_and_replacements_runs_and_reports_goodput(
    method: str, tmp_path: Path
) -> None:
    def run(out: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        config = _config(
            method, tmp_path / out, None, fault_mtbf_s=0.4, fault_replace_after_s=0.1,
            fault_detection_s=0.05, fault_seed=1, steps=16,
        )  # fmt: skip
        records, summary, _ = _run(config)
        return records, summary

    records, summary = run("a")
    assert (records, summary["faults"]) == (lambda r: (r[0], r[1]["faults"]))(run("b"))
    kinds = [e["kind"] for r in records for e in r.get("membership_events", [])]
    assert "crash" in kinds and "join" in kinds
    faults = summary["faults"]
    assert faults["source"].startswith("<generated seed=1")
    assert 0 < faults["goodput"] < 1
    assert faults["committed_tokens"] == summary["committed_tokens"]
    assert min(r["quorum"] for r in records) < WORKERS


def test_a_local_methods_goodput_prices_a_fault_free_step_with_its_rounds_sync(
    tmp_path: Path,
) -> None:
    """diloco's steps are mostly inner steps: the fault-free step time is the mean of the
    clean steps, which carries the sync one step in H pays (their median would not)."""
    config = _config("diloco", tmp_path / "out", _trace(tmp_path, "step=6 worker=2 crash\n"))
    config.diloco = DiLoCoOptions(sync_every=4)
    config.run.steps = 12
    records, summary, _ = _run(config)
    clean, previous = [], 0.0
    for record in records:
        if record["quorum"] == WORKERS and not record.get("membership_events"):
            clean.append(record["clock_s"] - previous)
        previous = record["clock_s"]
    mean = sum(clean) / len(clean)
    assert sorted(clean)[len(clean) // 2] < 0.9 * mean  # the median is an inner step's
    per_step = _tokens_per_step()
    free = WORKERS * per_step * summary["modeled_time_s"] / mean
    faults = summary["faults"]
    assert math.isclose(faults["goodput"], faults["committed_tokens"] / free, rel_tol=1e-9)


def test_loss_png_marks_each_membership_event_in_both_panels(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from lowcomm.train.metrics import RunWriter

    trace = _trace(tmp_path, "step=3 worker=2 crash\nstep=5 worker=2 join\n")
    config = _config("ddp", tmp_path / "out", trace)
    records = _run(config)[0]
    # (The written run's records, read back as a resumed run reads them.)
    writer = RunWriter(config, resume_step=config.run.steps)
    figure = writer.figure()
    writer.close_steps()
    by_step, by_time = figure.axes
    for axis, where in (
        (by_step, lambda step: step),
        (by_time, lambda s: records[s - 1]["clock_s"]),
    ):
        marks = {
            line.get_gid(): line.get_xdata()[0]
            for line in axis.get_lines()
            if str(line.get_gid()).startswith("membership:")
        }
        assert marks == {"membership:crash:2": where(3), "membership:join:2": where(5)}
    labels = by_step.get_legend_handles_labels()[1]
    assert "crash" in labels and "join" in labels
    plt.close(figure)


def test_a_generated_trace_grows_past_its_first_horizon_with_the_same_events(
    tmp_path: Path,
) -> None:
    """A run longer than the generated trace's first horizon (8 MTBFs) extends it at an agreed
    step; every crash and join still lands on the first step starting at or after it."""
    from lowcomm.faults import FaultOptions, generate_trace
    from lowcomm.faults.run import FIRST_HORIZON_MTBFS

    mtbf, replace = 0.5, 0.005
    config = _config(
        "diloco", tmp_path / "out", None, fault_mtbf_s=mtbf, fault_replace_after_s=replace,
        fault_detection_s=0.0, fault_seed=2, steps=48, seconds_per_microbatch=0.1, workers=6,
        workers_per_process=6,
    )  # fmt: skip
    records, summary, _ = _run(config)
    end = summary["modeled_time_s"]
    assert end > FIRST_HORIZON_MTBFS * mtbf  # (extended)
    whole = generate_trace(
        FaultOptions(duration_s=end + 1.0, mtbf_s=mtbf, replace_after_s=replace, seed=2),
        workers=config.placement.workers,
    )
    starts = [0.0] + [r["clock_s"] for r in records[:-1]]
    expected = []
    for step, start in enumerate(starts):
        before = starts[step - 1] if step > 0 else -1.0
        events = [
            {"worker": e.worker, "kind": e.kind}
            for e in whole.membership_events()
            if before < e.at <= start
        ]
        expected.append(events or None)
    assert [r.get("membership_events") for r in records] == expected
    assert sum(1 for events in expected if events) >= 3


# --- streaming_diloco: a sync in flight when a member is lost -----------------------------


class _Members:
    """A membership whose quorum the test sets (the fault engine's role in a run)."""

    def __init__(self, workers: int) -> None:
        self.current = Quorum(tuple(range(workers)))

    def quorum(self) -> Quorum:
        return self.current

    def enter_round(self) -> Quorum:
        return self.current


def test_streaming_diloco_drops_the_sync_in_flight_at_a_crash_and_steps_over_the_survivors() -> (
    None
):
    lr, mu, alpha = 0.7, 0.9, 0.5
    options = DiLoCoOptions(
        sync_every=4, fragments=2, overlap_steps=1, outer_lr=lr, outer_momentum=mu,
        outer_nesterov=True, mixing=alpha,
    )  # fmt: skip
    # Fragment 0 launches at t = 1, 5 and completes one step later; fragment 1 at t = 3, 7.
    group = InProcessGroup(WORKERS)
    taps = [_Tap(group.comm(k)) for k in range(WORKERS)]
    members = [_Members(WORKERS) for _ in range(WORKERS)]
    strategies = []
    for k in range(WORKERS):
        strategy = StreamingDiLoCo(tiny_gpt(), taps[k], CONTEXT, options)
        strategy.runtime = replace(strategy.runtime, membership=members[k])
        strategies.append(strategy)
    before: dict[int, list[torch.Tensor]] = {}
    unmerged: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        rows = slice(k * 4, (k + 1) * 4)
        batches = [global_batch(s, WORKERS) for s in range(8)]
        closure = closure_for(strategy, [(x[rows], y[rows]) for x, y in batches])
        for t in range(1, 9):
            if t == 6:
                if k == 2:
                    return  # worker 2 crashes while fragment 0's second sync is in flight
                group.enter(k, 1, (0, 1))
                members[k].current = Quorum((0, 1), 1)
                before[k] = [g.clone() for g in strategy.globals_] + [
                    o.momentum_buffer.clone() for o in strategy.outer
                ]
                strategy.mark_failed_syncs()  # (the step's phases, to see the local fragment)
                strategy.inner_step(closure)
                unmerged[k] = strategy.local_fragment(0)
                assert strategy.finish_syncs_due(t) == 1
                continue
            strategy.step(closure)

    _threads(work, WORKERS)
    anchor0, anchor1, momentum0, momentum1 = before[0]
    for k in (0, 1):
        strategy = strategies[k]
        # Fragment 0's failed sync took no outer step; its local fragment merged with the
        # unchanged theta^g_0.
        assert torch.equal(strategy.globals_[0], anchor0)
        assert torch.equal(strategy.outer[0].momentum_buffer, momentum0)
        assert strategy.outer[0].step_count == 1
    # Fragment 1's sync launched at t = 7 over the survivors: the mean of their two
    # pseudo-gradients, then the outer Nesterov step, written from the equation.
    deltas = [taps[k].sent[-1] for k in (0, 1)]
    mean = (deltas[0] + deltas[1]) / 2
    b = mu * momentum1 + mean
    expected = anchor1 - lr * (mean + mu * b)
    for k in (0, 1):
        assert torch.allclose(strategies[k].globals_[1], expected, atol=1e-6)
        assert strategies[k].outer[1].step_count == 2
    assert len(taps[2].sent) == 3  # (t = 1, 3, 5: the crashed worker launched the third)


def test_streaming_diloco_merges_a_failed_sync_with_the_unchanged_global_fragment() -> None:
    options = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1, mixing=0.5)
    group = InProcessGroup(2)
    members = [_Members(2) for _ in range(2)]
    strategies = []
    for k in range(2):
        strategy = StreamingDiLoCo(tiny_gpt(), group.comm(k), CONTEXT, options)
        strategy.runtime = replace(strategy.runtime, membership=members[k])
        strategies.append(strategy)
    results: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        batches = [global_batch(s, 1) for s in range(2)]
        strategy.step(closure_for(strategy, batches))  # t = 1: fragment 0 launches
        anchor = strategy.globals_[0].clone()
        members[k].current = Quorum((k,), 1)  # (the other member is lost while it flies)
        strategy.mark_failed_syncs()
        strategy.inner_step(closure_for(strategy, batches[1:]))
        local = strategy.local_fragment(0)
        strategy.finish_syncs_due(strategy.step_index)
        assert torch.equal(strategy.globals_[0], anchor)  # (no outer step)
        results[k] = (local, anchor, strategy.local_fragment(0))

    _threads(work, 2)
    for local, anchor, merged in results.values():
        assert torch.equal(merged, torch.lerp(anchor, local, 0.5))
        assert not torch.equal(merged, local)


def test_streaming_diloco_with_a_crash_in_flight_drops_that_sync_and_replays_bit_for_bit(
    tmp_path: Path,
) -> None:
    # (cocodc's replay: test_cocodc_with_a_crash_in_flight_and_a_join_replays_bit_for_bit.)
    # Loop step 4 is t = 5 (fragment 0 launches); worker 2 crashes at loop step 5 (t = 6),
    # when that sync completes; a replacement joins at loop step 6.
    trace = _trace(tmp_path, "step=5 worker=2 crash\nstep=6 worker=2 join\n")
    first = _run(_config("streaming_diloco", tmp_path / "a", trace), deployed=True)
    second = _run(_config("streaming_diloco", tmp_path / "b", trace), deployed=True)
    records, summary, parameters = first
    assert records == second[0] and first[1]["faults"] == second[1]["faults"]
    for a, b in zip(parameters, second[2], strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(parameters[0], p) for p in parameters[1:])
    assert [r["quorum"] for r in records] == [3, 3, 3, 3, 3, 2, 3, 3]
    extras = [r["extras"] for r in records]
    assert extras[5]["syncs_dropped"] == 1 and extras[5]["syncs_completed"] == 0
    assert not any("syncs_dropped" in e for i, e in enumerate(extras) if i != 5)
    # The survivors waited the detection time at the failed sync.
    plain = _run(_config("streaming_diloco", tmp_path / "plain", None))[0]
    assert records[5]["clock_s"] - records[4]["clock_s"] >= DETECTION_S
    assert plain[5]["clock_s"] - plain[4]["clock_s"] < DETECTION_S
    # Tokens commit at the syncs that complete (t = 2, 4, 8): the crashed worker's steps
    # since t = 4 are lost, and the failed sync commits none of the survivors' steps until
    # fragment 1's at t = 8.
    per_step = _tokens_per_step()
    assert summary["committed_tokens"] == (3 * 4 + 2 * 4 + 1 * 2) * per_step


def test_streaming_diloco_drops_a_sync_in_flight_when_a_member_leaves_without_a_detection_wait(
    tmp_path: Path,
) -> None:
    trace = _trace(tmp_path, "step=5 worker=2 leave\n")
    records = _run(_config("streaming_diloco", tmp_path / "out", trace))[0]
    assert records[5]["extras"]["syncs_dropped"] == 1
    assert records[5]["clock_s"] - records[4]["clock_s"] < DETECTION_S
    assert records[7]["extras"]["syncs_completed"] == 1  # (fragment 1, over the two left)


# --- overlap_local_sgd: the all-reduce of each boundary flies a whole round -----------------


def _overlap_strategies(count: int) -> tuple[InProcessGroup, list[Any], list[_Members]]:
    group = InProcessGroup(count)
    members = [_Members(count) for _ in range(count)]
    strategies = []
    for k in range(count):
        strategy = OverlapLocalSGD(tiny_gpt(), group.comm(k), CONTEXT, LocalOptions(sync_every=2))
        strategy.runtime = replace(strategy.runtime, membership=members[k])
        strategies.append(strategy)
    return group, strategies, members


def test_overlap_local_sgd_drops_the_average_in_flight_at_a_crash_and_averages_the_survivors() -> (
    None
):
    group, strategies, members = _overlap_strategies(WORKERS)
    pulled: dict[int, list[float]] = {k: [] for k in range(WORKERS)}
    launched: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        rows = slice(k * 4, (k + 1) * 4)
        batches = [global_batch(s, WORKERS) for s in range(5)]
        closure = closure_for(strategy, [(x[rows], y[rows]) for x, y in batches])
        for t in range(1, 6):
            if t == 3:
                if k == 2:
                    return  # worker 2 crashes while the average of t = 2 is in flight
                group.enter(k, 1, (0, 1))
                members[k].current = Quorum((0, 1), 1)
            pulled[k].append(strategy.step(closure).extras.get("pulled", -1.0))
            if t == 4:
                launched[k] = flat_params(strategy.model)  # (what it launched at t = 4)
        strategy.finish_sync()

    _threads(work, WORKERS)
    # t = 2: the first boundary (no anchor); t = 4: the average in flight failed, no pull.
    assert pulled[0] == pulled[1] == [-1.0, 0.0, -1.0, 0.0, -1.0]
    z = (launched[0] + launched[1]) / 2  # the t = 4 average, over the two survivors
    for k in (0, 1):
        assert torch.allclose(strategies[k].buffer, z, atol=1e-7)


def test_overlap_local_sgd_heals_a_joiner_with_the_settled_anchor_and_a_members_model() -> None:
    group, strategies, members = _overlap_strategies(WORKERS)
    pulled: dict[int, float] = {}
    launched: dict[int, torch.Tensor] = {}
    healed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    start = threading.Barrier(WORKERS)

    def work(k: int) -> None:
        strategy = strategies[k]
        batches = [global_batch(s, WORKERS) for s in range(6)]
        closure = closure_for(
            strategy, [(x[k * 4 : k * 4 + 4], y[k * 4 : k * 4 + 4]) for x, y in batches]
        )
        if k < 2:  # (workers 0 and 1 train four steps; worker 2 is not yet a member)
            group.enter(k, 1, (0, 1))
            members[k].current = Quorum((0, 1), 1)
            for _ in range(4):
                strategy.step(closure)
            launched[k] = flat_params(strategy.model)
        start.wait()
        group.enter(k, 2, (0, 1, 2))
        members[k].current = Quorum((0, 1, 2), 2, joined=k == 2)
        strategy.heal(0, joining=k == 2)
        healed[k] = (flat_params(strategy.model), strategy.buffer.clone())
        for _ in range(2):
            stats = strategy.step(closure)
        pulled[k] = stats.extras["pulled"]

    _threads(work, WORKERS)
    z = (launched[0] + launched[1]) / 2
    assert torch.equal(healed[2][0], healed[0][0])  # the source's local model
    for k in range(WORKERS):
        assert torch.allclose(healed[k][1], z, atol=1e-7)
    assert torch.equal(healed[2][1], healed[0][1])
    assert pulled == {0: 1.0, 1: 1.0, 2: 1.0}  # every member, the joiner too, pulls toward z
    assert strategies[2].step_index == strategies[0].step_index == 6


def test_overlap_local_sgd_with_a_crash_and_a_join_replays_bit_for_bit(tmp_path: Path) -> None:
    trace = _trace(tmp_path, "step=2 worker=2 crash\nstep=4 worker=2 join\n")
    first = _run(_config("overlap_local_sgd", tmp_path / "a", trace))
    second = _run(_config("overlap_local_sgd", tmp_path / "b", trace))
    assert first[0] == second[0] and first[1]["faults"] == second[1]["faults"]
    for a, b in zip(first[2], second[2], strict=True):
        assert torch.equal(a, b)
    records = first[0]
    assert [r["extras"]["pulled"] for r in records if "pulled" in r["extras"]] == [0, 0, 1, 1]
    assert records[3]["clock_s"] >= records[1]["clock_s"] + DETECTION_S  # (detected at t = 4)


def test_streaming_diloco_with_a_crash_and_a_join_at_once_during_a_sync_heals_the_joiner(
    tmp_path: Path,
) -> None:
    # At loop step 5 worker 1 crashes while the sync launched at loop step 4 (over workers 0
    # and 1) flies, and worker 2 joins: the member drains it as failed, then heals.
    method = "streaming_diloco"
    trace = _trace(tmp_path, "step=2 worker=2 crash\nstep=5 worker=1 crash\nstep=5 worker=2 join\n")
    records, _, parameters = _run(_config(method, tmp_path / "out", trace), deployed=True)
    assert [r["quorum"] for r in records] == [3, 3, 2, 2, 2, 2, 2, 2]
    assert records[5]["clock_s"] >= records[4]["clock_s"] + DETECTION_S
    assert len(parameters) == 2 and torch.equal(parameters[0], parameters[1])


def test_cocodc_with_a_crash_in_flight_and_a_join_replays_bit_for_bit(tmp_path: Path) -> None:
    trace = _trace(tmp_path, "step=2 worker=2 crash\nstep=5 worker=1 crash\nstep=5 worker=2 join\n")
    first = _run(_config("cocodc", tmp_path / "a", trace), deployed=True)
    second = _run(_config("cocodc", tmp_path / "b", trace), deployed=True)
    assert first[0] == second[0] and first[1]["faults"] == second[1]["faults"]
    for a, b in zip(first[2], second[2], strict=True):
        assert torch.equal(a, b)
    records, _, parameters = first
    assert records[5]["clock_s"] >= records[4]["clock_s"] + DETECTION_S
    assert len(parameters) == 2 and torch.equal(parameters[0], parameters[1])


def test_cocodc_heals_a_joiner_after_the_members_finish_the_sync_in_flight(
    tmp_path: Path,
) -> None:
    # cocodc syncs every 2 steps from t = 2, each flying one step: at loop step 4 (t = 5) the
    # sync launched at t = 4 is in flight when worker 1 joins.
    trace = _trace(tmp_path, "step=1 worker=1 crash\nstep=4 worker=1 join\n")
    records, _, parameters = _run(_config("cocodc", tmp_path / "out", trace), deployed=True)
    assert [r["quorum"] for r in records] == [3, 2, 2, 2, 3, 3, 3, 3]
    assert len(parameters) == WORKERS
    assert all(torch.equal(parameters[0], p) for p in parameters[1:])


def test_cocodc_takes_no_outer_step_for_a_sync_that_lost_a_member_and_keeps_its_schedule() -> None:
    options = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1)
    group = InProcessGroup(2)
    members = [_Members(2) for _ in range(2)]
    strategies = []
    for k in range(2):
        strategy = CoCoDC(tiny_gpt(), group.comm(k), CONTEXT, options)
        strategy.runtime = replace(strategy.runtime, membership=members[k])
        strategies.append(strategy)
    before: dict[int, tuple[list[torch.Tensor], list[float], list[int]]] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        closure = closure_for(strategy, [global_batch(s, 1) for s in range(3)])
        strategy.step(closure)
        strategy.step(closure)  # t = 2: a fragment's sync launches
        assert len(strategy.in_flight) == 1
        before[k] = (
            [g.clone() for g in strategy.globals_],
            list(strategy.rates),
            list(strategy.last_sync_steps),
        )
        members[k].current = Quorum((k,), 1)  # (the other member is lost while it flies)
        strategy.step(closure)  # t = 3: it completes, failed

    _threads(work, 2)
    for k, strategy in enumerate(strategies):
        anchors, rates, last = before[k]
        assert all(torch.equal(a, g) for a, g in zip(anchors, strategy.globals_, strict=True))
        assert (strategy.rates, strategy.last_sync_steps) == (rates, last)
        assert not strategy.in_flight and strategy.outer_steps == 0


def test_sparta_diloco_detects_a_crash_at_its_step_and_syncs_over_the_survivors(
    tmp_path: Path,
) -> None:
    records, summary, parameters = _run(
        _config("sparta_diloco", tmp_path / "out", _trace(tmp_path, "step=2 worker=2 crash\n"))
    )
    assert [r["quorum"] for r in records] == [3, 3, 2, 2, 2, 2, 2, 2]
    assert not any("dropped" in r for r in records)
    # The crash step's sparse average waits until the crash is detected.
    assert records[2]["clock_s"] >= records[1]["clock_s"] + DETECTION_S
    assert torch.equal(parameters[0], parameters[1])  # (step 7 ends a round)
    # Tokens commit at the outer syncs (t = 2, 4, 6, 8): the crashed worker's t = 3 is lost.
    assert summary["committed_tokens"] == (3 * 2 + 2 * 6) * _tokens_per_step()


def test_streaming_diloco_without_overlap_commits_its_tokens_at_each_sync(tmp_path: Path) -> None:
    tau0 = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=0)
    summary = _run(
        _config("streaming_diloco", tmp_path / "out", _trace(tmp_path, "#\n"), diloco=tau0)
    )[1]
    assert summary["committed_tokens"] == WORKERS * 8 * _tokens_per_step()
