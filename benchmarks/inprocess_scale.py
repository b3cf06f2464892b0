"""Many workers in one process (issue 30, item 3): peak memory, time to the first step and
threads of ``lowcomm train --workers M --workers-per-process M`` for every method.

Each run is a fresh ``python -m lowcomm train`` of a 2-layer GPT 64 wide (block 32, micro-batch
2, 3 steps, declared 0.05 s per micro-batch on the virtual clock, the datacenter link, bundled
corpus, tokenizer cached beforehand). (On wan, 256 workers' ring latency alone is 5 s of modeled
time per all-reduce, which ACCO fills with about 100 micro-batches per worker and step: a run
that measures the method, not the placement.) This script polls the child's ``/proc/PID/status`` every 20 ms: the peak
resident set (``VmHWM``, one interpreter and every worker), the most threads it had, and the
seconds from starting the command to the first line of ``metrics.jsonl`` (written after the
first step; --log-every 1), in wall time and in the child's CPU time (the run uses about one
core: on a loaded machine its CPU time is the better reading).

Usage: ``python benchmarks/inprocess_scale.py [--workers 256] [--methods ddp diloco ...]``
(about 10 minutes for the 23 methods at 256 workers here). A run that fails is a row naming
its error, and the table goes on.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowcomm.strategies import STRATEGIES


def quick_flags(method: str) -> list[str]:
    """``method``'s periods from its declared ``quick_options`` (under which a few steps run
    its whole cycle), as flags; its other options (the exchange's format, chunk sizes) at
    their defaults, as a user's run has them."""
    from lowcomm.strategies import strategy_class

    cls = strategy_class(method)
    return [
        flag
        for name, value in cls.quick_options.items()
        if name.endswith(("sync_every", "period"))
        for flag in (f"--{cls.options_field}.{name.replace('_', '-')}", str(value))
    ]


def _status(pid: int) -> dict[str, int]:
    """VmHWM (kB) and Threads of ``pid`` (empty once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmHWM", "Threads"):
            found[key] = int(value.split()[0])
    return found


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (nan once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(method: str, workers: int, out: Path) -> dict[str, float]:
    """One run: peak RSS (GB), seconds (wall and CPU) to the first step, most threads, total
    seconds."""
    command = [
        sys.executable, "-m", "lowcomm", "train", "--method", method, "--workers", str(workers),
        "--workers-per-process", str(workers), "--model.n-layer", "2", "--model.n-embd", "64",
        "--model.n-head", "2", "--model.block-size", "32", "--micro-batch-size", "2",
        "--steps", "3", "--log-every", "1", "--eval-every", "100", "--eval-batches", "2",
        "--seconds-per-microbatch", "0.05", "--network", "datacenter", "--progress", "False",
        "--out", str(out),
        *quick_flags(method),
    ]  # fmt: skip
    begin = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_kb, threads, first, first_cpu = 0, 0, float("nan"), float("nan")
    metrics = out / "metrics.jsonl"
    while child.poll() is None:
        status = _status(child.pid)
        peak_kb = max(peak_kb, status.get("VmHWM", 0))
        threads = max(threads, status.get("Threads", 0))
        if first != first and metrics.exists() and metrics.stat().st_size > 0:
            first, first_cpu = time.perf_counter() - begin, _cpu_seconds(child.pid)
        time.sleep(0.02)
    total = time.perf_counter() - begin
    _, stderr = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"{method}: exit {child.returncode}: {stderr.strip()[-2000:]}")
    return {"peak_rss_gb": peak_kb / 1e6, "first_step_s": first, "first_step_cpu_s": first_cpu,
            "threads": threads, "total_s": total}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=sorted(STRATEGIES))
    args = parser.parse_args()
    print(
        "| method | workers | peak RSS (GB) | to first step (s) | its CPU (s) | threads "
        "| total (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for method in args.methods:
            try:
                row = measure(
                    method, args.workers, Path(work) / f"{len(list(Path(work).iterdir()))}-{method}"
                )
            except RuntimeError as error:
                print(f"| {method} | {args.workers} | failed: {error} |||||", flush=True)
                continue
            print(
                f"| {method} | {args.workers} | {row['peak_rss_gb']:.2f} | "
                f"{row['first_step_s']:.1f} | {row['first_step_cpu_s']:.1f} | "
                f"{row['threads']:.0f} | {row['total_s']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
