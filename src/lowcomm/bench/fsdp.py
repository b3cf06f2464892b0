"""``lowcomm bench fsdp``: how large a model trains with 2 workers x 2 ranks, replicated against
sharded (``--worker-sharding``), and at what cost.

1. **Search.** For each method (ddp, diloco), worker sharding (replicate, fsdp) and precision
   (fp32, bf16-mixed), Llama-shaped models (``--model.family hf-llama``, heads of 64 dimensions,
   a quarter as many key-value heads) of growing depth and width (``--ladder``) each train
   ``--steps`` steps with the real command (``python -m lowcomm train``, no network emulation,
   the real clock), until one does not fit: the largest that did is the answer. Every attempt
   is its own process tree, watched from ``/proc``: its resident memory summed over the
   launcher, its worker server and the 4 ranks, and its swap. An attempt whose summed memory
   passes ``--budget-gb``, or that starts to swap, is stopped (every process of the tree is
   killed) rather than left to push the machine into swap.
2. **Memory against the plan.** Each run's measured ``peak_memory_bytes_per_rank`` (the largest
   rank's peak resident set) beside ``lowcomm plan``'s per-rank figure for the same method,
   model, layout and precision (``--memory-model lowcomm``: what a lowcomm rank holds), and
   their ratio (goal: within 10%).
3. **Speed.** lowcomm's sharded ddp against a plain PyTorch FSDP2 HSDP loop on one model,
   side by side in the same processes (:mod:`lowcomm.bench.fsdp_speed`): tokens per second
   and lowcomm's overhead (goal <= 1.05).

Prints markdown tables and writes them, with every attempt, to ``--out``. Sizes: the default
ladder reaches billions of parameters and the default budget is 20 GB: run it on a quiet
machine. ``--ladder 2x256 4x512 --budget-gb 4`` checks the tool in minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lowcomm.bench.fsdp_speed import RANKS, WORKERS, SpeedSetting, speed_ratio, speed_worker
from lowcomm.bench.scale import PeriodicWatch

#: n_layer x n_embd of each attempt, in growing order.
LADDER = (
    "2x256", "4x512", "8x768", "8x1024", "12x1024", "16x1536", "24x1536", "24x2048",
    "32x2048", "32x2560", "32x3072", "40x3072", "32x4096", "48x4096",
)  # fmt: skip

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(kw_only=True)
class FsdpBench:
    """The largest Llama-shaped model that trains with 2 workers x 2 ranks, replicated
    against sharded; measured peak memory per rank against lowcomm plan's; lowcomm's sharded
    ddp against a plain FSDP2 HSDP loop."""

    methods: tuple[str, ...] = ("ddp", "diloco")
    """Methods to search for (diloco syncs every 2 steps, so its outer step is measured)."""

    shardings: tuple[str, ...] = ("replicate", "fsdp")
    """--worker-sharding values to search for."""

    precisions: tuple[str, ...] = ("fp32", "bf16-mixed")
    """--precision values to search for."""

    ladder: tuple[str, ...] = LADDER
    """Model shapes to try, n_layer x n_embd, smallest first; a search stops at its first
    failure."""

    budget_gb: float = 20.0
    """Most resident memory an attempt's process tree may hold (summed over its processes,
    GB); past it, or once it swaps, the attempt is stopped."""

    steps: int = 3
    """Training steps per attempt."""

    block_size: int = 64
    """Tokens per sequence."""

    micro_batch_size: int = 1
    """Sequences per micro-batch per rank."""

    timeout_s: float = 3600.0
    """Give up on one attempt after this long."""

    search: bool = True
    """Run the search (parts 1 and 2)."""

    speed: bool = True
    """Run the speed comparison (part 3)."""

    speed_shape: str = "4x512"
    """n_layer x n_embd of the speed comparison's model."""

    speed_micro_batch_size: int = 4
    """Sequences per micro-batch per rank in the speed comparison."""

    speed_repeats: int = 6
    """Timed blocks per side in the speed comparison (3 steps each)."""

    out: str = "runs/bench-fsdp"
    """Output directory: runs/ (one per attempt), report.md and results.json."""

    keep_runs: bool = False
    """Keep each attempt's checkpoints/ and model/ (by default removed once measured: at the
    ladder's top each is tens of GB)."""


