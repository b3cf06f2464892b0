"""``lowcomm bench scale``: many workers, one process per worker against many workers per process.

For each worker count M and placement, the real command (``python -m lowcomm train``) runs as a
user would, watched from outside: the time to its first step (``metrics.jsonl`` gains a line:
the runs log every step, ``--log-every 1``, so the first line is the first step's), the time to
the end of every worker's set-up (rank 0's ``lowcomm: training:`` line), the peak resident memory of its whole process tree (sampled from ``/proc``: the launcher and
every worker process, summed at each sample), the most threads the tree ran at once, and, from
its ``summary.json``, the wall-clock tokens per second of training, the final validation loss
and the modeled time. Both placements of one M train the same workers on the same data under
one compute calibration (measured once, before the first run), so their loss and modeled time
must be equal; the table says whether they are.

``process``: one process per worker (``--workers-per-process 1``, the default). ``inprocess``:
every worker in one process (``--workers-per-process M``). Process mode above
``--process-limit`` workers is skipped: each worker process costs an interpreter and torch
(about 330 MB here), so 64 of them do not fit a laptop. The ``limit`` row is one process
training one model on the tokens every step of the largest common M trains (one worker, an M
times larger micro-batch): the throughput batching all workers into one call could reach.

Timings are wall-clock on a machine that may be shared: compare numbers taken side by side.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from lowcomm.bench.runs import STUDY_CALIBRATION, study_calibration
from lowcomm.bench.startup import time_command

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig

#: Placements the bench knows.
MODES = ("process", "inprocess")

#: The model of the bench, small so that 256 workers fit one process: 2 blocks of width 64.
SCALE_MODEL = [
    "--model.n-layer", "2", "--model.n-embd", "64", "--model.n-head", "2",
    "--model.block-size", "32", "--eval-batches", "2",
]  # fmt: skip

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(kw_only=True)
class ScaleBench:
    """Time to first step, peak memory, throughput, loss and modeled time as the workers grow,
    one process per worker against all workers in one process."""

    workers: tuple[int, ...] = (4, 16, 64, 256)
    """Worker counts M."""

    modes: tuple[str, ...] = MODES
    """Placements: ``process`` (one process per worker) and ``inprocess`` (all in one)."""

    method: str = "ddp"
    """Method every run trains."""

    steps: int = 4
    """Training steps per run."""

    micro_batch_size: int = 4
    """Sequences per micro-batch per worker."""

    network: str = "wan"
    """Network preset of every run (the virtual clock models it)."""

    process_limit: int = 16
    """Largest M run with one process per worker (each costs an interpreter and torch)."""

    limit: bool = True
    """Also run the limit: one process, one model, the tokens per step of the largest M both
    placements ran (a micro-batch that many times larger)."""

    timeout_s: float = 900.0
    """Give up on one run after this long (the row then says so)."""

    repeats: int = 1
    """Runs of each placement and M; the table keeps the one with the shortest time to the
    first step (on a shared machine, the least disturbed)."""

    out: str = "runs/bench-scale"
    """Output directory: runs/, calibration.json, report.md and results.json."""


@dataclass
class ScaleRun:
    """What one watched command did."""

    mode: str
    workers: int
    first_step_s: float
    exit_s: float
    setup_s: float
    """Seconds to the end of every worker's set-up (rank 0's ``lowcomm: training:`` line)."""
    returncode: int
    peak_rss_bytes: int
    """The peak of the tree's summed resident sets (a page shared by n processes n times)."""
    peak_threads: int
    tokens_per_s: float
    final_val_loss: float
    modeled_time_s: float
    error: str = ""
    peak_pss_bytes: int = 0
    """The peak of the tree's summed proportional set sizes (a page shared by n processes
    1/n in each: what the processes take of the machine's memory together); 0: not read."""


_Watch = TypeVar("_Watch", bound="PeriodicWatch")


class PeriodicWatch:
    """A daemon thread that calls :meth:`sample` every ``period_s`` from entering the context
    until leaving it, or until :meth:`sample` returns False."""

    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self: _Watch) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set() and self.sample():
            self._stop.wait(self._period_s)

    def sample(self) -> bool:
        """One look; False ends the watch."""
        raise NotImplementedError


