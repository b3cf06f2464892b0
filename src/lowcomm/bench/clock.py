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
time, transfers delayed to the emulated link) and once on the virtual clock (calibrated),
with ``--agreement-workers`` workers (at most the cores, so that the real clock measures
compute that does not wait for a core), and the modeled/measured ratio of the time per step
(goal: within 10% of 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lowcomm.atomic import atomic_write_text
from lowcomm.bench.runs import run_one
from lowcomm.config import TrainConfig

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

    agreement_workers: int = 2
    """Workers per agreement run (at most the machine's cores: see the module docstring)."""

    agreement_steps: int = 30
    """Steps per agreement run: enough that the real clock's one-time costs of the first
    steps (first-touch allocations, cold caches) weigh little in its time per step."""

    out: str = "runs/bench-clock"
    """Output directory: runs/, report.md and results.json."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Every other training option (`--train.model.n-layer 2`, ...)."""

    def __post_init__(self) -> None:
        for name in ("repeats", "steps", "workers", "agreement_workers", "agreement_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)} must be >= 1")
        if self.busy < 0:
            raise ValueError(f"--busy: {self.busy} must be >= 0")

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
            "eval_every": max(self.steps, self.train.eval_every),
        }  # fmt: skip
        settings.update(changes)
        return dataclasses.replace(self.train, **settings)


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
    summary: dict[str, Any] = json.loads((config.run_dir() / "summary.json").read_text())
    shutil.rmtree(config.run_dir() / "checkpoints", ignore_errors=True)
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
                    for model in MODELS:
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
    rows: dict[str, Any] = {}
    for method in [m.strip() for m in bench.agreement_methods.split(",") if m.strip()]:
        per_clock: dict[str, dict[str, Any]] = {}
        for clock in ("real", "virtual"):
            run_dir = out / "runs" / f"agree-{method}-{clock}"
            print(f"[bench clock] agreement {method} {clock}", file=sys.stderr)
            per_clock[clock] = _summary(
                bench.config(
                    method, "calibrated", run_dir, clock=clock, workers=bench.agreement_workers,
                    steps=bench.agreement_steps, eval_every=bench.agreement_steps,
                )
            )  # fmt: skip
        real, virtual = per_clock["real"], per_clock["virtual"]
        real_step = real["modeled_time_s"] / real["steps"]
        virtual_step = virtual["modeled_time_s"] / virtual["steps"]
        rows[method] = {
            "real_s_per_step": real_step,
            "virtual_s_per_step": virtual_step,
            "ratio": virtual_step / real_step,
            "real_utilization": real["utilization"],
            "virtual_utilization": virtual["utilization"],
        }
    return rows


def _cell(stats: dict[str, float], unit: str) -> str:
    if unit == "%":
        return f"{stats['mean']:.1%} ± {stats['sd']:.1%}"
    return f"{stats['mean']:.2f} ± {stats['sd']:.2f} s"


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
        for model in MODELS:
            quiet, loaded = cells[f"{method}/{model}/quiet"], cells[f"{method}/{model}/loaded"]
            qt, lt = quiet["modeled_time_s"], loaded["modeled_time_s"]
            qu, lu = quiet["utilization"], loaded["utilization"]
            lines.append(
                f"| {method} | {model} | {_cell(qt, 's')} | {_cell(lt, 's')} | "
                f"{lt['mean'] / qt['mean']:.3f} | {_cell(qu, '%')} | {_cell(lu, '%')} | "
                f"{lu['mean'] / qu['mean']:.3f} |"
            )
    if agreement:
        lines += [
            "",
            "## Real and virtual clock",
            "",
            f"{bench.agreement_workers} workers, {bench.network}, {bench.agreement_steps} steps; the virtual "
            "clock on the calibrated model. Time per step (the real clock's is measured wall "
            "time on the emulated link).",
            "",
            "| method | real s/step | virtual s/step | virtual/real | utilisation real | "
            "utilisation virtual |",
            "|---|---|---|---|---|---|",
        ]
        for method, row in agreement.items():
            lines.append(
                f"| {method} | {row['real_s_per_step']:.3f} | {row['virtual_s_per_step']:.3f} | "
                f"{row['ratio']:.3f} | {row['real_utilization']:.1%} | "
                f"{row['virtual_utilization']:.1%} |"
            )
    return "\n".join(lines) + "\n"


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
