"""``lowcomm bench clock``: does the virtual clock's answer depend on the machine's load, and
does it agree with the real clock?

Load: the same runs (by default ddp and co2, the default model, 4 workers, wan) ``--repeats``
times on the machine as it is ("quiet") and ``--repeats`` times with ``--busy`` extra busy
processes that the benchmark starts before and stops after them ("loaded"), quiet and loaded
blocks alternating, once on the
CPU-time compute model and once on the calibrated one (each calibrated run calibrates anew,
under the same load as its training). Per method and compute model it reports the modeled time
and utilisation, mean and spread, and the loaded/quiet ratio; the goal of the calibrated model
is a ratio within 3% of 1.

Agreement (``--agreement-methods``, empty to skip): each method once on the real clock (wall
time, transfers delayed to the emulated link) and once on the virtual clock per compute model
of ``--agreement-models`` (calibrated first), with ``--agreement-workers`` workers (at most
the cores, so that the real clock measures compute that does not wait for a core), and the
modeled/measured ratio of the time per step (goal: within 10% of 1). The ratio is split into
its parts, virtual/real compute and virtual/real exposed communication, so a disagreement
says where it lives: in the compute model (the calibrated cost against the passes the run
really took) or in the network and overlap model; the CPU-time model's ratio, which charges
the passes the virtual run really took, shows the second alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lowcomm.atomic import atomic_write_text
from lowcomm.bench.runs import drop_checkpoints, run_one
from lowcomm.config import TrainConfig, with_options
from lowcomm.train.rundir import run_directory

ComputeModel = Literal["cpu-time", "calibrated"]
MODELS: tuple[ComputeModel, ...] = ("cpu-time", "calibrated")


@dataclass(kw_only=True)
class ClockBench:
    """The virtual clock under load (CPU-time model against calibrated), and against the
    real clock."""

    methods: str = "ddp,co2"
    """Comma-separated methods of the load comparison."""

    repeats: int = 3
    """Runs per method, compute model and load."""

    models: str = "cpu-time,calibrated"
    """Compute models of the load comparison (comma-separated); `calibrated` alone measures
    the headline figure (the calibrated model's loaded/quiet modeled time) in half the time."""

    busy: int = 4
    """Extra busy processes (a Python spin loop each) during the loaded runs."""

    steps: int = 12
    """Steps per run."""

    workers: int = 4
    """Workers per run of the load comparison."""

    network: str = "wan"
    """Network preset of every run."""

    agreement_methods: str = "ddp,co2,acco,cocodc,streaming_diloco,eager"
    """Methods run on the real and on the virtual clock (ddp and the overlapped methods of
    the families); empty: skip the agreement."""

    agreement_models: str = "calibrated,cpu-time"
    """Compute models of the virtual agreement runs (comma-separated; the first is the one the
    headline ratio uses)."""

    agreement_workers: int = 2
    """Workers per agreement run (at most the machine's cores: see the module docstring)."""

    agreement_steps: int = 30
    """Steps per agreement run: enough that the real clock's one-time costs of the first
    steps (first-touch allocations, cold caches) weigh little in its time per step."""

    agreement_repeats: int = 1
    """Rounds of the agreement: every round runs every method's real and virtual runs once,
    so a drift of the host's speed falls on all methods alike; the report gives every
    round's virtual/real and the median round's parts."""

    out: str = "runs/bench-clock"
    """Output directory: runs/, report.md and results.json."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Every other training option (`--train.model.n-layer 2`, ...)."""

    def __post_init__(self) -> None:
        for name in (
            "repeats", "steps", "workers", "agreement_workers", "agreement_steps",
            "agreement_repeats",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)} must be >= 1")
        if self.busy < 0:
            raise ValueError(f"--busy: {self.busy} must be >= 0")
        load_models = self.load_model_list()
        if not load_models or any(m not in MODELS for m in load_models):
            raise ValueError(
                f"--models: {self.models!r} must name one or more of {', '.join(MODELS)}, "
                f"comma-separated (e.g. --models calibrated)"
            )
        models = self.agreement_model_list()
        unknown = [m for m in models if m not in MODELS]
        if unknown or (self.agreement_methods.strip() and not models):
            raise ValueError(
                f"--agreement-models: {self.agreement_models!r} must name one or more of "
                f"{', '.join(MODELS)}, comma-separated (e.g. --agreement-models calibrated)"
            )

    def load_model_list(self) -> list[ComputeModel]:
        """The compute models of the load comparison, in order, without repeats."""
        names = [m.strip() for m in self.models.split(",") if m.strip()]
        return list(dict.fromkeys(names))  # type: ignore[arg-type]

    def agreement_model_list(self) -> list[ComputeModel]:
        """The compute models of the virtual agreement runs, in order, without repeats."""
        names = [m.strip() for m in self.agreement_models.split(",") if m.strip()]
        return list(dict.fromkeys(names))  # type: ignore[arg-type]

    def command(self) -> str:
        """The command line of this benchmark (the options that differ from the defaults)."""
        defaults = ClockBench()
        parts = ["lowcomm", "bench", "clock"]
        for option in dataclasses.fields(ClockBench):
            value = getattr(self, option.name)
            if option.name != "train" and value != getattr(defaults, option.name):
                parts += [f"--{option.name.replace('_', '-')}", str(value)]
        return " ".join(parts)

    def config(self, method: str, model: ComputeModel, out: Path, **changes: Any) -> TrainConfig:
        settings: dict[str, Any] = {
            "method": method, "steps": self.steps, "workers": self.workers,
            "network": self.network, "clock": "virtual", "compute_model": model,
            "progress": False, "overwrite": True, "out": str(out),
            "eval_every": max(self.steps, self.train.run.eval_every),
        }  # fmt: skip
        settings.update(changes)
        return with_options(self.train, **settings)


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes spinning on a core each for the duration, stopped on exit."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in spinners:
            process.terminate()
        for process in spinners:
            process.wait(timeout=30)


