"""``lowcomm reproduce PAPER``: the CPU-scale experiments behind docs/ALGORITHMS.md §7.3.

For each paper (acco, co2, cocodc, eager, desloc, or all) the declared runs go through the
run-or-resume machinery of ``bench compare`` (re-running skips finished runs; an interrupted
reproduction resumes), then each prediction is judged by the two-standard-deviation rule and
``OUT/PAPER/report.md`` and ``OUT/PAPER/results.json`` are written (``OUT/summary.md`` for
``all``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from lowcomm.bench.runs import CHECKPOINTS_HELP, STUDY_CALIBRATION, CheckpointPolicy, final_loss
from lowcomm.faults.run import FaultFlags
from lowcomm.models import ModelConfig
from lowcomm.reproduce.papers import PAPERS, Paper
from lowcomm.reproduce.runner import Results, RunData, Scale, execute
from lowcomm.reproduce.stats import VERDICTS, Finding

_SMALL_MODEL = ModelConfig(n_layer=2, n_embd=64, n_head=2, block_size=32)

SCALES: dict[str, Scale] = {
    "quick": Scale(
        name="quick",
        steps=96,
        workers=2,
        model=_SMALL_MODEL,
        micro_batch_size=8,
        eval_every=8,
        eval_batches=4,
        co2_taus=(6, 12),
        diloco_sync=16,
        fragments=2,
        desloc_period=8,
        c4_steps=48,
        rosenbrock=(256, 4000),  # the paper's toy: cheap, so at every scale
        description=(
            "quick: 2 workers (4 for the ACCO straggler runs), 96 steps, a 2-layer d=64 GPT "
            "(about 0.23M parameters), context 32, 8 sequences per micro-batch"
        ),
    ),
    "full": Scale(
        name="full",
        steps=192,
        workers=4,
        model=_SMALL_MODEL,
        micro_batch_size=8,
        eval_every=16,
        eval_batches=8,
        co2_taus=(6, 12),
        diloco_sync=32,
        fragments=2,
        desloc_period=16,
        c4_steps=96,
        rosenbrock=(256, 4000),
        description=(
            "full: 4 workers, 192 steps, the quick scale's 2-layer d=64 GPT, context 32, 8 "
            "sequences per micro-batch, H and K doubled; sized from the quick scale's timings "
            "for about 30 minutes per paper with 3 seeds on 2 otherwise idle cores (an "
            "estimate; the ACCO straggler runs, which accumulate many micro-batches per step, "
            "take longest)"
        ),
    ),
}


@dataclass(kw_only=True)
class ReproduceConfig:
    """Run the CPU-scale experiments of one paper (or all) and judge docs/ALGORITHMS.md §7.3."""

    paper: Annotated[
        str,
        tyro.conf.Positional,
        tyro.conf.arg(metavar="PAPER", help="acco, co2, cocodc, eager, desloc or all."),
    ]

    out: str = "runs/reproduce"
    """Output directory: PAPER/report.md, PAPER/results.json (and summary.md for all)."""

    runs_dir: str | None = None
    """Where the training runs go (default: OUT/PAPER/runs); finished runs there are reused."""

    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds of every run (at least two for a verdict other than inconclusive)."""

    scale: str = "full"
    """quick (2 workers, 96 steps) or full (4 workers, 192 steps; about 30 min per paper)."""

    budget: Literal["tokens", "steps"] = "tokens"
    """tokens: a method with a variable number of micro-batches per step (acco, dpu, wp with
    no fixed count per phase) commits the tokens its fixed-count comparator commits in the
    run's steps (--token-budget), its schedule laid out over them. steps: every run takes
    its steps, whatever its tokens."""

    checkpoints: Annotated[CheckpointPolicy, tyro.conf.arg(help=CHECKPOINTS_HELP)] = "drop"

    calibration: str | None = None
    """The compute calibration every run on the calibrated model charges (a JSON file from an
    earlier study, or a path to write one to); default OUT/calibration.json. A missing file is
    measured once, before the first run, so every method of every paper is charged the same
    compute."""

    fault: Annotated[FaultFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=FaultFlags)
    """Declared faults for every training run (--faults FILE or the --fault-* options); the
    tables then give each run's goodput. A run whose method refuses faults is a failed run
    with its reason."""

    def __post_init__(self) -> None:
        choices = [*PAPERS, "all"]
        if self.paper not in choices:
            raise ValueError(
                f"PAPER: unknown paper {self.paper!r}; choose one of {', '.join(choices)}"
            )
        if self.scale not in SCALES:
            raise ValueError(
                f"--scale: unknown scale {self.scale!r}; choose one of {', '.join(SCALES)}"
            )
        if not self.seeds:
            raise ValueError("--seeds: no seed given; pass one or more, e.g. --seeds 0 1 2")
        if len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(
                f"--seeds: {' '.join(map(str, self.seeds))} must be distinct non-negative "
                f"integers; pass e.g. --seeds 0 1 2"
            )

    def calibration_file(self) -> tuple[Path, str]:
        """The study's calibration file and the option that names it."""
        if self.calibration is not None:
            return Path(self.calibration), "--calibration"
        return Path(self.out) / STUDY_CALIBRATION, "--out"

    def papers(self) -> list[str]:
        return list(PAPERS) if self.paper == "all" else [self.paper]

    def command(self) -> str:
        parts = ["lowcomm", "reproduce", self.paper, "--out", self.out]
        if self.runs_dir is not None:
            parts += ["--runs-dir", self.runs_dir]
        parts += ["--seeds", *map(str, self.seeds), "--scale", self.scale]
        if self.budget != "tokens":
            parts += ["--budget", self.budget]
        if self.calibration is not None:
            parts += ["--calibration", self.calibration]
        return shlex.join(parts + self.fault.flags())


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _finding_json(finding: Finding) -> dict[str, Any]:
    return {
        "id": finding.id,
        "claim": finding.claim,
        "measured": finding.measured,
        "verdict": finding.verdict,
        "links": [dataclasses.asdict(link) for link in finding.links],
        "note": finding.note,
    }


