"""Benchmark of the ACCO family (issue 3): zero1, dpu (W=0, W=W_late), wp and acco at equal
tokens, and the straggler case (one of 4 workers 4x slower), ACCO vs DDP.

Every run goes through the ``lowcomm train`` CLI on the virtual clock (CPU time of each worker,
so contention from other processes does not inflate it) and the table is read back from each
run's ``summary.json`` and ``metrics.jsonl``.

Equal tokens: every method takes 2 micro-batches per worker per committed step. zero1 uses
``--microbatches-per-step 2``; dpu and wp ``--acco.microbatches-per-phase 2`` (one phase per
step); acco ``--acco.microbatches-per-phase 1`` (two phases per step). The delayed methods also
take one initial gradient (1 or 2 micro-batches) at step 0. An adaptive ACCO row (accumulate
until communication is done, the paper's behaviour) is added; its token count is reported.

Usage (full scale of the issue: default model, 80 steps, 3 seeds, W=40):
    python benchmarks/acco.py --steps 80 --seeds 0 1 2 --warmup 40
Reduced scale used for the report:
    python benchmarks/acco.py --steps 40 --seeds 0 1 --warmup 20 \
        --scale --model.n-layer 2 --model.n-embd 64 --model.n-head 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _runs(steps: int, warmup: int) -> list[tuple[str, list[str]]]:
    return [
        ("zero1", ["--method", "zero1", "--microbatches-per-step", "2"]),
        ("dpu W=0", ["--method", "dpu", "--acco.microbatches-per-phase", "2",
                     "--microbatches-per-step", "2", "--acco.dpu-warmup-steps", "0"]),
        (f"dpu W={warmup}", ["--method", "dpu", "--acco.microbatches-per-phase", "2",
                             "--microbatches-per-step", "2", "--acco.dpu-warmup-steps", str(warmup)]),
        ("wp", ["--method", "wp", "--acco.microbatches-per-phase", "2",
                "--microbatches-per-step", "2"]),
        ("acco", ["--method", "acco", "--acco.microbatches-per-phase", "1"]),
        ("acco adaptive", ["--method", "acco"]),
    ]  # fmt: skip


def _train(label: str, args: list[str], out: Path) -> dict[str, object]:
    if not (out / "summary.json").exists():
        result = subprocess.run(
            [sys.executable, "-m", "lowcomm", "train", *args, "--out", str(out),
             "--progress", "False"],
            capture_output=True, text=True, env={**os.environ},
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"{label} failed:\n{result.stderr[-2000:]}")
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counts = [c for r in records for c in r["microbatches_per_worker"]]
    summary["microbatches_per_worker_step"] = sum(counts) / len(counts)
    slow = [r["microbatches_per_worker"][-1] for r in records]
    fast = [r["microbatches_per_worker"][0] for r in records]
    summary["fast_per_slow"] = sum(fast) / max(1, sum(slow))
    return summary


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup", type=int, default=40, help="W of the second dpu row")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--root", default="runs/bench-acco")
    parser.add_argument("--scale", nargs=argparse.REMAINDER, default=[],
                        help="extra lowcomm train arguments (model size ...), last")  # fmt: skip
    options = parser.parse_args()
    root = Path(options.root)
    common = ["--steps", str(options.steps), *options.scale]
    jobs: list[tuple[str, int, list[str], Path]] = []
    for label, args in _runs(options.steps, options.warmup):
        for seed in options.seeds:
            out = root / f"{label.replace(' ', '_').replace('=', '')}-s{seed}"
            jobs.append((label, seed, [*args, *common, "--seed", str(seed)], out))
    straggler = ["--workers", "4", "--speed-factors", "1", "1", "1", "4"]
    for label, args in (("ddp straggler", ["--method", "ddp"]),
                        ("acco straggler", ["--method", "acco"])):  # fmt: skip
        seed = options.seeds[0]
        out = root / f"{label.replace(' ', '_')}-s{seed}"
        jobs.append((label, seed, [*args, *straggler, *common, "--seed", str(seed)], out))

    with ThreadPoolExecutor(max_workers=options.parallel) as pool:
        results = list(pool.map(lambda job: (job[0], _train(job[0], job[2], job[3])), jobs))

    by_label: dict[str, list[dict[str, object]]] = {}
    for label, summary in results:
        by_label.setdefault(label, []).append(summary)

    print(f"steps {options.steps}, seeds {options.seeds}, scale {' '.join(options.scale) or 'default'}")
    print("| method | final val loss | utilization | modeled time s | real time s | tokens | "
          "bytes/worker MB | micro-batches/worker/step | state MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for label, summaries in by_label.items():
        if "straggler" in label:
            continue

        def column(key: str, rows: list[dict[str, object]] = summaries) -> list[float]:
            return [float(row[key]) for row in rows]  # type: ignore[arg-type]

        print(
            f"| {label} | {_mean_sd(column('final_val_loss'))} | "
            f"{statistics.mean(column('utilization')):.3f} | "
            f"{statistics.mean(column('modeled_time_s')):.2f} | "
            f"{statistics.mean(column('wall_clock_s')):.1f} | "
            f"{statistics.mean(column('tokens')):.0f} | "
            f"{statistics.mean(column('bytes_sent_per_worker')) / 1e6:.1f} | "
            f"{statistics.mean(column('microbatches_per_worker_step')):.2f} | "
            f"{statistics.mean(column('state_bytes_per_worker')) / 1e6:.2f} |"
        )
    print()
    print("| straggler (1 of 4 workers 4x slower) | tokens / modeled s | utilization | "
          "fast-worker micro-batches per slow-worker micro-batch | final val loss |")  # fmt: skip
    print("|---|---|---|---|---|")
    for label, summaries in by_label.items():
        if "straggler" not in label:
            continue
        row = summaries[0]
        rate = float(row["tokens"]) / float(row["modeled_time_s"])  # type: ignore[arg-type]
        print(
            f"| {label} | {rate:.0f} | {float(row['utilization']):.3f} | "  # type: ignore[arg-type]
            f"{float(row['fast_per_slow']):.2f} | {float(row['final_val_loss']):.4f} |"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