def _summary(config: TrainConfig) -> dict[str, Any]:
    """Run ``config``; its summary. The run's checkpoint is deleted: the benchmark reads only
    the summary and metrics, and one benchmark's checkpoints took 12 GB."""
    error = run_one(config)
    if error is not None:
        raise RuntimeError(f"bench clock: {config.method} failed: {error}")
    summary: dict[str, Any] = json.loads((run_directory(config) / "summary.json").read_text())
    drop_checkpoints(run_directory(config))
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _load_runs(bench: ClockBench, out: Path) -> dict[str, Any]:
    """Every (method, model, load) cell: the runs' modeled times and utilisations.

    Quiet and loaded blocks alternate, one repeat of every cell per block, so a drift of the
    host's speed over the benchmark (a shared VM's speed moves by several percent over
    minutes) falls on both loads alike instead of posing as the load's effect."""
    runs: dict[str, list[dict[str, Any]]] = {}
    methods = [m.strip() for m in bench.methods.split(",") if m.strip()]
    for repeat in range(bench.repeats):
        for load in ("quiet", "loaded"):
            with busy_processes(bench.busy if load == "loaded" else 0):
                for method in methods:
                    for model in bench.load_model_list():
                        run_dir = out / "runs" / f"{method}-{model}-{load}-{repeat}"
                        print(f"[bench clock] {method} {model} {load} {repeat}", file=sys.stderr)
                        summary = _summary(bench.config(method, model, run_dir))
                        runs.setdefault(f"{method}/{model}/{load}", []).append(summary)
    cells: dict[str, Any] = {}
    for key, summaries in runs.items():
        times = [float(s["modeled_time_s"]) for s in summaries]
        utils = [float(s["utilization"]) for s in summaries]
        costs = [s["compute_model"].get("seconds_per_microbatch") for s in summaries]
        cells[key] = {
            "modeled_time_s": _stats(times), "utilization": _stats(utils),
            "times": times, "utilizations": utils, "seconds_per_microbatch": costs,
        }  # fmt: skip
    return cells