ROSE_LATE = 0.05
"""A run whose final validation loss is this fraction above its best evaluation rose late
(diverged or oscillated): the report counts such seeds per run."""


def _rose_late(curve: list[tuple[int, float, float]]) -> bool:
    best = min(loss for _, _, loss in curve)
    return bool(curve[-1][2] > (1.0 + ROSE_LATE) * best)


def _run_rose_late(run: RunData) -> bool:
    """Whether a run rose late; not one without a final loss (its curve ends on an earlier
    evaluation, which says nothing of how the run ended)."""
    return final_loss(run.summary) is not None and bool(run.curve) and _rose_late(run.curve)


def _run_rows(
    results: Results,
    budget: Literal["tokens", "steps"] = "tokens",
    faults: FaultFlags | None = None,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, runs in results.runs.items():
        spec = results.specs[label]
        if spec.kind == "rosenbrock":
            rows.append({"label": label, "seeds": [r.seed for r in runs], "command": spec.command(0),
                         "distances": [r.summary["distances"] for r in runs]})  # fmt: skip
            continue
        # (None for a seed whose final validation had no batch: left out of the mean and sd)
        every = [final_loss(r.summary) for r in runs]
        finals = [loss for loss in every if loss is not None]
        rows.append(
            {
                "label": label,
                "seeds": [r.seed for r in runs],
                "command": spec.command(runs[0].seed if runs else 0, budget, faults),
                "final_val_loss": every,
                "final_val_loss_mean": _finite(statistics.fmean(finals)) if finals else None,
                "final_val_loss_sd": statistics.stdev(finals) if len(finals) > 1 else None,
                "tokens": [_committed(r.summary) for r in runs],
                "modeled_time_s": [r.summary["modeled_time_s"] for r in runs],
                "utilization": [r.summary["utilization"] for r in runs],
                "bytes_sent_per_worker": [r.summary["bytes_sent_per_worker"] for r in runs],
                # (With faults: each seed's goodput, None where a run could not price one.)
                **(
                    {"goodput": [r.summary["faults"].get("goodput") for r in runs]}
                    if any("faults" in r.summary for r in runs)
                    else {}
                ),
                "val_curves": [r.curve for r in runs],
                "rose_late_seeds": sum(_run_rose_late(r) for r in runs),
            }
        )
    return rows


def reproduce_paper(paper: Paper, config: ReproduceConfig, scale: Scale) -> dict[str, Any]:
    """Run (or resume) one paper's runs, judge its predictions, write report.md and results.json."""
    out = Path(config.out) / paper.name
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(config.runs_dir) / paper.name if config.runs_dir else out / "runs"
    specs = paper.runs(scale)
    results, failures = execute(
        paper.name, specs, config.seeds, runs_dir, config.budget, config.checkpoints,
        calibration=config.calibration_file(), faults=config.fault,
    )  # fmt: skip
    findings = [prediction(results, scale) for prediction in paper.predictions]
    document = {
        "paper": paper.name,
        "title": paper.title,
        "command": config.command(),
        "scale": dataclasses.asdict(scale),
        "seeds": list(config.seeds),
        "setting": paper.setting(scale),
        "predictions": [_finding_json(f) for f in findings],
        "runs": _run_rows(results, config.budget, config.fault),
        "calibration": None if results.calibration is None else results.calibration.to_dict(),
        "calibration_note": None
        if results.calibration is None
        else results.calibration.describe("--calibration", out),
        "failures": failures,
    }
    from lowcomm.atomic import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(document, indent=2, default=str) + "\n")
    atomic_write_text(out / "report.md", _report(document))
    return document


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a literal | would end the cell."""
    return text.replace("|", "\\|")


def _report(doc: dict[str, Any]) -> str:
    lines = [*_report_header(doc), *_report_predictions(doc), *_report_runs(doc)]
    if doc["failures"]:
        lines += ["", "## Failed runs", ""] + [
            f"- {name}: {error}" for name, error in doc["failures"].items()
        ]
    return "\n".join(lines) + "\n"


def _report_header(doc: dict[str, Any]) -> list[str]:
    """The title, the scale's caveat, the command, the setting and how verdicts are read."""
    scale = doc["scale"]
    return [
        f"# Reproduction: {doc['title']}",
        "",
        f"Scale **{scale['name']}**: {scale['description']}. Seeds: {', '.join(map(str, doc['seeds']))}. "
        f"Virtual clock, network `wan`. This is far below the papers' scale and below the "
        f"testbed of docs/ALGORITHMS.md §7.2 (4 layers, d = 256, 2-4k steps): a sub-million-parameter "
        f"model trained for minutes of CPU, not billions of parameters and GPU-days. A verdict "
        f"here says what happens at this scale, not whether the paper is right.",
        "",
        "Command:",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"Setting: {doc['setting']}",
        "",
        *([doc["calibration_note"], ""] if doc.get("calibration_note") else []),
        "Verdicts follow docs/ALGORITHMS.md §7.2: an ordering holds only if the mean gap exceeds two "
        "seed standard deviations (the larger of the two groups' sample sd); reversed by more, "
        "it does not hold; otherwise it is inconclusive (within noise). A claim of several "
        "comparisons holds if all hold and does not hold if any does not. Hyperparameters are "
        "the same for every method and were not tuned to make a prediction hold.",
        "",
        "## Predictions",
        "",
    ]


