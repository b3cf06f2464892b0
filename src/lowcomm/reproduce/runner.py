"""Scales, declared runs, and running (or resuming) them.

A paper's experiment is a list of :class:`RunSpec`: a label and the typed configuration of one
run (a :class:`TrainConfig`; the seed and output directory are set per seed). Each run goes
through the same run-or-resume machinery as ``lowcomm bench compare``, and so the one launch
path: a finished run (its ``summary.json`` exists) is not run again, and one of a different
configuration is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tyro

from lowcomm.bench.runs import (
    CheckpointPolicy,
    StudyCalibration,
    final_loss,
    run_or_resume,
    study_calibration,
    val_curve,
)
from lowcomm.config import (
    FLAT_COMPONENTS,
    CommConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
)
from lowcomm.data import DataConfig
from lowcomm.faults.run import FaultFlags
from lowcomm.models import ModelConfig
from lowcomm.reproduce.stats import Stat


@dataclass(frozen=True)
class Scale:
    """How large the reproduction runs are. Every paper derives its runs from one scale."""

    name: str
    steps: int
    """Optimizer steps per run (a multiple of every period used below)."""
    workers: int
    """Workers per run (the ACCO straggler runs always use 4)."""
    model: ModelConfig
    micro_batch_size: int
    eval_every: int
    eval_batches: int
    co2_taus: tuple[int, int]
    """CO2's two sync periods tau (the paper's 6 and 12)."""
    diloco_sync: int
    """H of CoCoDC and the middle H of the eager runs (which also use H/2 and 2H)."""
    fragments: int
    """Streaming/CoCoDC fragments K (at most the number of layers)."""
    desloc_period: int
    """DES-LOC K_x (K for Local Adam and FedAvg)."""
    c4_steps: int
    """Steps of the overlap-ratio runs (C4), a multiple of 16."""
    rosenbrock: tuple[int, int]
    """Workers and steps of the Rosenbrock toy (F5)."""
    description: str
    """One line for the report: what this scale is and how long it takes."""

    def common(self, *, workers: int | None = None, steps: int | None = None) -> TrainConfig:
        """The configuration every run of this scale starts from (the method is set per run)."""
        return TrainConfig(
            model=dataclasses.replace(self.model),
            data=DataConfig(micro_batch_size=self.micro_batch_size),
            placement=PlacementConfig(workers=workers or self.workers),
            run=RunConfig(
                steps=steps or self.steps,
                eval_every=self.eval_every,
                eval_batches=self.eval_batches,
            ),
            comm=CommConfig(network="wan", clock="virtual"),
        )


@dataclass(frozen=True)
class RosenbrockRun:
    """A run of the Rosenbrock example (``examples/rosenbrock_desloc.py``, F5)."""

    workers: int
    steps: int

    def args(self, seed: int) -> list[str]:
        return ["--workers", str(self.workers), "--steps", str(self.steps), "--seed", str(seed)]


@dataclass(frozen=True)
class RunSpec:
    """One declared run: a label and its configuration (without seed and output directory)."""

    label: str
    run: TrainConfig | RosenbrockRun
    first_seed_only: bool = False
    """Deterministic runs (declared compute cost) need one seed only."""

    @property
    def kind(self) -> Literal["train", "rosenbrock"]:
        return "rosenbrock" if isinstance(self.run, RosenbrockRun) else "train"

    def train_config(
        self,
        seed: int,
        run_dir: Path,
        budget: Literal["tokens", "steps"] = "tokens",
        faults: FaultFlags | None = None,
    ) -> TrainConfig:
        """The run of ``seed`` into ``run_dir`` (``budget``: see :func:`equal_tokens`;
        ``faults``: the study's fault options, which every run replays)."""
        run = self._declared(budget, faults)
        return dataclasses.replace(
            run,
            run=dataclasses.replace(run.run, seed=seed, out=str(run_dir), progress=False),
        )

    def command(
        self, seed: int, budget: Literal["tokens", "steps"] = "tokens",
        faults: FaultFlags | None = None,
    ) -> str:  # fmt: skip
        if isinstance(self.run, RosenbrockRun):
            return f"python examples/rosenbrock_desloc.py {' '.join(self.run.args(seed))}"
        run = self._declared(budget, faults)
        return f"lowcomm train {' '.join(train_flags(run))} --seed {seed}"

    def _declared(
        self, budget: Literal["tokens", "steps"], faults: FaultFlags | None
    ) -> TrainConfig:
        assert isinstance(self.run, TrainConfig), self.label
        run = equal_tokens(self.run) if budget == "tokens" else self.run
        return run if faults is None else faults.merged(run)


def equal_tokens(config: TrainConfig) -> TrainConfig:
    """``config`` at equal tokens: a method with a variable number of micro-batches per step
    gets the token budget a fixed-count method commits in ``config.steps`` steps (its
    schedule laid out over it); any other run is returned unchanged."""
    from lowcomm.strategies import method_options, strategy_class

    cls = strategy_class(config.method)
    variable = cls.takes_variable_microbatches(method_options(cls, config))
    if not variable or config.run.token_budget is not None:
        return config
    per_step = (
        config.placement.workers * config.run.microbatches_per_step * config.tokens_per_microbatch()
    )
    return dataclasses.replace(
        config,
        run=dataclasses.replace(config.run, token_budget=config.run.steps * per_step),
    )


def train_flags(config: TrainConfig) -> list[str]:
    """The ``lowcomm train`` options that give ``config`` (its settings that differ from the
    defaults; the method first), for a report to show the command of a run."""
    flags = ["--method", config.method]
    _differing_flags(config, TrainConfig(), "", flags)
    return flags


def _differing_flags(value: Any, default: Any, prefix: str, flags: list[str]) -> None:
    for field in dataclasses.fields(value):
        mine, theirs = getattr(value, field.name), getattr(default, field.name)
        if field.name == "method" or mine == theirs:
            continue
        if dataclasses.is_dataclass(mine):
            # The data options are spelled without their prefix (--micro-batch-size), the
            # flat components' without theirs (--workers).
            if field.name == "data":
                inner = ""
            elif field.name in FLAT_COMPONENTS and not prefix:
                inner = prefix
            else:
                inner = f"{prefix}{field.name.replace('_', '-')}."
            _differing_flags(mine, theirs, inner, flags)
            continue
        words = [str(item) for item in mine] if isinstance(mine, tuple) else [str(mine)]
        flags += [f"--{prefix}{field.name.replace('_', '-')}", *words]


@dataclass
class RunData:
    """A finished run: its summary, metrics records and validation curve."""

    label: str
    seed: int
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    curve: list[tuple[int, float, float]]


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def parse_train_flags(flags: list[str]) -> TrainConfig:
    """The configuration ``lowcomm train FLAGS`` would run."""
    return tyro.cli(TrainConfig, args=flags, config=(tyro.conf.FlagConversionOff,))


class Results:
    """Finished runs by label, one per seed, with accessors that return :class:`Stat`."""

    def __init__(self, runs: dict[str, list[RunData]], specs: list[RunSpec] | None = None) -> None:
        self.runs = runs
        self.specs = {spec.label: spec for spec in specs or []}
        self.calibration: StudyCalibration | None = None
        """The study's one compute calibration, if its runs charge one."""

    def of(self, label: str) -> list[RunData]:
        return self.runs.get(label, [])

    def per_seed(self, label: str, function: Callable[[RunData], float], name: str) -> Stat:
        return Stat(name, tuple(function(run) for run in self.of(label)))

    def final(self, label: str, name: str | None = None) -> Stat:
        """The final validation loss per seed; NaN for a seed whose final validation had no
        batch (summary.json's null), which a comparison then reports as not measured."""

        def loss(run: RunData) -> float:
            value = final_loss(run.summary)
            return math.nan if value is None else value

        return self.per_seed(label, loss, name or label)

    def summary(self, label: str, key: str, name: str | None = None) -> Stat:
        return self.per_seed(label, lambda run: float(run.summary[key]), name or f"{label} {key}")

    def val_at(self, label: str, step: int, name: str | None = None) -> Stat:
        """Validation loss at the evaluation nearest ``step``."""

        def nearest(run: RunData) -> float:
            if not run.curve:  # (no validation of the run had a batch)
                return math.nan
            return min(run.curve, key=lambda point: abs(point[0] - step))[2]

        return self.per_seed(label, nearest, name or f"{label} @ step {step}")

    def extras(self, label: str, key: str) -> list[list[float]]:
        """Per seed, the values of one strategy extra over the steps that report it."""
        return [
            [float(r["extras"][key]) for r in run.records if key in r.get("extras", {})]
            for run in self.of(label)
        ]


def steps_to_target(curve: list[tuple[int, float, float]], target: float, censored: int) -> float:
    """First evaluation step at or below ``target``; ``censored`` if never reached."""
    for step, _, loss in curve:
        if loss <= target:
            return float(step)
    return float(censored)


def loss_at_time(curve: list[tuple[int, float, float]], seconds: float) -> float:
    """Validation loss at ``seconds`` on the run's clock, linear between evaluations."""
    points = sorted((t, loss) for _, t, loss in curve)
    if not points or math.isnan(seconds):  # (no validation of the run had a batch)
        return math.nan
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if t0 <= seconds <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (seconds - t0) / (t1 - t0)
    return points[-1][1]


def _load(run_dir: Path, label: str, seed: int) -> RunData:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return RunData(label, seed, summary, records, val_curve(run_dir, summary))


_DISTANCE = re.compile(
    r"^(\w+)\s+x = \(([-+.\deE]+|nan), ([-+.\deE]+|nan)\)\s+distance to \(1, 1\) (\S+)"
)


def rosenbrock_script() -> Path:
    """The Rosenbrock example of the source tree (F5); absent in a plain installation."""
    return Path(__file__).resolve().parents[3] / "examples" / "rosenbrock_desloc.py"


def _rosenbrock(spec: RunSpec, seed: int, run_dir: Path, tag: str) -> str | None:
    assert isinstance(spec.run, RosenbrockRun)
    args = spec.run.args(seed)
    result_path = run_dir / "result.json"
    if result_path.exists():
        previous = json.loads(result_path.read_text())
        if previous["args"] == args:
            print(f"[reproduce] {tag}: done before, skipped", file=sys.stderr)
            return None
        raise ValueError(
            f"--runs-dir: {run_dir} holds a finished run with different arguments; pass another "
            f"--runs-dir (or move that directory away) to keep both"
        )
    script = rosenbrock_script()
    if not script.exists():
        return f"{script} not found (the Rosenbrock example ships with the source tree only)"
    print(f"[reproduce] {tag}: running", file=sys.stderr)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    if done.returncode != 0:
        return f"rosenbrock example failed: {done.stderr.strip().splitlines()[-1:]}"
    distances = {}
    for line in done.stdout.splitlines():
        match = _DISTANCE.match(line.strip())
        if match:
            distances[match.group(1)] = float(match.group(4))
    run_dir.mkdir(parents=True, exist_ok=True)
    from lowcomm.atomic import atomic_write_text

    atomic_write_text(
        result_path, json.dumps({"args": args, "distances": distances}, indent=2) + "\n"
    )
    return None


def execute(
    paper: str,
    specs: list[RunSpec],
    seeds: tuple[int, ...],
    runs_dir: Path,
    budget: Literal["tokens", "steps"] = "tokens",
    checkpoints: CheckpointPolicy = "drop",
    calibration: tuple[Path, str] | None = None,
    faults: FaultFlags | None = None,
) -> tuple[Results, dict[str, str]]:
    """Run (or resume) every declared run; return the finished ones and the failures
    (``budget``: equal tokens or equal steps, see :func:`equal_tokens`; ``checkpoints``: a
    finished run's, see :func:`lowcomm.bench.runs.run_or_resume`; ``calibration``: the
    study's calibration file and the option that names it, measured before the first run
    if missing and charged by every run on the calibrated compute model, see
    :func:`lowcomm.bench.runs.study_calibration`; ``faults``: the study's fault options,
    given to every training run)."""
    runs: dict[str, list[RunData]] = {spec.label: [] for spec in specs}
    failures: dict[str, str] = {}
    study = _prepare([spec for spec in specs if spec.kind == "train"], seeds, runs_dir, calibration)
    for spec in specs:
        for seed in seeds[:1] if spec.first_seed_only else seeds:
            run_dir = runs_dir / f"{slug(spec.label)}-s{seed}"
            tag = f"{paper} {spec.label} seed {seed}"
            if spec.kind == "rosenbrock":
                error = _rosenbrock(spec, seed, run_dir, tag)
                if error is None:
                    data = json.loads((run_dir / "result.json").read_text())
                    runs[spec.label].append(RunData(spec.label, seed, data, [], []))
            else:
                config = spec.train_config(seed, run_dir, budget, faults)
                config = config if study is None else study.apply(config)
                error = run_or_resume(
                    config, tag, tag="reproduce", option="--runs-dir", checkpoints=checkpoints
                )
                if error is None:
                    runs[spec.label].append(_load(run_dir, spec.label, seed))
            if error is not None:
                failures[f"{spec.label} (seed {seed})"] = error
    results = Results(runs, specs)
    results.calibration = study
    return results, failures


def _prepare(
    train_specs: list[RunSpec],
    seeds: tuple[int, ...],
    runs_dir: Path,
    calibration: tuple[Path, str] | None,
) -> StudyCalibration | None:
    """Prepare the training runs' corpus, and measure the study's calibration (None without
    one, or when no run is charged on the calibrated compute model)."""
    if not train_specs:
        return None
    from lowcomm.data import prepare_corpus

    first = train_specs[0].train_config(seeds[0], runs_dir)
    corpus = prepare_corpus(first.data)
    if calibration is None:
        return None
    path, option = calibration
    from lowcomm.train.compute import uses_calibration

    calibrated = [
        s.run for s in train_specs if isinstance(s.run, TrainConfig) and uses_calibration(s.run)
    ]
    if not calibrated:
        return None
    return study_calibration(
        calibrated[0], path, vocab_size=corpus.vocab_size, option=option, tag="reproduce"
    )


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
