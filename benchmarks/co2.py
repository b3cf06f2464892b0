"""Benchmark of the local-update family (issue 4): DDP, Local SGD/AdamW, Overlap-Local-SGD,
SlowMo and CO2 at several tau, equal tokens, several seeds, plus CO2's ablations (no gap
penalty, no clipping: the analogue of the CO2 paper's Table 4).

Every run is ``lowcomm train`` on the virtual clock (CPU time per worker, so other processes on
the machine do not inflate it). The table reports final validation loss mean +- sd over seeds,
utilisation (compute / (compute + exposed communication)) and bytes sent per worker.

Full scale (the issue's): ``python benchmarks/co2.py --seeds 0 1 2``. Reduced scale used for
the closing note: see ``--help`` defaults and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    extra: tuple[str, ...] = ()
    uses_tau: bool = True


def variants(sgd_lr: float) -> list[Variant]:
    return [
        Variant("ddp", "ddp", uses_tau=False),
        # Plain SGD needs its own learning rate (AdamW's 1e-3 barely moves it).
        Variant("local_sgd", "local_sgd", ("--optim.lr", str(sgd_lr), "--local.sgd-momentum", "0.9")),
        Variant("local_adamw", "local_adamw"),
        Variant("overlap_local_adamw", "overlap_local_sgd"),
        Variant("slowmo", "slowmo"),
        Variant("co2", "co2"),
        Variant("co2 no penalty", "co2", ("--local.gap-penalty", "False")),
        Variant("co2 no clipping", "co2", ("--local.clip", "False")),
    ]


def run_one(variant: Variant, tau: int | None, seed: int, args: argparse.Namespace) -> dict[str, float]:
    name = f"{variant.label.replace(' ', '_')}-tau{tau}-s{seed}"
    out = Path(args.out) / name
    summary_path = out / "summary.json"
    if not summary_path.exists():
        command = [
            sys.executable, "-m", "lowcomm", "train", "--method", variant.method,
            "--steps", str(args.steps), "--workers", str(args.workers), "--seed", str(seed),
            "--network", args.network, "--clock", "virtual", "--progress", "False",
            "--eval-every", str(args.steps), "--eval-batches", str(args.eval_batches),
            "--model.n-layer", str(args.n_layer), "--model.n-embd", str(args.n_embd),
            "--model.n-head", str(args.n_head), "--model.block-size", str(args.block_size),
            "--micro-batch-size", str(args.micro_batch_size), "--out", str(out),
            *variant.extra,
        ]  # fmt: skip
        if tau is not None:
            command += ["--local.sync-every", str(tau)]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{result.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text())
    return {
        "val": float(summary["final_val_loss"]),
        "utilization": float(summary["utilization"]),
        "bytes": float(summary["bytes_sent_per_worker"]),
        "state": float(summary["state_bytes_per_worker"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--taus", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=96, help="a multiple of every tau")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--network", default="wan")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--sgd-lr", type=float, default=0.1)
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--out", default="runs/bench-co2")
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    args = parser.parse_args()

    jobs: list[tuple[Variant, int | None, int]] = []
    for variant in variants(args.sgd_lr):
        if args.only is not None and variant.label not in args.only:
            continue
        for tau in ([None] if not variant.uses_tau else args.taus):
            for seed in args.seeds:
                jobs.append((variant, tau, seed))
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(lambda job: run_one(*job, args), jobs))

    rows: dict[tuple[str, int | None], list[dict[str, float]]] = {}
    for (variant, tau, _), result in zip(jobs, results, strict=True):
        rows.setdefault((variant.label, tau), []).append(result)
    print(
        f"scale: {args.workers} workers, {args.steps} steps, n_layer {args.n_layer}, n_embd "
        f"{args.n_embd}, block {args.block_size}, micro-batch {args.micro_batch_size}, network "
        f"{args.network}, seeds {args.seeds}"
    )
    print("| method | tau | final val loss (mean +- sd) | utilisation | MB sent / worker | state MB / worker |")
    print("|---|---|---|---|---|---|")
    for (label, tau), runs in rows.items():
        vals = [r["val"] for r in runs]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        util = statistics.mean(r["utilization"] for r in runs)
        sent = statistics.mean(r["bytes"] for r in runs) / 1e6
        state = statistics.mean(r["state"] for r in runs) / 1e6
        print(
            f"| {label} | {'-' if tau is None else tau} | {statistics.mean(vals):.4f} +- {sd:.4f} "
            f"| {util:.3f} | {sent:.1f} | {state:.2f} |"
        )


if __name__ == "__main__":
    main()