def _report_predictions(doc: dict[str, Any]) -> list[str]:
    """The verdict of each prediction, then each one's claim, numbers and comparisons."""
    lines = [
        "| prediction | verdict |",
        "|---|---|",
        *[f"| {p['id']} | {p['verdict']} |" for p in doc["predictions"]],
        "",
    ]
    for p in doc["predictions"]:
        lines += [
            f"### {p['id']}: {p['verdict']}",
            "",
            f"**Claim.** {p['claim']}",
            "",
            "**Measured** (mean ± sd over seeds):",
            "",
        ]
        lines += [f"- {m}" for m in p["measured"]]
        lines += ["", "| comparison | verdict | numbers |", "|---|---|---|"]
        lines += [
            f"| {_cell(link['text'])} | {link['verdict']} | {_cell(link['detail'])} |"
            for link in p["links"]
        ]
        if p["note"]:
            lines += ["", p["note"]]
        lines.append("")
    return lines


def _report_runs(doc: dict[str, Any]) -> list[str]:
    """One row per run: loss over seeds, late rises, modeled time, bytes and its command."""
    faults = any("goodput" in row for row in doc["runs"])
    lines = [
        "## Runs",
        "",
        f"Rose late: seeds whose final validation loss ended more than {ROSE_LATE:.0%} above their best evaluation (a divergence or oscillation late in the run).",
        *(
            [
                "Goodput: committed tokens over the tokens the workers would have computed in "
                "the same modeled time without a fault (summary.json's faults.goodput), mean "
                "over seeds; n/a where a run could not price one."
            ]
            if faults
            else []
        ),
        "",
        "| run | seeds | final val loss | rose late | modeled time (s) | bytes/worker |"
        + (" goodput |" if faults else "")
        + " command (seed of the first run) |",
        "|---|---|---|---|---|---|---|" + ("---|" if faults else ""),
    ]
    for row in doc["runs"]:
        if "distances" in row:
            distances = "; ".join(
                ", ".join(f"{m} {d:.4f}" for m, d in seed.items()) for seed in row["distances"]
            )
            lines.append(
                f"| {row['label']} | {len(row['seeds'])} | distances to (1, 1) per seed: {distances} | | | |"
                + (" |" if faults else "")
                + f" `{row['command']}` |"
            )
            continue
        loss = _loss_cell(row)
        time = f"{statistics.fmean(row['modeled_time_s']):.2f}" if row["modeled_time_s"] else ""
        sent = (
            f"{statistics.fmean(row['bytes_sent_per_worker']) / 1e6:.2f} MB"
            if row["bytes_sent_per_worker"]
            else ""
        )
        lines.append(
            f"| {row['label']} | {len(row['seeds'])} | {loss} | {row['rose_late_seeds']} | {time} | {sent} |"
            + (f" {_goodput_cell(row.get('goodput'))} |" if faults else "")
            + f" `{row['command']}` |"
        )
    return lines