@dataclass
class Attempt:
    """One watched training command."""

    method: str
    sharding: str
    precision: str
    shape: str
    status: str
    """``ok``, ``over budget``, ``swapping``, ``timeout`` or ``failed: <its last line>``."""
    params: int = 0
    seconds: float = 0.0
    tree_peak_bytes: int = 0
    """Peak of the tree's summed resident memory (sampled)."""
    rank_peak_bytes: int = 0
    """summary.json's peak_memory_bytes_per_rank (the largest rank's peak RSS)."""
    rank_state_bytes: int = 0
    planned_rank_bytes: float = 0.0
    """lowcomm plan's per-rank memory (--memory-model lowcomm)."""


def shape_of(text: str) -> tuple[int, int]:
    """(n_layer, n_embd) of ``LxD``.

    Raises:
        ValueError: naming the option and the form.
    """
    try:
        layers, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(
            f"--ladder/--speed-shape: {text!r} is not n_layer x n_embd; pass e.g. 8x1024"
        ) from None
    if layers < 1 or width < 64 or width % 64:
        raise ValueError(
            f"--ladder/--speed-shape: {text!r}: width must be a multiple of 64 (heads of 64 "
            f"dimensions) and depth at least 1; pass e.g. 8x1024"
        )
    return layers, width


def model_flags(shape: str, block_size: int) -> list[str]:
    """The ``--model.*`` flags of one Llama-shaped attempt."""
    layers, width = shape_of(shape)
    heads = width // 64
    kv_heads = heads // 4 if heads % 4 == 0 else heads
    return [
        "--model.family", "hf-llama", "--model.n-layer", str(layers), "--model.n-embd",
        str(width), "--model.n-head", str(heads), "--model.n-kv-head", str(kv_heads),
        "--model.block-size", str(block_size),
    ]  # fmt: skip


def attempt_command(bench: FsdpBench, attempt: Attempt, run_dir: Path) -> list[str]:
    """The ``lowcomm train`` command of one attempt."""
    command = [
        sys.executable, "-m", "lowcomm", "train", "--method", attempt.method,
        "--workers", str(WORKERS), "--ranks-per-worker", str(RANKS),
        "--worker-sharding", attempt.sharding, "--precision", attempt.precision,
        "--steps", str(bench.steps), "--micro-batch-size", str(bench.micro_batch_size),
        "--network", "none", "--inner-network", "none", "--clock", "real",
        "--eval-every", str(bench.steps + 1), "--eval-batches", "1", "--progress", "False",
        "--out", str(run_dir), "--overwrite", *model_flags(attempt.shape, bench.block_size),
    ]  # fmt: skip
    if attempt.method == "diloco":
        command += ["--diloco.sync-every", "2"]
    return command


