"""``lowcomm bench membership``: what ``--membership torchft`` costs, measured side by side in
one run on this machine (docs/membership.md).

1. **Overhead with no fault**: tokens per second of the same job (``--workers`` processes,
   the real clock, ``--network none``) with static membership and with torchft, for diloco and
   ddp. A job's rate is its workers' tokens over the longest worker's training time.
2. **A kill**: diloco on torchft; worker 2 is SIGKILLed after a quarter of its steps. Reported:
   the seconds from the kill to the survivors' next committed round (the goal is at most the
   detection time, ``--detect-s``, plus one round).
3. **Healing**: a worker is started again in the dead one's slot at once. Reported: the bytes
   it was healed with and the seconds the healing took (from asking for its first quorum to
   having the state), against the bytes over the link's bandwidth (``--bandwidth-gbps``,
   what the loopback is taken to carry), and the seconds from its process start to its first
   committed round. The healing's seconds are the transfer's (torchft's PGTransport
   receiving the state); asking for the quorum to holding the state also waits for the
   others' next round (``asked_to_healed_s``).

4. **A trace**: simulated against measured goodput on one fault trace (a crash and a join,
   placed by step), replayed on the live job (:mod:`lowcomm.membership.replay`).

Every job runs through :class:`lowcomm.membership.local.LocalJob` or the launch path; numbers
come from each worker's summary.json and membership.json.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["MembershipBench", "run_membership_bench"]


@dataclass(kw_only=True)
class MembershipBench:
    """torchft membership against static: overhead, a kill's stall and healing."""

    workers: int = 3
    """Worker processes of every job."""

    steps: int = 120
    """Steps of each job."""

    sync_every: int = 10
    """diloco's H."""

    n_layer: int = 2
    """The GPT's blocks."""

    n_embd: int = 128
    """The GPT's width."""

    detect_s: float = 2.0
    """The lighthouse's heartbeat timeout (the detection time)."""

    bandwidth_gbps: float = 10.0
    """The link healing is compared against (bytes / bandwidth)."""

    out: str | None = None
    """Directory for the runs (default: a temporary one)."""

    json_out: str | None = None
    """Also write the results as JSON here."""

    trace_steps: int = 600
    """Steps of the trace's jobs: long enough that the joiner's process starts (seconds)
    while the others still train."""

    trace_only: bool = False
    """Run only the trace's simulated against measured goodput."""


def _config(
    bench: MembershipBench, method: str, out: Path, membership: Literal["static", "torchft"]
) -> Any:
    from lowcomm.config import TrainConfig, with_options
    from lowcomm.data import DataConfig
    from lowcomm.membership.options import MembershipOptions
    from lowcomm.models import ModelConfig
    from lowcomm.strategies.diloco import DiLoCoOptions

    config = with_options(
        TrainConfig(
            method=method,
            model=ModelConfig(n_layer=bench.n_layer, n_head=4, n_embd=bench.n_embd, block_size=64),
            data=DataConfig(micro_batch_size=4),
            diloco=DiLoCoOptions(sync_every=bench.sync_every),
        ),
        workers=bench.workers, steps=bench.steps, clock="real", network="none",
        eval_every=10**6, eval_batches=2, progress=False, plot=False, out=str(out), log_every=10,
        membership=membership,
        membership_options=MembershipOptions(detect_s=bench.detect_s, quorum_s=120.0)
        if membership == "torchft"
        else MembershipOptions(),
    )  # fmt: skip
    config.validate()
    return config


def _rate(summaries: list[dict[str, Any]]) -> float:
    tokens = sum(float(s["tokens"]) for s in summaries)
    wall = max(float(s["wall_clock_s"]) for s in summaries)
    return tokens / wall


def _summary(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "summary.json").read_text()))


