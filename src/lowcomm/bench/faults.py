"""``lowcomm bench faults``: each method with and without one generated fault trace, M
simulated workers in one process, beside the planner's predicted goodput.

For each worker count M every method first trains without faults (``--workers-per-process
M``, the virtual clock, the declared compute cost ``--seconds-per-microbatch``). The trace is
then generated once per M from the fault options, the same for every method: unless given,
each worker's mean time between failures is set so that about ``--crash-fraction`` of the
workers crash within T (``1 - exp(-T / MTBF)``), T the longest fault-free run of that M times
``--fault-slow-factor`` (a run with a permanent straggler waits for it), and a
replacement joins ``--replace-fraction`` of that run's length after each crash; a
``--fault-slow-fraction`` of the slots run ``--fault-slow-factor`` times slower. Each method
then trains again on that trace. The report gives, per method and M: goodput (the run's
committed tokens per modeled second over the fault-free run's), rounds
dropped, the final train loss and modeled time of each run, the faulted run's loss at the
fault-free run's modeled time (equal modeled time), bytes sent per worker, and the
planner's goodput (:func:`lowcomm.plan.price_faults` given the run's own settings, its
parameters, tokens and modeled time as the horizon).

A method that refuses ``--faults`` (or that this lowcomm does not know) is reported as
refused with its one-line reason, never a crash of the benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowcomm.config import (
    CommConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
)
from lowcomm.faults.generate import TORCHFT_HEARTBEAT_TIMEOUT_S
from lowcomm.strategies import strategy_class

#: The methods the benchmark compares by default.
METHODS = ("ddp", "diloco", "streaming_diloco", "decoupled_diloco")


@dataclass(kw_only=True)
class FaultsBench:
    """Goodput, loss and bytes of each method with and without one generated fault trace,
    M workers in one process, beside the planner's goodput."""

    workers: tuple[int, ...] = (16, 64, 256)
    """Worker counts M (each run has all M workers as threads of one process)."""

    methods: tuple[str, ...] = METHODS
    """Methods to compare (one that refuses --faults is reported as refused)."""

    steps: int = 40
    """Training steps per run."""

    sync_every: int = 4
    """H of the DiLoCo family (--diloco.sync-every, --streaming-diloco.sync-every)."""

    network: str = "wan"
    """Network preset of every run (the virtual clock models it)."""

    seconds_per_microbatch: float = 2.0
    """Declared compute seconds per micro-batch (the virtual clock's cost model): a step of a
    larger model than the one trained, so that a run lasts long against the detection time."""

    n_layer: int = 1
    """Transformer blocks of the benchmark's model (small, so that 256 workers fit)."""

    n_embd: int = 32
    """Width of the benchmark's model."""

    block_size: int = 32
    """Sequence length of the benchmark's model."""

    micro_batch_size: int = 2
    """Sequences per micro-batch per worker."""

    crash_fraction: float = 0.1
    """About this fraction of the workers crashes during the run (sets the MTBF when
    --fault-mtbf-s is not given; the run's length is taken as the longest fault-free run's
    times --fault-slow-factor)."""

    replace_fraction: float = 0.25
    """A replacement joins this fraction of the fault-free run's modeled time after a crash
    (when --fault-replace-after-s is not given)."""

    fault_mtbf_s: float | None = None
    """Each worker's mean time between failures (None: from --crash-fraction)."""

    fault_replace_after_s: float | None = None
    """Seconds from a crash until a replacement joins (None: from --replace-fraction)."""

    fault_slow_fraction: float = 0.1
    """Fraction of the worker slots that are slow."""

    fault_slow_factor: float = 3.0
    """How many times longer a slow worker's compute takes."""

    fault_detection_s: float = TORCHFT_HEARTBEAT_TIMEOUT_S
    """Seconds until the survivors of a crash go on without it (torchft's heartbeat timeout)."""

    fault_seed: int = 0
    """Seed of the generated trace."""

    out: str = "runs/bench-faults"
    """Output directory: runs/, report.md and results.json."""


def _train_config(bench: FaultsBench, method: str, workers: int, out: Path) -> TrainConfig:
    from lowcomm.data import DataConfig
    from lowcomm.models import ModelConfig

    config = TrainConfig(
        method=method,
        model=ModelConfig(
            n_layer=bench.n_layer, n_head=2, n_embd=bench.n_embd, block_size=bench.block_size
        ),
        data=DataConfig(micro_batch_size=bench.micro_batch_size),
        placement=PlacementConfig(workers=workers, workers_per_process=workers),
        run=RunConfig(
            steps=bench.steps,
            eval_every=bench.steps,
            eval_batches=2,
            log_every=bench.steps,
            progress=False,
            plot=False,
            out=str(out),
        ),
        comm=CommConfig(
            network=bench.network,
            clock="virtual",
            seconds_per_microbatch=bench.seconds_per_microbatch,
        ),
    )
    for group in ("diloco", "decoupled"):
        options = getattr(config, group, None)
        if options is not None and hasattr(options, "sync_every"):
            setattr(config, group, dataclasses.replace(options, sync_every=bench.sync_every))
    # decoupled_diloco's fragments as training takes them (its default, capped at the model's
    # blocks), given explicitly so that the planner prices the same count (its own default is
    # uncapped). The diloco group cannot: diloco refuses a fragment count.
    decoupled = getattr(config, "decoupled", None)
    if decoupled is not None and decoupled.fragments is None:
        preferred = int(getattr(strategy_class("decoupled_diloco"), "default_fragments", 1))
        fragments = min(preferred, bench.n_layer)
        config.decoupled = dataclasses.replace(decoupled, fragments=fragments)  # type: ignore[attr-defined]
    return config