def _agreement(bench: ClockBench, out: Path) -> dict[str, Any]:
    """Every method's agreement row: with several rounds, the median round's row (by its
    virtual/real) with every round's ratio in ``ratio_rounds``."""
    models = bench.agreement_model_list()
    methods = [m.strip() for m in bench.agreement_methods.split(",") if m.strip()]
    rounds: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    for round_index in range(bench.agreement_repeats):
        suffix = f"-{round_index}" if bench.agreement_repeats > 1 else ""
        for method in methods:
            runs: dict[str, dict[str, Any]] = {}
            for clock, model in [("real", models[0]), *(("virtual", m) for m in models)]:
                name = "real" if clock == "real" else f"virtual-{model}"
                print(f"[bench clock] agreement {method} {name}{suffix}", file=sys.stderr)
                runs[name] = _summary(
                    bench.config(
                        method, model, out / "runs" / f"agree-{method}-{name}{suffix}",
                        clock=clock, workers=bench.agreement_workers,
                        steps=bench.agreement_steps, eval_every=bench.agreement_steps,
                    )
                )  # fmt: skip
            virtual: dict[str, dict[str, Any]] = {m: runs[f"virtual-{m}"] for m in models}
            rounds[method].append(agreement_row(runs["real"], virtual))
    rows: dict[str, Any] = {}
    for method, method_rounds in rounds.items():
        ordered = sorted(method_rounds, key=lambda row: float(row["ratio"]))
        rows[method] = {
            **ordered[(len(ordered) - 1) // 2],
            "ratio_rounds": [row["ratio"] for row in method_rounds],
        }
    return rows


#: A part of the time (compute, exposed communication) under this fraction of the real run's
#: time gets no ratio: "hidden" when it is under it on the virtual clock too.
HIDDEN = 0.01


def agreement_row(real: dict[str, Any], virtual: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One method's agreement from its real run's summary and its virtual runs' (by compute
    model, the headline one first): time per step, the ratio and its parts."""

    def per_step(summary: dict[str, Any]) -> float:
        return float(summary["modeled_time_s"]) / int(summary["steps"])

    def ratio(name: str, of: dict[str, Any]) -> float | None:
        """of's part over the real one's; None where the real part is under HIDDEN of the
        real time (a ratio of milliseconds says nothing)."""
        measured = float(real[name])
        if measured <= HIDDEN * float(real["modeled_time_s"]):
            return None
        return float(of[name]) / measured

    headline, first = next(iter(virtual.items()))
    return {
        "real_s_per_step": per_step(real),
        "virtual_s_per_step": per_step(first),
        "ratio": per_step(first) / per_step(real),
        "compute_model": headline,
        "compute_ratio": ratio("compute_s", first),
        "exposed_comm_ratio": ratio("exposed_comm_s", first),
        "exposed_comm_s": {"real": real["exposed_comm_s"], "virtual": first["exposed_comm_s"]},
        "virtual_time_s": first["modeled_time_s"],
        "ratios_by_model": {m: per_step(s) / per_step(real) for m, s in virtual.items()},
        "real_utilization": real["utilization"],
        "virtual_utilization": first["utilization"],
        # The share of the real run's compute its thread ran on a core (None: not measured),
        # and virtual/real with the real run's waits for a core taken out of its time.
        "real_on_core": real.get("compute_model", {}).get("on_core"),
        "ratio_on_core": _ratio_on_core(real, first),
        # The charged micro-batch cost against the passes the real run paid (wall, rank 0).
        "calibrated_microbatch_s": first.get("compute_model", {}).get("seconds_per_microbatch"),
        "real_microbatch_s": real.get("compute_model", {}).get("microbatch_wall_s"),
    }


def _ratio_on_core(real: dict[str, Any], virtual: dict[str, Any]) -> float | None:
    """Virtual over real time, the real time less the compute its thread spent waiting for a
    core (rank 0's share, off its own compute): what the real clock would have read had its
    compute never waited for one. None where the real run did not measure the share."""
    model = real.get("compute_model", {})
    if "waiting_s" not in model:
        return None
    waiting = float(model["waiting_s"])
    return float(virtual["modeled_time_s"]) / (float(real["modeled_time_s"]) - waiting)


def _cell(stats: dict[str, float], unit: str) -> str:
    if unit == "%":
        return f"{stats['mean']:.1%} ± {stats['sd']:.1%}"
    return f"{stats['mean']:.2f} ± {stats['sd']:.2f} s"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _exposed(row: dict[str, Any]) -> str:
    """The exposed-communication column: the ratio, or where the real clock hid it (under
    HIDDEN of its time), "hidden" or the virtual clock's seconds."""
    if row["exposed_comm_ratio"] is not None:
        return f"{row['exposed_comm_ratio']:.3f}"
    virtual_s = float(row["exposed_comm_s"]["virtual"])
    if virtual_s <= HIDDEN * float(row["virtual_time_s"]):
        return "hidden"
    return f"hidden on real, {virtual_s:.2f} s virtual"


def _report(bench: ClockBench, cells: dict[str, Any], agreement: dict[str, Any]) -> str:
    lines = [
        "# Virtual clock under load",
        "",
        f"`{bench.command()}`",
        "",
        f"{bench.workers} workers, {bench.network}, {bench.steps} steps, {bench.repeats} runs "
        f"per cell; loaded: {bench.busy} extra busy processes on {os.cpu_count()} cores. "
        "Mean ± sample standard deviation over the runs.",
        "",
        "| method | compute model | time quiet | time loaded | loaded/quiet | "
        "utilisation quiet | utilisation loaded | loaded/quiet |",
        "|---|---|---|---|---|---|---|---|",
    ]
    methods = sorted({key.split("/")[0] for key in cells}, key=bench.methods.find)
    for method in methods:
        for model in bench.load_model_list():
            quiet, loaded = cells[f"{method}/{model}/quiet"], cells[f"{method}/{model}/loaded"]
            qt, lt = quiet["modeled_time_s"], loaded["modeled_time_s"]
            qu, lu = quiet["utilization"], loaded["utilization"]
            lines.append(
                f"| {method} | {model} | {_cell(qt, 's')} | {_cell(lt, 's')} | "
                f"{lt['mean'] / qt['mean']:.3f} | {_cell(qu, '%')} | {_cell(lu, '%')} | "
                f"{lu['mean'] / qu['mean']:.3f} |"
            )
    lines += _headline(bench, cells, methods)
    if agreement:
        lines += _agreement_section(bench, agreement)
    return "\n".join(lines) + "\n"


def _agreement_section(bench: ClockBench, agreement: dict[str, Any]) -> list[str]:
    """The report's real-against-virtual clock section: a note and one row per method."""
    others = list(next(iter(agreement.values()))["ratios_by_model"])[1:]
    headline = next(iter(agreement.values()))["compute_model"]
    lines = [
        "",
        "## Real and virtual clock",
        "",
        f"{bench.agreement_workers} workers, {bench.network}, {bench.agreement_steps} steps"
        + (
            f", {bench.agreement_repeats} rounds (the median round's row)"
            if bench.agreement_repeats > 1
            else ""
        )
        + "; the virtual "
        f"clock on the {headline} model. Time per step (the real clock's is measured wall "
        "time on the emulated link); the ratio's parts: compute and exposed communication, "
        "virtual over real"
        + (f"; and the ratio on the {', '.join(others)} model." if others else ".")
        + " Real compute on a core: the share of the real run's compute its thread ran "
        "(the rest it waited for a core, taken by the run's other threads and processes: "
        "the transport, a communication chain, the other workers); virtual/real on a "
        "core: the ratio with that wait taken out of the real time.",
        "",
        "| method | real s/step | virtual s/step | virtual/real | compute | exposed comm | "
        + "".join(f"{m} virtual/real | " for m in others)
        + "real compute on a core | virtual/real on a core | utilisation real | "
        "utilisation virtual |"
        + (" virtual/real, every round |" if bench.agreement_repeats > 1 else ""),
        "|---|---|---|---|---|---|"
        + "---|" * len(others)
        + "---|---|---|---|"
        + ("---|" if bench.agreement_repeats > 1 else ""),
    ]
    for method, row in agreement.items():
        lines.append(
            f"| {method} | {row['real_s_per_step']:.3f} | {row['virtual_s_per_step']:.3f} | "
            f"{row['ratio']:.3f} | {_ratio(row['compute_ratio'])} | {_exposed(row)} | "
            + "".join(f"{row['ratios_by_model'][m]:.3f} | " for m in others)
            + f"{_share(row.get('real_on_core'))} | {_ratio(row.get('ratio_on_core'))} | "
            + f"{row['real_utilization']:.1%} | {row['virtual_utilization']:.1%} |"
            + (
                " " + ", ".join(f"{r:.3f}" for r in row["ratio_rounds"]) + " |"
                if bench.agreement_repeats > 1
                else ""
            )
        )
    lines += _passes_table(agreement, headline)
    return lines


def load_ratio(cells: dict[str, Any], method: str, model: str) -> float:
    """Loaded over quiet mean modeled time of one method on one compute model."""
    quiet = cells[f"{method}/{model}/quiet"]["modeled_time_s"]["mean"]
    return float(cells[f"{method}/{model}/loaded"]["modeled_time_s"]["mean"]) / float(quiet)


def _headline(bench: ClockBench, cells: dict[str, Any], methods: list[str]) -> list[str]:
    """The goal's figure: the calibrated model's loaded/quiet modeled time, per method."""
    if "calibrated" not in bench.load_model_list() or not methods:
        return []
    ratios = {method: load_ratio(cells, method, "calibrated") for method in methods}
    worst = max(abs(r - 1) for r in ratios.values())
    return [
        "",
        f"**Calibrated model, loaded/quiet modeled time over {bench.repeats} repetitions: "
        + ", ".join(f"{m} {r:.3f}" for m, r in ratios.items())
        + f"; largest gap {worst:.1%} (goal: within 3%, {'met' if worst <= 0.03 else 'NOT met'}).**",
    ]


def _passes_table(agreement: dict[str, Any], headline: str) -> list[str]:
    """The micro-batch cost the virtual clock charged against the passes the real run paid:
    where the compute part of the ratio comes from."""
    rows = [
        (method, row["calibrated_microbatch_s"], row["real_microbatch_s"])
        for method, row in agreement.items()
        if row.get("calibrated_microbatch_s") and row.get("real_microbatch_s")
    ]
    if not rows:
        return []
    lines = [
        "",
        f"Micro-batches: the cost the virtual clock charged ({headline} model) against the "
        "passes the real run paid (rank 0's wall time: least, median, mean).",
        "",
        "| method | charged | real least | real median | real mean | charged/real median |",
        "|---|---|---|---|---|---|",
    ]
    for method, charged, real in rows:
        lines.append(
            f"| {method} | {charged * 1e3:.1f} ms | {real['min'] * 1e3:.1f} ms | "
            f"{real['median'] * 1e3:.1f} ms | {real['mean'] * 1e3:.1f} ms | "
            f"{charged / real['median']:.3f} |"
        )
    return lines


def run_clock(bench: ClockBench) -> dict[str, Any]:
    """Run the load comparison and the agreement; write report.md and results.json."""
    out = Path(bench.out)
    out.mkdir(parents=True, exist_ok=True)
    from lowcomm.data import prepare_corpus

    prepare_corpus(bench.train.data)
    cells = _load_runs(bench, out)
    agreement = _agreement(bench, out)
    results = {"cells": cells, "agreement": agreement, "cores": os.cpu_count()}
    atomic_write_text(out / "results.json", json.dumps(results, indent=2) + "\n")
    report = _report(bench, cells, agreement)
    atomic_write_text(out / "report.md", report)
    print(report)
    return results