def _overhead(bench: MembershipBench, method: str, root: Path) -> dict[str, float]:
    from lowcomm.launch.run import run_training

    static = _config(bench, method, root / f"{method}-static", "static")
    summary = run_training(static, report=None)
    assert summary is not None
    static_rate = float(summary["tokens"]) / float(summary["wall_clock_s"])
    live = _config(bench, method, root / f"{method}-torchft", "torchft")
    run_training(live, report=None)
    workers = [_summary(root / f"{method}-torchft" / f"worker{k}") for k in range(bench.workers)]
    torchft_rate = _rate(workers)
    return {
        "static_tokens_per_s": static_rate,
        "torchft_tokens_per_s": torchft_rate,
        "time_ratio": static_rate / torchft_rate,
    }


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def _kill_and_heal(bench: MembershipBench, root: Path) -> dict[str, Any]:
    from lowcomm.config import with_options
    from lowcomm.membership.local import LocalJob

    config = _config(bench, "diloco", root / "diloco-kill", "torchft")
    config = with_options(config, log_every=1)
    quarter = bench.steps // 4
    with LocalJob(config) as job:
        job.start_all()
        while _lines(job.worker_dir(2, 0) / "metrics.jsonl") < quarter:
            time.sleep(0.05)
        killed = job.kill(2)
        restarted = time.time()
        job.start(2)
        codes = job.wait(600)
    survivors = [json.loads((job.worker_dir(k, 0) / "membership.json").read_text()) for k in (0, 1)]
    stalls = []
    for record in survivors:
        commits = [e["time"] for e in record["events"] if e["event"] == "commit"]
        before = [t for t in commits if t <= killed]
        after = [t for t in commits if t > killed]
        stalls.append(after[0] - killed if after else float("nan"))
        rounds = [b - a for a, b in itertools.pairwise(before)]
    joiner = json.loads((job.worker_dir(2, 1) / "membership.json").read_text())
    healed = next(e for e in joiner["events"] if e["event"] == "healed")
    first_commit = next(e["time"] for e in joiner["events"] if e["event"] == "commit")
    bound = healed["bytes"] / (bench.bandwidth_gbps * 1e9 / 8)
    return {
        "exit_codes": {str(k): v for k, v in codes.items()},
        "kill_to_next_commit_s": stalls,
        "round_s": sorted(rounds)[len(rounds) // 2] if rounds else None,
        "detect_s": bench.detect_s,
        "heal_bytes": healed["bytes"],
        "heal_s": healed["transfer_s"],
        "asked_to_healed_s": healed["time"] - healed["asked"],
        "bytes_over_bandwidth_s": bound,
        "start_to_first_commit_s": first_commit - restarted,
    }


def _trace_goodput(bench: MembershipBench, root: Path) -> dict[str, Any]:
    """Simulated against measured goodput on one trace: worker 2 crashes at a quarter of the
    steps and a new worker joins its slot at half. Measured: the trace replayed on the live
    torchft job (SIGKILL, a new process). Simulated: the same trace in one process on the
    virtual clock, each micro-batch declared at the live job's fault-free step time and
    detection at ``--detect-s``, so that the two differ only in what the simulation models."""
    from lowcomm.config import with_options
    from lowcomm.launch.run import run_training

    trace = root / "trace.txt"
    trace.parent.mkdir(parents=True, exist_ok=True)
    steps = bench.trace_steps
    trace.write_text(f"step={steps // 4} worker=2 crash\nstep={steps // 2} worker=2 join\n")
    live = with_options(
        _config(bench, "diloco", root / "trace-torchft", "torchft"), faults=str(trace),
        steps=steps,
    )  # fmt: skip
    live.validate()
    measured = run_training(live, report=None)
    assert measured is not None
    faults = measured["faults"]
    step_s = float(faults["fault_free_step_s"])
    simulated_config = with_options(
        _config(bench, "diloco", root / "trace-simulated", "static"), faults=str(trace),
        clock="virtual", workers_per_process=bench.workers, fault_detection_s=bench.detect_s,
        steps=steps,
        seconds_per_microbatch=step_s / live.run.microbatches_per_step,
    )  # fmt: skip
    simulated_config.validate()
    simulated = run_training(simulated_config, report=None)
    assert simulated is not None
    sim, real = simulated["faults"]["goodput"], faults["goodput"]
    return {
        "trace": trace.read_text(),
        "measured_goodput": real,
        "simulated_goodput": sim,
        "ratio": None if not sim or real is None else real / sim,
        "fault_free_step_s": step_s,
        "measured_run_s": faults["run_s"],
        "launcher": faults["launcher"],
    }


def run_membership_bench(bench: MembershipBench) -> dict[str, Any]:
    """Run the benchmark; print its table and return its numbers."""
    from lowcomm.membership.options import require_torchft

    require_torchft()
    with tempfile.TemporaryDirectory(prefix="lowcomm-bench-membership-") as scratch:
        root = Path(bench.out) if bench.out is not None else Path(scratch)
        results: dict[str, Any] = {}
        if not bench.trace_only:
            results["overhead"] = {m: _overhead(bench, m, root) for m in ("diloco", "ddp")}
            results["kill"] = _kill_and_heal(bench, root)
        results["trace"] = _trace_goodput(bench, root)
    lines = _table(bench, results)
    traced = results["trace"]
    ratio = "?" if traced["ratio"] is None else f"{traced['ratio']:.3f}"
    lines.append(
        f"trace ({' / '.join(traced['trace'].strip().splitlines())}): goodput "
        f"measured {traced['measured_goodput']:.3f}, simulated {traced['simulated_goodput']:.3f}"
        f" (measured / simulated {ratio})"
    )
    print("\n".join(lines), flush=True)
    if bench.json_out is not None:
        Path(bench.json_out).write_text(json.dumps(results, indent=1) + "\n")
    return results


def _table(bench: MembershipBench, results: dict[str, Any]) -> list[str]:
    if "overhead" not in results:
        return []
    lines = ["method  static tok/s  torchft tok/s  time ratio (torchft / static)"]
    for method, row in results["overhead"].items():
        lines.append(
            f"{method:<7} {row['static_tokens_per_s']:>12.0f}  {row['torchft_tokens_per_s']:>13.0f}"
            f"  {row['time_ratio']:.3f}"
        )
    kill = results["kill"]
    stalls = ", ".join(f"{s:.2f}" for s in kill["kill_to_next_commit_s"])
    round_s = "?" if kill["round_s"] is None else f"{kill['round_s']:.2f}"
    lines += [
        f"kill: SIGKILL to the survivors' next committed round {stalls} s (detection "
        f"{kill['detect_s']:g} s, one round {round_s} s)",
        f"heal: {kill['heal_bytes'] / 1e6:.2f} MB in {kill['heal_s']:.3f} s (bytes / "
        f"{bench.bandwidth_gbps:g} Gbit/s = {kill['bytes_over_bandwidth_s']:.3f} s); process "
        f"start to its first committed round {kill['start_to_first_commit_s']:.1f} s",
    ]
    return lines