def _with_faults(config: TrainConfig, bench: FaultsBench, mtbf_s: float, replace_s: float) -> None:
    config.fault.fault_mtbf_s = mtbf_s
    config.fault.fault_replace_after_s = replace_s
    config.fault.fault_slow_fraction = bench.fault_slow_fraction
    config.fault.fault_slow_factor = bench.fault_slow_factor
    config.fault.fault_detection_s = bench.fault_detection_s
    config.fault.fault_seed = bench.fault_seed


def _refusal(config: TrainConfig) -> str | None:
    """The run's one-line refusal (an unknown method, or one that refuses --faults), or None."""
    try:
        config.validate()
    except ValueError as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None


def _run(config: TrainConfig) -> dict[str, Any] | str:
    """Train ``config`` from scratch; its summary and its records, or the error in one line."""
    from lowcomm.bench.runs import run_one

    out = Path(str(config.run.out))
    if out.exists():
        shutil.rmtree(out)
    error = run_one(config)
    if error is not None:
        return error.splitlines()[0]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary["_records"] = records
    return summary


def _loss_at(records: list[dict[str, Any]], time_s: float) -> float | None:
    """The train loss of the last step that ended by ``time_s`` (None: none did)."""
    before = [r for r in records if r["clock_s"] <= time_s + 1e-12]
    return float(before[-1]["train_loss"]) if before else None


def predicted_goodput(config: TrainConfig, summary: dict[str, Any]) -> float | None:
    """The planner's goodput for this run: its shared settings (the --fault-* options among
    them), its parameters, tokens and steps, its modeled time as the horizon."""
    from lowcomm.plan import make_plan, plan_for_run, price_faults

    assert config.comm.seconds_per_microbatch is not None
    plan = plan_for_run(
        config, params=str(summary["num_params"]), tokens=float(summary["tokens"]),
        steps=int(summary["steps"]),
        seconds_per_step=config.comm.seconds_per_microbatch * config.run.microbatches_per_step,
        horizon_s=float(summary["modeled_time_s"]),
    )  # fmt: skip
    try:
        return price_faults(plan, make_plan(plan)).goodput
    except ValueError:
        # The planner refuses the run's options as it reads them: the row then has no
        # prediction rather than the benchmark none at all.
        return None


def _row(
    method: str, workers: int, clean: dict[str, Any] | str, faulted: dict[str, Any] | str,
    predicted: float | None,
) -> dict[str, Any]:  # fmt: skip
    """One method's row: a run that could not start is a string, its one-line reason."""
    row: dict[str, Any] = {"method": method, "workers": workers}
    if isinstance(clean, str):
        row["refused"] = clean
        return row
    row.update(
        clean_loss=clean["final_train_loss"], clean_time_s=clean["modeled_time_s"],
        clean_bytes=clean["bytes_sent_per_worker"], clean_dir=clean["_dir"],
    )  # fmt: skip
    if isinstance(faulted, str):
        row["refused"] = faulted
        return row
    faults = faulted["faults"]
    # Goodput against the fault-free run: the committed tokens per modeled second of the run
    # with faults over those of the run without (its every step commits, on every worker).
    # The run's own summary estimates its fault-free step from its clean steps, and a trace
    # with permanent stragglers leaves it none (its goodput is then null).
    rate = faulted["committed_tokens"] / faulted["modeled_time_s"]
    free_rate = clean["committed_tokens"] / clean["modeled_time_s"]
    row.update(
        goodput=rate / free_rate, run_goodput=faults["goodput"], predicted_goodput=predicted,
        rounds_dropped=faults["rounds_dropped"],
        crashes=sum(
            1 for change in faults["membership_changes"] for event in change["events"]
            if event["kind"] == "crash"
        ),
        faults_loss=faulted["final_train_loss"], faults_time_s=faulted["modeled_time_s"],
        faults_loss_at_clean_time=_loss_at(faulted["_records"], clean["modeled_time_s"]),
        faults_bytes=faulted["bytes_sent_per_worker"], faults_dir=faulted["_dir"],
    )  # fmt: skip
    return row


