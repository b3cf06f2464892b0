"""``lowcomm bench compare``: every method on one task, one network, one accounting.

Each (method, seed) run is an ordinary ``lowcomm train`` run in ``DIR/runs/<method>-s<seed>``
with the same model, data order, step budget and network; only the method differs. A run
whose ``summary.json`` exists (it is written atomically, last) is not run again, so an
interrupted sweep resumes where it stopped. The report aggregates over seeds:

* final validation loss, mean +- sample standard deviation;
* tokens processed;
* modeled time to a target validation loss (default: the median method's final mean, so about
  half the methods reach it) on the run's clock;
* utilisation, bytes per worker per step, state bytes per worker;
* with faults (``--faults FILE`` or the generated-trace ``--fault-*`` options, given to every
  run): goodput and rounds dropped (summary.json's ``faults``), every run replaying the same
  trace.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from lowcomm.atomic import atomic_write_text
from lowcomm.bench.figures import plot_all
from lowcomm.bench.runs import (
    CHECKPOINTS_HELP,
    STUDY_CALIBRATION,
    CheckpointPolicy,
    StudyCalibration,
    bytes_curve,
    final_loss,
    run_or_resume,
    study_calibration,
)
from lowcomm.bench.runs import mean_sd as _mean_sd
from lowcomm.bench.runs import val_curve as _val_curve
from lowcomm.bench.variants import Variant, parse_methods
from lowcomm.config import TrainConfig, option_value, with_options
from lowcomm.faults.run import FaultFlags, FaultSettings

#: The training options ``bench compare`` also takes at the top level (``--steps`` is
#: ``--train.run.steps``), with the bench's own defaults. Giving one both ways is refused.
SHARED_DEFAULTS: dict[str, Any] = {"network": "wan", "clock": "virtual", "steps": 60, "workers": 4}


def _bench_train_defaults() -> TrainConfig:
    return with_options(TrainConfig(), **SHARED_DEFAULTS)


@dataclass(kw_only=True)
class CompareBench:
    """Run several methods side by side and write a report."""

    methods: tuple[str, ...] = ("all",)
    """Methods to compare (space- or comma-separated), or `all` for every method of the
    library. A variant runs one method with other options under its own label:
    METHOD+TAG:KEY=VALUE[,KEY=VALUE], KEY a training option as after --train. (e.g.
    `diloco+muon:optim.name=muon`, `diloco+h64:diloco.sync-every=64,diloco.outer-lr=0.5`),
    so one method can appear twice."""

    network: str | None = None
    """Network preset for every run (default wan; the same option as --train.comm.network)."""

    clock: Literal["real", "virtual"] | None = None
    """Clock for every run (default virtual; the same option as --train.comm.clock)."""

    seeds: int = 1
    """Seeds per method (0, 1, ...)."""

    steps: int | None = None
    """Optimizer steps per run (default 60; the same option as --train.run.steps)."""

    workers: int | None = None
    """Workers per run (default 4; the same option as --train.placement.workers). With
    --train.ranks-per-worker R each worker is R processes."""

    out: str = "runs/compare"
    """Output directory: runs/, report.md, results.json and plots."""

    target_loss: float | None = None
    """Validation loss for the time-to-target column (default: the median method's final mean)."""

    budget: Literal["tokens", "steps"] | None = None
    """tokens (the default without faults): every run commits the tokens DDP commits in
    --steps steps (--train.token-budget set for every run; acco, dpu and wp, which take a
    variable number of micro-batches per step, end when they reach it, their schedule laid
    out over it; with faults, a run trains on past --steps, up to --max-steps, until it has
    committed them: a dropped round's tokens do not count). steps (the default with faults):
    every run takes --steps steps and commits what the faults leave."""

    max_steps: int | None = None
    """With --budget tokens and faults: the most steps a run may take to commit the budget
    (default 2 x --steps), its schedule laid out over them; a run that reaches it short of
    the budget says so in the report. Without faults every run's cap is --steps."""

    fault: Annotated[FaultFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=FaultFlags)
    """Declared faults for every run (--faults FILE or the --fault-* options)."""

    checkpoints: Annotated[CheckpointPolicy, tyro.conf.arg(help=CHECKPOINTS_HELP)] = "drop"

    train: TrainConfig = field(default_factory=_bench_train_defaults)
    """Every other training option, shared by all runs (`--train.model.n-layer 2`, ...)."""

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"--seeds: {self.seeds} must be >= 1")
        for name, default in SHARED_DEFAULTS.items():
            given = getattr(self, name)
            if given is None:
                continue
            under_train = option_value(self.train, name)
            if under_train not in (given, default):
                raise ValueError(
                    f"--{name}: given both as --{name} {given} and as --train.{name} "
                    f"{under_train}; they are one option, give it once"
                )
            # One place holds the value from here on: the training configuration.
            self.train = with_options(self.train, **{name: given})
        self.train = self.fault.merged(self.train)
        self._check_faults()
        if self.budget is None:
            self.budget = "steps" if self.has_faults else "tokens"
        if self.train.run.steps < 1:
            raise ValueError(f"--steps: {self.train.run.steps} must be >= 1")
        if self.max_steps is not None and not (self.budget == "tokens" and self.has_faults):
            raise ValueError(
                f"--max-steps: {self.max_steps} is for --budget tokens with faults (a run "
                f"without them takes --steps); drop it, or give --budget tokens and faults"
            )
        if self.max_steps is not None and self.max_steps < self.train.run.steps:
            raise ValueError(
                f"--max-steps: {self.max_steps} is below --steps {self.train.run.steps}; a "
                f"run with faults needs at least the fault-free run's steps to commit the "
                f"budget: give --max-steps {self.train.run.steps} or more"
            )
        if self.train.placement.workers < 1:
            raise ValueError(f"--workers: {self.train.placement.workers} must be >= 1")
        self.variants()  # a bad --methods entry is refused before any run

    def _check_faults(self) -> None:
        """A bad fault option or trace is refused once, in one line naming it, before any
        run (each run would otherwise fail with it, and the study end with no row)."""
        from lowcomm.faults.run import check_values, run_trace

        settings = FaultSettings.of(self.train.fault)
        problem = check_values(settings, self.train.placement.workers)
        if problem is not None:
            raise ValueError(problem)
        if not self.has_faults:
            return
        try:
            run_trace(self.train)
        except ValueError as error:
            if settings.path is None or str(error).startswith("--"):
                raise
            raise ValueError(f"--faults: {error}") from None

    @property
    def has_faults(self) -> bool:
        """Whether every run replays a fault trace (given here or under --train.)."""
        return FaultSettings.of(self.train.fault).enabled

    def variants(self) -> list[Variant]:
        """The methods and variants --methods names, in its order (sorted for ``all``)."""
        from lowcomm.strategies import STRATEGIES

        return parse_methods(self.methods, STRATEGIES)

    def method_names(self) -> list[str]:
        """The labels of :meth:`variants` (a plain method's label is its name)."""
        return [variant.label for variant in self.variants()]

    def run_config(self, method: str | Variant, seed: int) -> TrainConfig:
        """The declared run of ``method`` (a method name or a variant) with ``seed``: the
        shared training configuration with only the method (and a variant's options), the
        seed and the run directory set."""
        variant = method if isinstance(method, Variant) else Variant(method)
        return with_options(
            variant.apply(self.train),
            seed=seed,
            progress=False,
            out=str(Path(self.out) / "runs" / f"{variant.label}-s{seed}"),
            token_budget=self.token_budget(),
            steps=self.step_cap(),
        )

    def step_cap(self) -> int:
        """Each run's --steps: --steps, or with a token budget and faults --max-steps
        (default twice --steps): a faulty run's dropped rounds commit nothing, so it needs
        more steps than the fault-free run to commit the budget."""
        if self.budget == "tokens" and self.has_faults:
            return 2 * self.train.run.steps if self.max_steps is None else self.max_steps
        return self.train.run.steps

    def token_budget(self) -> int | None:
        """With --budget tokens: the tokens (summed over workers) DDP commits in --steps
        steps; None with --budget steps."""
        if self.budget == "steps":
            return None
        train = self.train
        per_step = (
            train.placement.workers
            * train.run.microbatches_per_step
            * train.tokens_per_microbatch()
        )
        return train.run.steps * per_step


