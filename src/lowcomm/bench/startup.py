"""``lowcomm bench startup``: seconds from the command to the first step, and to exit.

Runs the real command (``python -m lowcomm train`` on the tiny model) for each worker count,
as a user would, and watches it from outside: every line the command prints is stamped with
the time it arrived, the first step is the moment ``metrics.jsonl`` gains its first line, and
exit is when the process ends. The phase lines ``lowcomm train`` prints as it starts
(:data:`PHASES`) split the time before the first step into what each phase cost.

Timings are wall-clock on a machine that may be shared: compare numbers taken side by side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

#: The tiny model of the bench (and of the end-to-end tests): one block, width 64.
TINY_MODEL = [
    "--model.n-layer", "1", "--model.n-embd", "64", "--model.n-head", "2",
    "--model.block-size", "32", "--micro-batch-size", "4", "--eval-batches", "2",
]  # fmt: skip

#: (phase name, text that starts the line printed when the phase ends), in order. A phase
#: runs from the end of the one before (the command's start for the first) to its line.
PHASES: tuple[tuple[str, str], ...] = (
    ("imports and options", "lowcomm: preparing corpus"),
    ("corpus and tokenizer", "lowcomm: corpus:"),
    ("workers start and connect", "lowcomm: workers connected"),
    ("worker set-up", "lowcomm: training:"),
)


@dataclass(kw_only=True)
class StartupBench:
    """Seconds from the command to the first step and to exit, for several worker counts."""

    workers: tuple[int, ...] = (2, 4, 16)
    """Worker counts to time, one run each per repeat."""

    steps: int = 2
    """Training steps per run (the time to exit includes them and the final evaluation)."""

    method: str = "ddp"
    """Method to run."""

    repeats: int = 1
    """Runs per worker count; the table shows the median."""

    cold: bool = False
    """Use an empty tokenizer cache (the first run on a machine) instead of the warm one."""

    json_out: str | None = None
    """Also write the measurements to this JSON file."""


@dataclass
class StartupRun:
    """What one timed command did."""

    workers: int
    first_step_s: float
    exit_s: float
    returncode: int
    phases: dict[str, float]
    """Seconds each phase of :data:`PHASES` took (only the phases whose line was seen)."""

    lines: list[tuple[float, str]]
    """Every printed line with its arrival time (seconds since the command started)."""


def phase_costs(lines: list[tuple[float, str]], first_step_s: float) -> dict[str, float]:
    """Split the time before the first step into :data:`PHASES` by the lines' arrival times.

    Args:
        lines: ``(seconds since start, line)`` in arrival order.
        first_step_s: when the first step was written.

    Returns:
        Phase name to seconds, for each phase whose line appeared (in order), then
        ``first step`` (from the last phase line to the first step).
    """
    costs: dict[str, float] = {}
    previous, index = 0.0, 0
    for name, prefix in PHASES:
        found = next((i for i in range(index, len(lines)) if lines[i][1].startswith(prefix)), None)
        if found is None:
            continue
        seen, index = lines[found][0], found + 1
        costs[name] = max(0.0, seen - previous)
        previous = seen
    if costs and first_step_s == first_step_s:  # not NaN
        costs["first step"] = max(0.0, first_step_s - previous)
    return costs


def time_command(
    command: list[str],
    metrics: Path,
    *,
    env: dict[str, str],
    timeout_s: float = 600.0,
    watch: Callable[[int], AbstractContextManager[object]] | None = None,
) -> tuple[float, float, int, list[tuple[float, str]]]:
    """Run ``command``; return (seconds to the first line of ``metrics``, seconds to exit,
    exit code, stamped output lines). ``watch(pid)``: a context held while the command runs
    (``lowcomm bench scale`` samples the process tree's memory in it)."""
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first_step = float("nan")
    deadline = start + timeout_s
    with nullcontext() if watch is None else watch(process.pid):
        while process.poll() is None and time.perf_counter() < deadline:
            if first_step != first_step and metrics.exists() and metrics.stat().st_size > 0:
                first_step = time.perf_counter() - start
            time.sleep(0.02)
        if process.poll() is None:
            process.kill()
        process.wait()
    exit_s = time.perf_counter() - start
    reader.join(timeout=5)
    if first_step != first_step and metrics.exists() and metrics.stat().st_size > 0:
        first_step = exit_s  # the whole run fit between two polls
    return first_step, exit_s, process.returncode, lines


def run_startup(bench: StartupBench) -> list[StartupRun]:
    """Time the command for each worker count; print the table; return the runs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not bench.cold:
        from lowcomm.data import DataConfig, prepare_corpus

        prepare_corpus(DataConfig())  # so that "warm" is true of the first run too
    runs = _time_runs(bench)
    print(f"\nlowcomm bench startup: {bench.method}, tiny model, {bench.steps} steps, "
          f"{'cold' if bench.cold else 'warm'} tokenizer cache, {cores} CPU cores, "
          f"median of {bench.repeats}")  # fmt: skip
    table = _print_table(bench, runs)
    if bench.json_out is not None:
        report = {
            "method": bench.method, "steps": bench.steps, "cold": bench.cold, "cores": cores,
            "table": table, "runs": [dataclasses.asdict(run) for run in runs],
        }  # fmt: skip
        Path(bench.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return runs


def _time_runs(bench: StartupBench) -> list[StartupRun]:
    """Run the command ``bench.repeats`` times for each worker count, each into a scratch
    directory (with a cold cache, each its own empty one)."""
    runs: list[StartupRun] = []
    with tempfile.TemporaryDirectory(prefix="lowcomm-startup-") as scratch:
        env = {**os.environ}
        for repeat in range(bench.repeats):
            for workers in bench.workers:
                if bench.cold:
                    env["LOWCOMM_CACHE_DIR"] = str(Path(scratch) / f"cache-{workers}-{repeat}")
                out = Path(scratch) / f"run-{workers}-{repeat}"
                command = [
                    sys.executable, "-m", "lowcomm", "train", "--method", bench.method,
                    "--workers", str(workers), "--steps", str(bench.steps), "--out", str(out),
                    "--progress", "False", "--eval-every", str(max(1, bench.steps)),
                    *TINY_MODEL,
                ]  # fmt: skip
                first, exit_s, code, lines = time_command(command, out / "metrics.jsonl", env=env)
                runs.append(
                    StartupRun(workers, first, exit_s, code, phase_costs(lines, first), lines)
                )
                status = (
                    "" if code == 0 else f"  (exit code {code}: {lines[-1][1] if lines else ''})"
                )
                print(
                    f"  {workers:>3} workers: first step {first:6.2f} s, exit {exit_s:6.2f} s{status}",
                    flush=True,
                )
    return runs


def _print_table(bench: StartupBench, runs: list[StartupRun]) -> list[dict[str, object]]:
    """Print the medians per worker count (to the first step, to exit, per phase); return
    them as rows."""
    import statistics

    names = [name for name, _ in PHASES] + ["first step"]
    header = f"{'workers':>7}  {'to first step':>13}  {'to exit':>8}  " + "  ".join(
        f"{name:>{max(9, len(name))}}" for name in names
    )
    print(header)
    table: list[dict[str, object]] = []
    for workers in bench.workers:
        mine = [run for run in runs if run.workers == workers]
        first = statistics.median(run.first_step_s for run in mine)
        exit_s = statistics.median(run.exit_s for run in mine)
        phases = {
            name: statistics.median(run.phases[name] for run in mine if name in run.phases)
            for name in names
            if any(name in run.phases for run in mine)
        }
        cells = "  ".join(
            f"{phases[name]:>{max(9, len(name))}.2f}" if name in phases
            else f"{'-':>{max(9, len(name))}}"
            for name in names
        )  # fmt: skip
        print(f"{workers:>7}  {first:>13.2f}  {exit_s:>8.2f}  {cells}")
        table.append(
            {"workers": workers, "first_step_s": first, "exit_s": exit_s, "phases": phases}
        )
    return table
