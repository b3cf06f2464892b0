"""Benchmark of hierarchical workers (issue 9): M=2 workers x R=2 ranks against M=4 flat
workers, same global batch and tokens (every process takes the same micro-batch size, so four
processes consume the same tokens per step either way), inner link ``datacenter``, outer link
``wan``, virtual clock; for ddp, diloco, eager and desloc.

Every run is ``lowcomm train``. The table reports utilisation (compute / (compute + exposed
communication)), modeled time, bytes each rank sent on the inner and the outer link, exposed
seconds per level, and the final validation loss.

Reduced scale used for docs/results/hierarchical.md: the defaults below (one seed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

METHODS = ("ddp", "diloco", "eager", "desloc")


def run_one(method: str, layout: str, args: argparse.Namespace) -> dict[str, float]:
    hierarchical = layout == "hier"
    name = f"{method}-{layout}-s{args.seed}"
    out = Path(args.out) / name
    summary_path = out / "summary.json"
    if not summary_path.exists():
        command = [
            sys.executable, "-m", "lowcomm", "train", "--method", method,
            "--steps", str(args.steps), "--seed", str(args.seed),
            "--network", args.network, "--clock", "virtual", "--progress", "False",
            "--eval-every", str(args.steps), "--eval-batches", str(args.eval_batches),
            "--model.n-layer", str(args.n_layer), "--model.n-embd", str(args.n_embd),
            "--model.n-head", str(args.n_head), "--model.block-size", str(args.block_size),
            "--micro-batch-size", str(args.micro_batch_size), "--out", str(out),
            "--diloco.sync-every", str(args.sync_every),
            "--desloc.param-period", str(args.desloc_sync_every),
        ]  # fmt: skip
        if hierarchical:
            command += ["--workers", "2", "--ranks-per-worker", "2", "--inner-network", args.inner_network]
        else:
            command += ["--workers", "4"]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{result.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text())
    levels = summary["levels"]
    return {
        "val": float(summary["final_val_loss"]),
        "utilization": float(summary["utilization"]),
        "time": float(summary["modeled_time_s"]),
        "tokens": float(summary["tokens"]),
        "inner_bytes": float(levels["inner"]["bytes_sent_per_rank"]),
        "outer_bytes": float(levels["outer"]["bytes_sent_per_rank"]),
        "inner_exposed": float(levels["inner"]["exposed_comm_s"]),
        "outer_exposed": float(levels["outer"]["exposed_comm_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sync-every", type=int, default=12, help="H of diloco and eager")
    parser.add_argument("--desloc-sync-every", type=int, default=4, help="K_x of desloc")
    parser.add_argument("--network", default="wan", help="outer link")
    parser.add_argument("--inner-network", default="datacenter")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--out", default="runs/bench-hierarchical")
    args = parser.parse_args()

    print(
        f"scale: 4 processes (2 workers x 2 ranks, or 4 flat workers), {args.steps} steps, n_layer "
        f"{args.n_layer}, n_embd {args.n_embd}, block {args.block_size}, micro-batch "
        f"{args.micro_batch_size} per process, outer {args.network}, inner {args.inner_network}, "
        f"H {args.sync_every}, desloc K_x {args.desloc_sync_every}, seed {args.seed}, virtual clock"
    )
    print(
        "| method | layout | utilisation | modeled time (s) | inner MB / rank | outer MB / rank "
        "| inner exposed (s) | outer exposed (s) | tokens | final val loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        for layout, label in (("hier", "2 x 2"), ("flat", "4 x 1")):
            r = run_one(method, layout, args)
            print(
                f"| {method} | {label} | {r['utilization']:.3f} | {r['time']:.2f} "
                f"| {r['inner_bytes'] / 1e6:.2f} | {r['outer_bytes'] / 1e6:.2f} "
                f"| {r['inner_exposed']:.3f} | {r['outer_exposed']:.2f} | {int(r['tokens']):,} "
                f"| {r['val']:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
