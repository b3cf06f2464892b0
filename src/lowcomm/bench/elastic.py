"""``lowcomm bench elastic``: what a membership change costs, at CPU scale.

The DES-LOC rejoin experiment and its converse: per method and seed, an uninterrupted run on
``--workers`` M, a run that loses one worker at a third of its steps (stopped there with a
checkpoint and resumed on M - 1 with ``--resume DIR --workers M-1``), and a run that gains
one there (resumed on M + 1). Reported: the final validation loss (mean and sample standard
deviation over the seeds) and the modeled time on the virtual clock. Every run is the real
command, ``python -m lowcomm train``, as a user would run it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowcomm.atomic import atomic_write_text
from lowcomm.bench.runs import final_loss

#: The tiny model of the benchmark: one block, width 64, 32-token blocks, micro-batches of 4.
MODEL = [
    "--model.n-layer", "1", "--model.n-embd", "64", "--model.n-head", "2",
    "--model.block-size", "32", "--micro-batch-size", "4", "--eval-batches", "4",
    "--progress", "False", "--clock", "virtual", "--seconds-per-microbatch", "0.05",
    "--network", "wan",
]  # fmt: skip


@dataclass(kw_only=True)
class ElasticBench:
    """Final validation loss and modeled time when a worker is lost or added mid-run."""

    methods: tuple[str, ...] = ("ddp", "diloco", "desloc", "favg_opt")
    """Methods to run."""

    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds (one run of each scenario per seed)."""

    workers: int = 4
    """Workers M of the uninterrupted run; the others change to M - 1 and M + 1."""

    steps: int = 30
    """Optimizer steps per run; the change comes after a third of them."""

    sync_every: int = 5
    """The local methods' period (their group's --<group>.sync-every, or --desloc.param-period)."""

    out: str | None = None
    """Directory for the runs (default: a temporary one, deleted afterwards)."""

    json_out: str | None = None
    """Also write the results as JSON here."""


def _train(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lowcomm", "train", *args], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"lowcomm train {' '.join(args)} failed: {done.stderr.strip()[-800:]}")


def _summary(directory: Path) -> tuple[float | None, float]:
    """A run's final validation loss (None where its final validation had no batch) and
    modeled time."""
    summary = json.loads((directory / "summary.json").read_text())
    return final_loss(summary), float(summary["modeled_time_s"])


def _scenario(
    bench: ElasticBench, base: list[str], out: Path, change: int
) -> tuple[float | None, float]:
    """A run on M workers changed to M + ``change`` after a third of its steps."""
    if change == 0:
        _train(*base, "--workers", str(bench.workers), "--out", str(out))
        return _summary(out)
    third = bench.steps // 3
    _train(*base, "--workers", str(bench.workers), "--out", str(out), "--stop-after", str(third))
    _train("--resume", str(out), "--workers", str(bench.workers + change))
    return _summary(out)


def run_elastic(bench: ElasticBench) -> dict[str, Any]:
    """Run every method, seed and scenario; print the table; return the results."""
    scenarios = {"uninterrupted": 0, "lose one": -1, "add one": 1}
    results: dict[str, Any] = {"settings": {**bench.__dict__}, "runs": []}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(bench.out) if bench.out else Path(scratch)
        for method in bench.methods:
            for seed in bench.seeds:
                base = [
                    *MODEL, "--method", method, "--steps", str(bench.steps), "--seed", str(seed),
                    "--eval-every", str(bench.steps), "--overwrite", "True",
                    *_method_flags(method, bench.sync_every),
                ]  # fmt: skip
                for name, change in scenarios.items():
                    out = root / method / f"seed{seed}" / name.replace(" ", "-")
                    loss, modeled = _scenario(bench, base, out, change)
                    results["runs"].append({
                        "method": method, "seed": seed, "scenario": name,
                        "final_val_loss": loss, "modeled_time_s": modeled,
                    })  # fmt: skip
                    print(f"lowcomm bench elastic: {method} seed {seed} {name}: val loss "
                          f"{_loss_text(loss)}, modeled {modeled:.2f} s", flush=True)  # fmt: skip
    results["table"] = _table(results["runs"], bench.methods, list(scenarios))
    for line in _format(results["table"]):
        print(line)
    if bench.json_out:
        atomic_write_text(Path(bench.json_out), json.dumps(results, indent=2) + "\n")
    return results


def _method_flags(method: str, period: int) -> list[str]:
    """The flag that sets ``method``'s sync period, read from its declared options (its
    group's ``sync_every``, or DES-LOC's ``param_period``); none for a method without one."""
    import dataclasses

    from lowcomm.strategies import options_class, strategy_class

    cls = strategy_class(method)
    kind = options_class(cls)
    fields = set() if kind is None else {field.name for field in dataclasses.fields(kind)}
    for name in ("sync_every", "param_period"):
        if name in fields:
            return [f"--{cls.options_field}.{name.replace('_', '-')}", str(period)]
    return []


def _loss_text(loss: float | None) -> str:
    return "n/a (no final validation batch)" if loss is None else f"{loss:.4f}"


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _table(runs: list[dict[str, Any]], methods: tuple[str, ...], names: list[str]) -> list[Any]:
    rows = []
    for method in methods:
        for name in names:
            mine = [r for r in runs if r["method"] == method and r["scenario"] == name]
            # (the mean over the seeds whose final validation had a batch; None if none had)
            losses = [r["final_val_loss"] for r in mine if r["final_val_loss"] is not None]
            loss, loss_sd = _mean_sd(losses) if losses else (None, None)
            time, time_sd = _mean_sd([r["modeled_time_s"] for r in mine])
            rows.append({
                "method": method, "scenario": name, "val_loss_mean": loss, "val_loss_sd": loss_sd,
                "modeled_time_mean_s": time, "modeled_time_sd_s": time_sd, "seeds": len(mine),
                "val_loss_seeds": len(losses),
            })  # fmt: skip
    return rows


def _format(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| method | scenario | final val loss (mean ± sd) | modeled time (s) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['scenario']} | {_loss_cell(row)} | "
            f"{row['modeled_time_mean_s']:.2f} ± {row['modeled_time_sd_s']:.2f} |"
        )
    return lines


def _loss_cell(row: dict[str, Any]) -> str:
    """The final loss over the seeds that have one, how many where some have none; n/a with
    none."""
    if row["val_loss_mean"] is None:
        return "n/a (no final validation batch)"
    text = f"{row['val_loss_mean']:.4f} ± {row['val_loss_sd']:.4f}"
    seeds, measured = row["seeds"], row["val_loss_seeds"]
    return text if measured == seeds else f"{text} ({measured} of {seeds} seeds)"
