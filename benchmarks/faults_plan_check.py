"""The planner's goodput against simulated runs with faults (the goal: within 10% at
M = 16-256).

For each run directory (a `lowcomm train` run with a generated fault trace, its
``summary.json`` holding the measured ``goodput``), the planner is given the run's own
settings: its ``config.json`` (method and its options, workers, links, dtypes and the
``--fault-*`` options, which `train` and `plan` name alike), the parameters, tokens and steps
of its ``summary.json``, its modeled time as the horizon T (``--fault-horizon-s``), and one
worker's compute per step (``--seconds-per-microbatch`` times ``--microbatches-per-step``
of a run on the declared clock, or this script's ``--seconds-per-step``). Printed per run:
the measured goodput, the planner's, and their ratio; the exit status is 1 when a ratio
lies outside 1 +- ``--tolerance``.

    python benchmarks/faults_plan_check.py runs/faults/ddp-m16 runs/faults/diloco-m16 ...
    python benchmarks/faults_plan_check.py runs/faults/* --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from lowcomm.config import TrainConfig, option_names, option_value
from lowcomm.plan import PlanConfig, make_plan, price_faults


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
    shared = {f.name for f in dataclasses.fields(PlanConfig)} & option_names()
    steps = int(summary["steps"])
    tokens = float(summary.get("tokens") or summary.get("samples") or 0.0)
    if steps < 1 or not tokens > 0:
        raise RunError(f"{summary_path}: steps={steps}, tokens={tokens}; the run trained nothing")
    return PlanConfig(
        **{name: option_value(train, name) for name in shared},
        params=str(summary["num_params"]),
        tokens=tokens,
        tokens_per_step=tokens / steps,
        seconds_per_step=seconds_per_step,
        fault_horizon_s=float(summary["modeled_time_s"]),
    )


def check_run(run: Path, *, seconds_per_step: float | None = None) -> dict[str, Any]:
    """The run's measured goodput, the planner's, and their ratio."""
    config = plan_for_run(run, seconds_per_step=seconds_per_step)
    summary = json.loads((run / "summary.json").read_text())
    goodput = (summary.get("faults") or {}).get("goodput")
    if goodput is None:
        raise RunError(
            f"{run / 'summary.json'}: no faults.goodput; the run had no fault options, had no "
            "fault-free step to price its goodput by, or comes from a lowcomm that does not "
            "report it"
        )
    priced = price_faults(config, make_plan(config))
    measured = float(goodput)
    predicted = priced.goodput
    ratio = math.nan if not predicted else measured / predicted
    return {
        "run": str(run),
        "method": config.method,
        "workers": config.workers,
        "family": priced.family,
        "measured": measured,
        "predicted": predicted,
        "ratio": ratio,
        "horizon_s": priced.horizon_s,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument(
        "--seconds-per-step",
        type=float,
        default=None,
        help="one worker's compute per step (default: the run's declared clock)",
    )
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed |ratio - 1|")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows: list[dict[str, Any]] = []
    for run in args.runs:
        try:
            rows.append(check_run(run, seconds_per_step=args.seconds_per_step))
        except (RunError, ValueError, KeyError) as error:
            print(f"faults_plan_check: {run}: {error}", file=sys.stderr)
            return 2
    outside = [
        row
        for row in rows
        if row["predicted"] is None or not abs(row["ratio"] - 1.0) <= args.tolerance
    ]
    if args.json:
        for row in rows:
            print(json.dumps({**row, "within": row not in outside}))
    else:
        print(f"{'run':40} {'method':18} {'M':>6} {'measured':>9} {'planned':>9} {'ratio':>7}")
        for row in rows:
            planned = "n/a" if row["predicted"] is None else f"{row['predicted']:.3f}"
            mark = "" if row not in outside else "  outside"
            print(
                f"{row['run'][-40:]:40} {row['method']:18} {row['workers']:>6} "
                f"{row['measured']:>9.3f} {planned:>9} {row['ratio']:>7.3f}{mark}"
            )
        print(f"{len(rows) - len(outside)} of {len(rows)} within {args.tolerance:.0%}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