def _time_to_target(curve: list[tuple[int, float, float]], target: float) -> float | None:
    for _, seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


def _fmt_loss(row: dict[str, Any]) -> str:
    """A row's final loss: mean ± sd over the seeds whose final validation had a batch, n/a
    where none had one."""
    mean, sd, missing = (
        row["final_val_loss_mean"],
        row["final_val_loss_sd"],
        row["final_val_loss_missing"],
    )
    if mean is None:
        return "n/a"
    text = f"{mean:.4f}" if sd is None else f"{mean:.4f} ± {sd:.4f}"
    return text if not missing else f"{text} ({row['seeds'] - missing} of {row['seeds']} seeds)"


def _finals(summaries: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean and sd of the final losses of the seeds that have one (NaN where none has)."""
    return _mean_sd([loss for s in summaries if (loss := final_loss(s)) is not None])


def _loss_order(item: tuple[str, dict[str, Any]]) -> tuple[bool, float]:
    """Best final loss first; rows without one last."""
    mean = item[1]["final_val_loss_mean"]
    return (mean is None, 0.0 if mean is None else mean)


def _fmt_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def _study_calibration(bench: CompareBench) -> StudyCalibration | None:
    """The study's one calibration (``--train.comm.calibration`` or OUT/calibration.json),
    measured before the first run if the file is missing."""
    from lowcomm.data import prepare_corpus

    corpus = prepare_corpus(bench.train.data)
    given = bench.train.comm.calibration
    return study_calibration(
        bench.train,
        Path(given) if given else Path(bench.out) / STUDY_CALIBRATION,
        vocab_size=corpus.vocab_size,
        option="--train.comm.calibration" if given else "--out",
        tag="compare",
    )


def _run_all(
    bench: CompareBench, variants: list[Variant], study: StudyCalibration | None
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Run (or resume) every (variant, seed); the finished runs' summaries by label, each
    with its validation curve and bytes curve, and the failures."""
    runs: dict[str, list[dict[str, Any]]] = {variant.label: [] for variant in variants}
    failures: dict[str, str] = {}
    for variant in variants:
        method = variant.label
        for seed in range(bench.seeds):
            config = bench.run_config(variant, seed)
            config = config if study is None else study.apply(config)
            run_dir = Path(str(config.run.out))
            error = run_or_resume(
                config, f"{method} seed {seed}", tag="compare", checkpoints=bench.checkpoints
            )
            if error is not None:
                failures[f"{method}-s{seed}"] = error
                continue
            summary = json.loads((run_dir / "summary.json").read_text())
            summary["curve"] = _val_curve(run_dir, summary)
            summary["bytes_curve"] = bytes_curve(run_dir, summary["curve"], summary)
            runs[method].append(summary)
    return runs, failures


def run_compare(bench: CompareBench) -> dict[str, Any]:
    """Run (or resume) the sweep, then write report.md, results.json and the plots."""
    variants = bench.variants()
    out = Path(bench.out)
    out.mkdir(parents=True, exist_ok=True)
    study = _study_calibration(bench)
    runs, failures = _run_all(bench, variants, study)
    finished = {method: summaries for method, summaries in runs.items() if summaries}
    finals = {m: _finals(ss) for m, ss in finished.items()}
    measured = [mean for mean, _ in finals.values() if not math.isnan(mean)]
    target = bench.target_loss
    if target is None and measured:
        # The median method's final loss: informative even when one method barely learns.
        target = statistics.median(measured)
    by_label = {variant.label: variant for variant in variants}
    rows = {
        method: _method_row(bench, by_label[method], summaries, finals[method], target)
        for method, summaries in finished.items()
    }
    results = {
        "network": bench.train.comm.network,
        "clock": bench.train.comm.clock,
        "steps": bench.train.run.steps,
        "budget": bench.budget,
        "token_budget": bench.token_budget(),
        "workers": bench.train.placement.workers,
        "ranks_per_worker": bench.train.placement.ranks_per_worker,
        "seeds": bench.seeds,
        "target_val_loss": target,
        "methods": rows,
        "failures": failures,
        "calibration": None if study is None else study.to_dict(),
        "train_config": bench.run_config(variants[0].method, 0).to_dict() if variants else {},
    }
    atomic_write_text(out / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    if finished:  # (every run failed: the report lists why, and there is nothing to plot)
        plot_all(out, finished, bench.train.comm.clock)
    report = _report(bench, rows, target, failures, study)
    atomic_write_text(out / "report.md", report)
    print(report)
    return results


def _method_row(
    bench: CompareBench,
    variant: Variant,
    summaries: list[dict[str, Any]],
    final: tuple[float, float],
    target: float | None,
) -> dict[str, Any]:
    """One method's row of results.json: its seeds' summaries averaged."""
    mean, sd = final
    times = [_time_to_target(s["curve"], target) for s in summaries] if target is not None else []
    reached = [t for t in times if t is not None]
    return {
        "method": variant.method,
        "options": dict(variant.options),
        "seeds": len(summaries),
        "final_val_loss_mean": None if math.isnan(mean) else mean,  # JSON has no NaN
        "final_val_loss_sd": None if math.isnan(sd) else sd,
        # (seeds whose final validation had no batch: left out of the mean)
        "final_val_loss_missing": sum(final_loss(s) is None for s in summaries),
        "tokens": statistics.fmean(
            s["tokens"] if s.get("committed_tokens") is None else s["committed_tokens"]
            for s in summaries
        ),
        "tokens_consumed": statistics.fmean(s["tokens"] for s in summaries),
        "steps": statistics.fmean(s["steps"] for s in summaries),
        "time_to_target_s": statistics.fmean(reached)
        if len(reached) == len(times) and reached
        else None,
        "modeled_time_s": statistics.fmean(s["modeled_time_s"] for s in summaries),
        "utilization": statistics.fmean(s["utilization"] for s in summaries),
        "bytes_per_worker_per_step": statistics.fmean(
            s["bytes_sent_per_worker"] / s["steps"] for s in summaries
        ),
        "state_bytes_per_worker": max(s["state_bytes_per_worker"] for s in summaries),
        **(_fault_columns(summaries) if bench.has_faults else {}),
        "runs": [
            str(Path(bench.run_config(variant, seed).run.out or ""))
            for seed in range(len(summaries))
        ],
    }


def _fault_columns(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's goodput (mean over seeds; None if a seed's run has none) and rounds dropped."""
    goodputs = [s.get("faults", {}).get("goodput") for s in summaries]
    known = [g for g in goodputs if g is not None]
    return {
        "goodput": statistics.fmean(known) if known and len(known) == len(goodputs) else None,
        "rounds_dropped": statistics.fmean(
            s.get("faults", {}).get("rounds_dropped", 0) for s in summaries
        ),
    }


def _fmt_goodput(row: dict[str, Any]) -> str:
    return "n/a" if row.get("goodput") is None else f"{row['goodput']:.3f}"


def _report(
    bench: CompareBench,
    rows: dict[str, dict[str, Any]],
    target: float | None,
    failures: dict[str, str],
    study: StudyCalibration | None = None,
) -> str:
    lines = _report_header(bench, target, study)
    for method, row in sorted(rows.items(), key=_loss_order):
        to_target = row["time_to_target_s"]
        lines.append(
            f"| {method} | {_fmt_loss(row)} | "
            f"{row['tokens']:,.0f} | {row['steps']:g} | {'not reached' if to_target is None else f'{to_target:.1f} s'} | "
            f"{row['modeled_time_s']:.1f} s | {row['utilization']:.1%} | "
            f"{_fmt_bytes(row['bytes_per_worker_per_step'])} | {_fmt_bytes(row['state_bytes_per_worker'])} |"
            + (f" {_fmt_goodput(row)} | {row['rounds_dropped']:g} |" if bench.has_faults else "")
        )
    lines += _short_of_budget(bench, rows) + _report_notes(bench) + _report_variants(bench, rows)
    if failures:
        lines += (
            ["## Failed runs", ""]
            + [f"- `{name}`: {error}" for name, error in failures.items()]
            + [""]
        )
    return "\n".join(lines)


def _report_header(
    bench: CompareBench, target: float | None, study: StudyCalibration | None
) -> list[str]:
    """The report's title, the sweep's setting and the results table's heading."""
    train = bench.train
    clock = train.comm.clock
    ranks = (
        f" of {train.placement.ranks_per_worker} ranks each"
        if train.placement.ranks_per_worker > 1
        else ""
    )
    budget = (
        f"a budget of {bench.token_budget():,} committed tokens (DDP's in {train.run.steps} steps "
        f"without a fault; at most {bench.step_cap()} steps)"
        if bench.budget == "tokens"
        else f"{train.run.steps} steps per run"
    )
    faults = bench.has_faults
    heading = (
        f"| method | final val loss | tokens | steps | time to val {target:.3f} ({clock}) | time ({clock}) | utilisation | bytes/worker/step | state bytes/worker |"
        if target is not None
        else "| method | final val loss | tokens | steps | time to target | time | utilisation | bytes/worker/step | state bytes/worker |"
    ) + (" goodput | rounds dropped |" if faults else "")
    return [
        f"# Method comparison on `{train.comm.network}`",
        "",
        f"{train.placement.workers} workers{ranks}, {budget}, {bench.seeds} seed(s), {clock} clock. "
        f"Same model, data order and budget for every method."
        + (f" Faults: {_describe_faults(train)}, the same for every run." if faults else ""),
        "",
        *(
            [study.describe("--train.comm.calibration", Path(bench.out)), ""]
            if study is not None
            else []
        ),
        heading,
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if faults else ""),
    ]


def _short_of_budget(bench: CompareBench, rows: dict[str, dict[str, Any]]) -> list[str]:
    """With a token budget and faults: the methods whose runs reached their step cap before
    committing the budget (their tokens are then not the others')."""
    budget = bench.token_budget()
    if budget is None or not bench.has_faults:
        return []
    short = [
        f"- {method}: {row['tokens']:,.0f} of {budget:,} tokens committed (mean over seeds) "
        f"in at most {bench.step_cap()} steps"
        for method, row in rows.items()
        if row["tokens"] < budget
    ]
    return (
        [
            "",
            "Short of the budget at the step cap (--max-steps), their faults dropped more:",
            *short,
        ]
        if short
        else []
    )


def _describe_faults(train: TrainConfig) -> str:
    """The runs' fault trace in a few words: its file, or its generated options."""
    settings = FaultSettings.of(train.fault)
    if settings.path is not None:
        trace = f"the trace `{settings.path}`"
    else:
        given = ", ".join(
            f"`{flag} {value}`"
            for flag, value in (
                ("--fault-mtbf-s", settings.mtbf_s),
                ("--fault-replace-after-s", settings.replace_after_s),
                ("--fault-slow-fraction", settings.slow_fraction),
                ("--fault-slow-factor", settings.slow_factor),
                ("--fault-seed", settings.seed),
            )
            if value is not None
        )
        trace = f"a generated trace ({given})"
    return f"{trace}, detection {settings.detection_s:g} s"


def _report_notes(bench: CompareBench) -> list[str]:
    """What the table's columns mean, then the figures."""
    return [
        "",
        "Loss: mean ± sample standard deviation over seeds (mean only for one seed). Tokens: "
        "committed (whose gradients reached an update), summed over workers. "
        + (
            "Every run commits the same tokens; ACCO, DPU and WP (a variable number of "
            "micro-batches per step) take fewer steps to get there, their schedule laid out "
            "over the budget, so the time to target is read on the same tokens. "
            if bench.budget == "tokens"
            else "Tokens differ where a method takes a variable number of micro-batches per step "
            "(ACCO, DPU, WP accumulate while they communicate): the budget is in steps. "
        )
        + (
            "Goodput: committed tokens over the tokens the workers would have computed in the "
            "same modeled time without a fault (summary.json's faults.goodput, mean over "
            "seeds; n/a where a run had no fault-free step to price one); rounds dropped: "
            "rounds whose collectives did not complete, so their tokens were not committed. "
            "A method that refuses faults is listed under the failed runs with its reason. "
            if bench.has_faults
            else ""
        )
        + "Time to target: first evaluation at or "
        "below the target validation loss, on the run's clock, averaged over seeds (reported only "
        "if every seed reached it).",
        "",
        "Which method wins on this link: final validation loss against modeled time and "
        "against bytes sent per worker, one point per method (mean, error bars one seed "
        "standard deviation, faint dots the seeds); ringed and joined, the Pareto front (no "
        "other method is both faster, or sends less, and ends lower).",
        "",
        "![final loss vs modeled time](final_loss_vs_time.png)",
        "",
        "![final loss vs bytes](final_loss_vs_bytes.png)",
        "",
        "Validation curves, one panel per family, ddp dashed in every panel as the reference:",
        "",
        "![validation loss vs time](val_loss_vs_time.png)",
        "",
        "![validation loss vs bytes](val_loss_vs_bytes.png)",
        "",
        "![validation loss vs step](val_loss_vs_step.png)",
        "",
        "![utilisation](utilization.png)",
        "",
    ]


def _report_variants(bench: CompareBench, rows: dict[str, dict[str, Any]]) -> list[str]:
    """The reported variants that set options, each with its settings (none: no lines)."""
    variants = [v for v in bench.variants() if v.options and v.label in rows]
    if not variants:
        return []
    return (
        ["Variants (the study's options, with these set):", ""]
        + [
            f"- `{v.label}`: {v.method} with "
            + ", ".join(f"`{key}={value}`" for key, value in v.options)
            for v in variants
        ]
        + [""]
    )