class TreeSampler(PeriodicWatch):
    """Samples a process tree's summed resident memory and thread count every ``period_s``,
    and its summed proportional set size every ``pss_period_s``, until stopped; keeps the
    peaks. Linux ``/proc`` only (elsewhere the peaks stay 0). The proportional set size is
    read seldom: the kernel walks a process's page tables for it, under the lock its page
    faults take (tens of milliseconds for a process of 256 workers), where the resident size
    is a counter."""

    def __init__(self, root: int, period_s: float = 0.05, pss_period_s: float = 2.0) -> None:
        super().__init__(period_s)
        self._root = root
        self._pss_period_s = pss_period_s
        self._pss_read_at: float | None = None
        self.peak_rss_bytes = 0
        self.peak_pss_bytes = 0
        self.peak_threads = 0

    def sample(self) -> bool:
        now = time.monotonic()
        pss = self._pss_read_at is None or now - self._pss_read_at >= self._pss_period_s
        usage = tree_usage(self._root, pss=pss)
        self.peak_rss_bytes = max(self.peak_rss_bytes, usage.rss)
        self.peak_threads = max(self.peak_threads, usage.threads)
        if pss:
            self._pss_read_at = now
            self.peak_pss_bytes = max(self.peak_pss_bytes, usage.pss)
        return True


class TreeUsage(NamedTuple):
    rss: int
    """Summed resident bytes (a page shared by n processes counted n times)."""
    threads: int
    pss: int
    """Summed proportional set sizes in bytes (a shared page counted once in all; each
    process's resident bytes where its ``smaps_rollup`` cannot be read)."""


def tree_usage(root: int, *, pss: bool = True) -> TreeUsage:
    """The resident memory and threads of ``root`` and its descendants now (``pss``: and their
    proportional set sizes, else 0); processes that end while being read are skipped."""
    rss = threads = proportional = 0
    pending, seen = [root], set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/statm") as statm:
                resident = int(statm.read().split()[1]) * _PAGE
            rss += resident
            proportional += _pss(pid, resident) if pss else 0
            tasks = os.listdir(f"/proc/{pid}/task")
            threads += len(tasks)
            for task in tasks:
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
    return TreeUsage(rss, threads, proportional)