def _loss_cell(row: dict[str, Any]) -> str:
    """A run's final loss over the seeds whose final validation had a batch, saying how many
    had one where some had none."""
    mean, sd, every = row["final_val_loss_mean"], row["final_val_loss_sd"], row["final_val_loss"]
    measured = sum(loss is not None for loss in every)
    if not every:
        return "no finished run"
    if measured == 0:
        return "n/a (no final validation batch)"
    if mean is None:
        return "non-finite"
    text = f"{mean:.4f}" + ("" if sd is None else f" ± {sd:.4f}")
    return text if measured == len(every) else f"{text} ({measured} of {len(every)} seeds)"


def _committed(summary: dict[str, Any]) -> int:
    """A run's committed tokens (0 is a count: a run with faults may commit none), or its
    tokens where the summary predates the count."""
    committed = summary.get("committed_tokens")
    return int(summary["tokens"] if committed is None else committed)


def _goodput_cell(goodputs: list[float | None] | None) -> str:
    """A run's goodput over its seeds (n/a if a seed has none)."""
    if not goodputs or any(g is None for g in goodputs):
        return "n/a"
    return f"{statistics.fmean(g for g in goodputs if g is not None):.3f}"


def _summary(config: ReproduceConfig, documents: list[dict[str, Any]]) -> str:
    scale = SCALES[config.scale]
    counts = {verdict: 0 for verdict in VERDICTS}
    lines = [
        "# Reproduction summary",
        "",
        f"Scale **{scale.name}**: {scale.description}. Seeds: {', '.join(map(str, config.seeds))}. "
        "Each paper's report has the claims, the numbers and the table of runs.",
        "",
        "Command:",
        "",
        "```",
        config.command(),
        "```",
        "",
        "| prediction | verdict | measured | report |",
        "|---|---|---|---|",
    ]
    for doc in documents:
        for p in doc["predictions"]:
            counts[p["verdict"]] += 1
            measured = _cell("; ".join(p["measured"][:3]))
            lines.append(
                f"| {p['id']} | {p['verdict']} | {measured} | [{doc['paper']}]({doc['paper']}/report.md) |"
            )
    lines += [
        "",
        "Totals: " + ", ".join(f"{verdict}: {count}" for verdict, count in counts.items()),
        "",
    ]
    return "\n".join(lines)


def run_reproduce(config: ReproduceConfig) -> list[dict[str, Any]]:
    """Run every requested paper; for `all` also write OUT/summary.md."""
    scale = SCALES[config.scale]
    documents = []
    for name in config.papers():
        document = reproduce_paper(PAPERS[name], config, scale)
        documents.append(document)
        print(
            f"[reproduce] {name}: "
            + ", ".join(f"{p['id']} {p['verdict']}" for p in document["predictions"])
        )
    if config.paper == "all":
        from lowcomm.atomic import atomic_write_text

        atomic_write_text(Path(config.out) / "summary.md", _summary(config, documents))
    return documents


__all__ = ["PAPERS", "SCALES", "ReproduceConfig", "Scale", "run_reproduce"]