# --- the watch ---------------------------------------------------------------------------


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (Linux ``/proc``; processes that end meanwhile skipped)."""
    pids, pending = [], [root]
    while pending:
        pid = pending.pop()
        if pid in pids:
            continue
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
    return pids


def _usage(pid: int) -> tuple[int, int]:
    """(resident bytes, swapped bytes) of one process (0, 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            rss = int(statm.read().split()[1]) * _PAGE
        with open(f"/proc/{pid}/status") as status:
            swap = next((int(line.split()[1]) * 1024 for line in status if
                         line.startswith("VmSwap:")), 0)  # fmt: skip
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return 0, 0
    return rss, swap


class MemoryCap(PeriodicWatch):
    """Watches a process tree until stopped: keeps the peak of its summed resident memory, and
    kills every process of the tree once that passes ``budget`` bytes or the tree swaps (more
    than 64 MB), saying which in :attr:`stopped`."""

    SWAP_SLACK = 64 << 20

    def __init__(self, root: int, budget: float, period_s: float = 0.1) -> None:
        super().__init__(period_s)
        self.root, self.budget = root, budget
        self.peak_bytes = 0
        self.stopped: str | None = None

    def sample(self) -> bool:
        pids = tree_pids(self.root)
        usage = [_usage(pid) for pid in pids]
        rss, swap = sum(u[0] for u in usage), sum(u[1] for u in usage)
        self.peak_bytes = max(self.peak_bytes, rss)
        if rss > self.budget or swap > self.SWAP_SLACK:
            self.stopped = "over budget" if rss > self.budget else "swapping"
            for pid in reversed(pids):  # (children first: nothing restarts them)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return False
        return True


def run_attempt(bench: FsdpBench, attempt: Attempt, out: Path) -> Attempt:
    """Run one attempt under the memory cap; fill in what it measured."""
    run_dir = (
        out / "runs" / f"{attempt.method}-{attempt.sharding}-{attempt.precision}-{attempt.shape}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "output.log"
    begin = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(
            attempt_command(bench, attempt, run_dir), stdout=handle, stderr=subprocess.STDOUT
        )
        with MemoryCap(process.pid, bench.budget_gb * 1e9) as cap:
            try:
                process.wait(timeout=bench.timeout_s)
            except subprocess.TimeoutExpired:
                for pid in reversed(tree_pids(process.pid)):
                    os.kill(pid, signal.SIGKILL)
                process.wait()
                cap.stopped = cap.stopped or "timeout"
    attempt.seconds = time.perf_counter() - begin
    attempt.tree_peak_bytes = cap.peak_bytes
    if not bench.keep_runs:
        for bulky in ("checkpoints", "model"):
            shutil.rmtree(run_dir / bulky, ignore_errors=True)
    summary_path = run_dir / "summary.json"
    if cap.stopped is not None:
        attempt.status = cap.stopped
    elif process.returncode != 0 or not summary_path.exists():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        attempt.status = f"failed: {lines[-1][:160] if lines else process.returncode}"
    else:
        summary = json.loads(summary_path.read_text())
        attempt.status = "ok"
        attempt.params = int(summary["num_params"])
        attempt.rank_peak_bytes = int(summary["peak_memory_bytes_per_rank"])
        attempt.rank_state_bytes = int(summary["state_bytes_per_rank"])
        attempt.planned_rank_bytes = planned_rank_bytes(bench, attempt)
    return attempt


def planned_rank_bytes(bench: FsdpBench, attempt: Attempt) -> float:
    """``lowcomm plan``'s per-rank memory for one attempt (--memory-model lowcomm)."""
    from lowcomm.plan import PlanConfig, make_plan

    layers, width = shape_of(attempt.shape)
    config = PlanConfig(
        method=attempt.method, params=str(attempt.params), workers=WORKERS,
        ranks_per_worker=RANKS, worker_sharding=attempt.sharding,  # type: ignore[arg-type]
        precision=attempt.precision, memory_model="lowcomm", n_layer=layers,  # type: ignore[arg-type]
        tokens_per_step=WORKERS * RANKS * bench.micro_batch_size * bench.block_size,
        micro_batch_tokens=bench.micro_batch_size * bench.block_size, n_embd=width,
    )  # fmt: skip
    return make_plan(config).memory_per_rank_bytes


# --- the search and the report -----------------------------------------------------------


def search(bench: FsdpBench, out: Path) -> list[Attempt]:
    """Every combination up the ladder, each stopping at its first failure."""
    attempts: list[Attempt] = []
    for method in bench.methods:
        for precision in bench.precisions:
            for sharding in bench.shardings:
                for shape in bench.ladder:
                    attempt = run_attempt(
                        bench, Attempt(method, sharding, precision, shape, status="?"), out
                    )
                    attempts.append(attempt)
                    print(f"  {describe(attempt)}", flush=True)
                    if attempt.status != "ok":
                        break
    return attempts


def describe(attempt: Attempt) -> str:
    """One line of progress."""
    what = f"{attempt.method} {attempt.sharding} {attempt.precision} {attempt.shape}"
    if attempt.status != "ok":
        return f"{what}: {attempt.status} (tree peak {attempt.tree_peak_bytes / 1e9:.2f} GB)"
    return (
        f"{what}: {attempt.params / 1e6:.1f} M parameters, rank peak "
        f"{attempt.rank_peak_bytes / 1e9:.3f} GB (plan {attempt.planned_rank_bytes / 1e9:.3f}), "
        f"tree peak {attempt.tree_peak_bytes / 1e9:.2f} GB, {attempt.seconds:.0f} s"
    )


def largest_table(attempts: list[Attempt]) -> str:
    """Markdown: the largest model that fit, per combination."""
    rows = [
        "| method | sharding | precision | largest model | parameters | tree peak (GB) | "
        "rank peak (GB) | plan per rank (GB) | measured / plan | next size |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    combos = dict.fromkeys((a.method, a.sharding, a.precision) for a in attempts)
    for method, sharding, precision in combos:
        mine = [a for a in attempts if (a.method, a.sharding, a.precision) == (method, sharding,
                                                                                precision)]  # fmt: skip
        fitted = [a for a in mine if a.status == "ok"]
        failed = next((a for a in mine if a.status != "ok"), None)
        after = "not tried" if failed is None else f"{failed.shape}: {failed.status}"
        if not fitted:
            rows.append(f"| {method} | {sharding} | {precision} | none | | | | | | {after} |")
            continue
        best = fitted[-1]
        rows.append(
            f"| {method} | {sharding} | {precision} | {best.shape} | {best.params / 1e6:,.1f} M "
            f"| {best.tree_peak_bytes / 1e9:.2f} | {best.rank_peak_bytes / 1e9:.3f} | "
            f"{best.planned_rank_bytes / 1e9:.3f} | "
            f"{best.rank_peak_bytes / best.planned_rank_bytes:.3f} | {after} |"
        )
    return "\n".join(rows)


def attempts_table(attempts: list[Attempt]) -> str:
    """Markdown: every attempt, with its measured and planned memory."""
    rows = [
        "| method | sharding | precision | shape | parameters | status | rank state (GB) | "
        "rank peak (GB) | plan (GB) | measured / plan | seconds |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for a in attempts:
        ok = a.status == "ok"
        cells = (
            f"{a.params / 1e6:,.1f} M | ok | {a.rank_state_bytes / 1e9:.3f} | "
            f"{a.rank_peak_bytes / 1e9:.3f} | {a.planned_rank_bytes / 1e9:.3f} | "
            f"{a.rank_peak_bytes / a.planned_rank_bytes:.3f}"
            if ok
            else f" | {a.status} | | | | "
        )
        rows.append(
            f"| {a.method} | {a.sharding} | {a.precision} | {a.shape} | {cells} | {a.seconds:.0f} |"
        )
    return "\n".join(rows)


def run_speed(bench: FsdpBench) -> dict[str, Any]:
    """Part 3: lowcomm's sharded ddp against the plain FSDP2 HSDP loop."""
    from lowcomm.launch import spawn_workers

    layers, width = shape_of(bench.speed_shape)
    setting = SpeedSetting(
        n_layer=layers, n_embd=width, block_size=bench.block_size,
        micro_batch_size=bench.speed_micro_batch_size, repeats=bench.speed_repeats,
    )  # fmt: skip
    times = spawn_workers(speed_worker, WORKERS * RANKS, (setting,), timeout_s=bench.timeout_s)
    tokens = WORKERS * RANKS * bench.speed_micro_batch_size * bench.block_size
    return {"shape": bench.speed_shape, **speed_ratio(times[0], tokens), "times": times[0]}


def speed_table(speed: dict[str, Any], bench: FsdpBench) -> str:
    """Markdown: the two loops side by side."""
    return "\n".join(
        [
            f"Model {speed['shape']} (hf-llama), {WORKERS} workers x {RANKS} ranks, micro-batch "
            f"{bench.speed_micro_batch_size} x {bench.block_size} tokens per rank, fp32, no "
            f"network emulation; median of {bench.speed_repeats} interleaved blocks of 3 steps.",
            "",
            "| loop | tokens/s |",
            "|---|---:|",
            f"| plain FSDP2 HSDP (fully_shard on a 2-D mesh, torch AdamW) | "
            f"{speed['fsdp2_tokens_per_s']:,.0f} |",
            f"| lowcomm ddp, --worker-sharding fsdp | {speed['lowcomm_tokens_per_s']:,.0f} |",
            f"| overhead (lowcomm step time / plain) | {speed['overhead']:.3f} (goal <= 1.05) |",
        ]
    )


def run_fsdp(bench: FsdpBench) -> dict[str, Any]:
    """Run the parts asked for; print and write the report."""
    for shape in (*bench.ladder, bench.speed_shape):
        shape_of(shape)  # (a bad shape is refused before anything runs)
    out = Path(bench.out)
    out.mkdir(parents=True, exist_ok=True)
    report: list[str] = ["# lowcomm bench fsdp", ""]
    results: dict[str, Any] = {"bench": asdict(bench)}
    if bench.search:
        print(f"lowcomm bench fsdp: search, budget {bench.budget_gb:g} GB per attempt", flush=True)
        attempts = search(bench, out)
        results["attempts"] = [asdict(a) for a in attempts]
        report += ["## Largest model per combination", "", largest_table(attempts), "",
                   "## Every attempt", "", attempts_table(attempts), ""]  # fmt: skip
    if bench.speed:
        print(
            "lowcomm bench fsdp: lowcomm's sharded ddp against a plain FSDP2 HSDP loop", flush=True
        )
        speed = run_speed(bench)
        results["speed"] = speed
        report += ["## Speed", "", speed_table(speed, bench), ""]
    text = "\n".join(report)
    print(text)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


__all__ = ["LADDER", "Attempt", "FsdpBench", "MemoryCap", "run_fsdp", "shape_of"]