def _pss(pid: int, resident: int) -> int:
    """``pid``'s proportional set size in bytes (``resident`` where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return resident


def watch(
    command: list[str], run_dir: Path, timeout_s: float
) -> tuple[float, float, int, TreeSampler, list[tuple[float, str]]]:
    """Run ``command``; return (seconds to the first line of ``run_dir/metrics.jsonl``, seconds
    to exit, exit code, the tree's sampler, the lines it printed with their arrival times)."""
    samplers: list[TreeSampler] = []

    def sample(pid: int) -> TreeSampler:
        samplers.append(TreeSampler(pid))
        return samplers[-1]

    first, exit_s, code, lines = time_command(
        command, run_dir / "metrics.jsonl", env=dict(os.environ), timeout_s=timeout_s,
        watch=sample,
    )  # fmt: skip
    return first, exit_s, code, samplers[0], lines


def train_command(
    bench: ScaleBench, mode: str, workers: int, run_dir: Path, calibration: Path | None
) -> list[str]:
    """The ``lowcomm train`` command of one run (``mode == "limit"``: one worker, a micro-batch
    ``workers`` times larger)."""
    per_process = workers if mode == "inprocess" else 1
    train_workers, batch = (1, bench.micro_batch_size * workers) if mode == "limit" else (
        workers, bench.micro_batch_size
    )  # fmt: skip
    command = [
        sys.executable, "-m", "lowcomm", "train", "--method", bench.method,
        "--workers", str(train_workers), "--steps", str(bench.steps), "--out", str(run_dir),
        "--progress", "False", "--eval-every", str(bench.steps), "--network", bench.network,
        "--micro-batch-size", str(batch), "--log-every", "1", *SCALE_MODEL,
    ]  # fmt: skip
    if calibration is not None and mode != "limit":
        command += ["--calibration", str(calibration)]
    if per_process > 1:
        command += ["--workers-per-process", str(per_process)]
    return command


def run_one(
    bench: ScaleBench, mode: str, workers: int, out: Path, calibration: Path | None
) -> ScaleRun:
    """Run and watch one placement at one worker count (``bench.repeats`` times: the run
    with the shortest time to the first step)."""
    runs = [_run_once(bench, mode, workers, out, calibration) for _ in range(bench.repeats)]
    return min(runs, key=lambda run: (run.returncode != 0, run.first_step_s))


def _run_once(
    bench: ScaleBench, mode: str, workers: int, out: Path, calibration: Path | None
) -> ScaleRun:
    run_dir = out / "runs" / f"{mode}-{workers}"
    shutil.rmtree(run_dir, ignore_errors=True)  # (a repeat starts afresh, not as a resume)
    command = train_command(bench, mode, workers, run_dir, calibration)
    first, exit_s, code, sampler, lines = watch(command, run_dir, bench.timeout_s)
    last = next((line for _, line in reversed(lines) if line.strip()), "")
    setup = next((at for at, line in lines if line.startswith("lowcomm: training:")), math.nan)
    summary: dict[str, Any] = {}
    if code == 0 and (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    wall = float(summary.get("wall_clock_s") or math.nan)
    return ScaleRun(
        mode=mode, workers=workers, first_step_s=first, exit_s=exit_s, setup_s=setup,
        returncode=code,
        peak_rss_bytes=sampler.peak_rss_bytes, peak_pss_bytes=sampler.peak_pss_bytes,
        peak_threads=sampler.peak_threads,
        tokens_per_s=float(summary.get("tokens", math.nan)) / wall if wall > 0 else math.nan,
        # (NaN also where the final validation had no batch: summary.json's null)
        final_val_loss=_nan_if_none(summary.get("final_val_loss")),
        modeled_time_s=float(summary.get("modeled_time_s", math.nan)),
        error="" if code == 0 else last,
    )  # fmt: skip


def planned_runs(bench: ScaleBench) -> list[tuple[str, int]]:
    """(mode, M) of every run, in order; the limit last, at the largest M both modes run."""
    for mode in bench.modes:
        if mode not in MODES:
            raise ValueError(
                f"--modes: {mode!r} is not one of {', '.join(MODES)}; pass process, inprocess "
                f"or both (comma-separated)"
            )
    if not bench.workers or min(bench.workers) < 1:
        raise ValueError(f"--workers: {bench.workers} must be worker counts of at least 1")
    runs = [
        (mode, workers)
        for workers in bench.workers
        for mode in bench.modes
        if mode != "process" or workers <= bench.process_limit
    ]
    common = [m for m in bench.workers if m <= bench.process_limit]
    if bench.limit and common:
        runs.append(("limit", max(common)))
    return runs


def run_scale(bench: ScaleBench) -> list[ScaleRun]:
    """Run every placement at every worker count under one calibration; write and print the
    report; return the runs."""
    from lowcomm.data import prepare_corpus

    plan = planned_runs(bench)
    out = Path(bench.out)
    out.mkdir(parents=True, exist_ok=True)
    train = _scale_train_config(bench)
    corpus = prepare_corpus(train.data)
    study = study_calibration(
        train, out / STUDY_CALIBRATION, vocab_size=corpus.vocab_size, option="--calibration",
        tag="scale",
    )  # fmt: skip
    runs: list[ScaleRun] = []
    for mode, workers in plan:
        print(f"[scale] {mode} M={workers}: running", file=sys.stderr, flush=True)
        runs.append(run_one(bench, mode, workers, out, None if study is None else study.path))
        print(f"[scale]   {describe_run(runs[-1])}", file=sys.stderr, flush=True)
    report = scale_report(
        bench, runs, None if study is None else study.describe("--calibration", out)
    )
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(
        json.dumps({"bench": asdict(bench), "runs": [asdict(run) for run in runs]}, indent=2) + "\n"
    )
    print(report)
    return runs


def _scale_train_config(bench: ScaleBench) -> TrainConfig:
    """The training configuration of the bench's runs (for the study's calibration)."""
    from lowcomm.config import CommConfig, TrainConfig
    from lowcomm.data.config import DataConfig
    from lowcomm.models.options import ModelConfig

    return TrainConfig(
        method=bench.method,
        model=ModelConfig(n_layer=2, n_embd=64, n_head=2, block_size=32),
        data=DataConfig(micro_batch_size=bench.micro_batch_size),
        comm=CommConfig(network=bench.network),
    )


def describe_run(run: ScaleRun) -> str:
    """One line of progress for a finished run."""
    if run.returncode != 0:
        return f"failed (exit {run.returncode}): {run.error}"
    return (
        f"set-up {run.setup_s:.1f} s, first step {run.first_step_s:.1f} s, peak RSS "
        f"{run.peak_rss_bytes / 2**30:.2f} GiB (PSS {run.peak_pss_bytes / 2**30:.2f} GiB), "
        f"{run.peak_threads} threads, {run.tokens_per_s:,.0f} tokens/s, val loss "
        f"{_loss(run)}, modeled {run.modeled_time_s:.3f} s"
    )


def _nan_if_none(value: Any) -> float:
    return math.nan if value is None else float(value)


def _loss(run: ScaleRun) -> str:
    return "n/a" if math.isnan(run.final_val_loss) else f"{run.final_val_loss:.4f}"


def equal_runs(a: ScaleRun, b: ScaleRun) -> bool:
    """Whether two placements of one M gave the same numbers: loss to relative 1e-6, modeled
    time to 1e-9 s (room for float rounding only)."""
    return (
        math.isclose(a.final_val_loss, b.final_val_loss, rel_tol=1e-6)
        # (neither has a final loss: nothing there to differ)
        or (math.isnan(a.final_val_loss) and math.isnan(b.final_val_loss))
    ) and abs(a.modeled_time_s - b.modeled_time_s) <= 1e-9


def scale_report(bench: ScaleBench, runs: list[ScaleRun], calibration: str | None) -> str:
    """The markdown report: the command's settings, one row per run, the equality column."""
    lines = [
        "# Many workers: one process per worker against all workers in one process",
        "",
        f"{bench.method}, 2-layer GPT of width 64, context 32, micro-batch {bench.micro_batch_size}"
        f" per worker, {bench.steps} steps, `{bench.network}` on the virtual clock, "
        f"{os.cpu_count()} CPU cores. Set-up: from the command to the end of every worker's "
        f"set-up; first step: to the first step's line in metrics.jsonl"
        f"{f' (best of {bench.repeats} runs)' if bench.repeats > 1 else ''}. Peak RSS: the whole "
        f"process tree's resident sets, summed (a page the processes share counted in each); "
        f"peak PSS: their proportional set sizes, summed (a shared page counted once in all: "
        f"what the tree takes of the machine's memory). Tokens/s: wall clock, training only "
        f"(from summary.json).",
        "",
    ]
    if calibration is not None:
        lines += [calibration, ""]
    lines += [
        "| M | placement | set-up | first step | peak RSS | peak PSS | threads | tokens/s (wall) "
        "| final val loss | modeled time | equal to process mode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(run.mode, run.workers): run for run in runs}
    for run in runs:
        other = by_key.get(("process", run.workers))
        same = "-" if run.mode != "inprocess" or other is None else (
            "yes" if equal_runs(run, other) else "NO"
        )  # fmt: skip
        lines.append(_row(run, same))
    skipped = [m for m in bench.workers if m > bench.process_limit and "process" in bench.modes]
    if skipped:
        lines += ["", f"Process mode not run at M = {', '.join(map(str, skipped))} "
                  f"(`--process-limit {bench.process_limit}`: a process per worker)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _row(run: ScaleRun, same: str) -> str:
    placement = {"process": "process per worker", "inprocess": "one process",
                 "limit": f"limit: 1 model, {run.workers}x batch"}[run.mode]  # fmt: skip
    if run.returncode != 0:
        return f"| {run.workers} | {placement} | failed: {run.error} | | | | | | | | |"
    return (
        f"| {run.workers} | {placement} | {run.setup_s:.1f} s | {run.first_step_s:.1f} s | "
        f"{run.peak_rss_bytes / 2**30:.2f} GiB | {run.peak_pss_bytes / 2**30:.2f} GiB | "
        f"{run.peak_threads} | {run.tokens_per_s:,.0f} | "
        f"{_loss(run)} | {run.modeled_time_s:.3f} s | {same} |"
    )


__all__ = ["ScaleBench", "ScaleRun", "TreeUsage", "run_scale", "tree_usage"]