def trace_timing(bench: FaultsBench, longest_s: float) -> tuple[float, float]:
    """The trace's MTBF per worker and replacement delay (seconds) for an M whose longest
    fault-free run took ``longest_s``: ``bench``'s own where given, else the MTBF that crashes
    about ``crash_fraction`` of the workers within that run behind a straggler, and a
    replacement ``replace_fraction`` of that run after each crash."""
    mtbf = bench.fault_mtbf_s
    if mtbf is None:
        # A run with a permanent straggler takes about slow_factor times as long (a
        # synchronous step, or a local round's sync, waits for it): the crashes are drawn
        # over that length.
        slowed = bench.fault_slow_factor if bench.fault_slow_fraction > 0 else 1.0
        mtbf = slowed * longest_s / -math.log1p(-bench.crash_fraction)
    replace = bench.fault_replace_after_s
    if replace is None:
        replace = bench.replace_fraction * longest_s
    return mtbf, replace


def run_workers(
    bench: FaultsBench, workers: int, root: Path
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every method at M = ``workers``: the rows and the trace's options."""
    configs = {
        m: _train_config(bench, m, workers, root / f"{m}-m{workers}-clean") for m in bench.methods
    }
    clean: dict[str, dict[str, Any] | str] = {}
    for method, config in configs.items():
        refusal = _refusal(config)
        if refusal is not None:
            clean[method] = refusal
            continue
        result = _run(config)
        if not isinstance(result, str):
            result["_dir"] = str(config.run.out)
        clean[method] = result
    longest = max(
        (r["modeled_time_s"] for r in clean.values() if not isinstance(r, str)), default=1.0
    )
    mtbf, replace = trace_timing(bench, longest)
    rows = []
    for method in bench.methods:
        faulted: dict[str, Any] | str
        predicted = None
        config = _train_config(bench, method, workers, root / f"{method}-m{workers}-faults")
        _with_faults(config, bench, mtbf, replace)
        refusal = _refusal(config)
        if refusal is not None:
            faulted = refusal
        elif isinstance(clean[method], str):
            faulted = "not run"
        else:
            result = _run(config)
            if not isinstance(result, str):
                result["_dir"] = str(config.run.out)
                predicted = predicted_goodput(config, result)
            faulted = result
        rows.append(_row(method, workers, clean[method], faulted, predicted))
        print(_format_row(rows[-1]), flush=True)
    return rows, {"mtbf_s": mtbf, "replace_after_s": replace, "fault_free_longest_s": longest}


HEADER = (
    "| M | method | goodput | planner | dropped | crashes | loss (no faults) | time (s) | "
    "loss (faults) | time (s) | loss at equal time | MB/worker (no faults) | MB/worker (faults) |"
)


def _format_row(row: dict[str, Any]) -> str:
    def cell(key: str, spec: str, scale: float = 1.0) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return format(value / scale if scale != 1.0 else value, spec)

    refused = "refused" in row
    cells = [
        "refused" if refused else cell("goodput", ".3f"), cell("predicted_goodput", ".3f"),
        cell("rounds_dropped", "d"), cell("crashes", "d"),
        cell("clean_loss", ".4f"), cell("clean_time_s", ".2f"),
        cell("faults_loss", ".4f"), cell("faults_time_s", ".2f"),
        cell("faults_loss_at_clean_time", ".4f"),
        cell("clean_bytes", ".2f", 1e6), cell("faults_bytes", ".2f", 1e6),
    ]  # fmt: skip
    return f"| {row['workers']} | {row['method']} | {' | '.join(cells)} |"


def report(rows: list[dict[str, Any]], traces: dict[int, dict[str, float]]) -> str:
    """The markdown table of ``rows``, with each M's trace options."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines.extend(_format_row(row) for row in rows)
    lines.append("")
    for row in rows:
        if "refused" in row:
            lines.append(f"- {row['method']} (M = {row['workers']}) refused: {row['refused']}")
    for workers, trace in traces.items():
        lines.append(
            f"- M = {workers}: MTBF {trace['mtbf_s']:.1f} s per worker, replacement after "
            f"{trace['replace_after_s']:.1f} s (longest fault-free run "
            f"{trace['fault_free_longest_s']:.2f} s)"
        )
    return "\n".join(lines) + "\n"


def run_faults(bench: FaultsBench) -> list[dict[str, Any]]:
    """Run the benchmark; print the table and write OUT/report.md and OUT/results.json."""
    out = Path(bench.out)
    root = out / "runs"
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    traces: dict[int, dict[str, float]] = {}
    print(HEADER, flush=True)
    for workers in bench.workers:
        found, traces[workers] = run_workers(bench, workers, root)
        rows.extend(found)
    text = report(rows, traces)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {"bench": dataclasses.asdict(bench), "traces": {str(k): v for k, v in traces.items()},
             "rows": rows},
            indent=2,
        )
    )  # fmt: skip
    print(text, flush=True)
    return rows
