"""Benchmark of hierarchical workers (issue 9): M=2 workers x R=2 ranks against M=4 flat
workers, same global batch and tokens (every process takes the same micro-batch size, so four
processes consume the same tokens per step either way), inner link ``datacenter``, outer link
``wan``, virtual clock; for ddp, diloco, eager and desloc.

Every run is a declared :class:`TrainConfig` run (or resumed) through lowcomm's one launch path
(``lowcomm.bench.runs.run_or_resume``, what ``lowcomm bench compare`` and ``lowcomm reproduce``
use), so a finished run is reused. The table reports utilisation (compute / (compute + exposed
communication)), modeled time, bytes each rank sent on the replica (inner) and the outer link,
exposed seconds per level, and the final validation loss.

Reduced scale used for docs/results/hierarchical.md: the defaults below (one seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from lowcomm.bench.runs import run_or_resume
from lowcomm.config import CommConfig, RunConfig, TrainConfig
from lowcomm.data import DataConfig
from lowcomm.models import ModelConfig
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions

METHODS = ("ddp", "diloco", "eager", "desloc")

#: (layout name, table label, workers, ranks per worker): four processes either way.
LAYOUTS = (("hier", "2 x 2", 2, 2), ("flat", "4 x 1", 4, 1))


def declared_runs(args: argparse.Namespace) -> list[tuple[str, str, TrainConfig]]:
    """The sweep: (method, layout label, configuration) per run."""
    base = TrainConfig(
        model=ModelConfig(
            n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size
        ),
        data=DataConfig(micro_batch_size=args.micro_batch_size),
        diloco=DiLoCoOptions(sync_every=args.sync_every),
        desloc=DeslocOptions(param_period=args.desloc_sync_every),
        run=RunConfig(
            steps=args.steps,
            seed=args.seed,
            progress=False,
            eval_every=args.steps,
            eval_batches=args.eval_batches,
        ),
        comm=CommConfig(network=args.network, clock="virtual", inner_network=args.inner_network),
    )
    runs = []
    for method in args.methods:
        for layout, label, workers, ranks in LAYOUTS:
            out = Path(args.out) / f"{method}-{layout}-s{args.seed}"
            config = dataclasses.replace(
                base,
                method=method,
                placement=dataclasses.replace(
                    base.placement, workers=workers, ranks_per_worker=ranks
                ),
                run=dataclasses.replace(base.run, out=str(out)),
            )
            runs.append((method, label, config))
    return runs


def run_one(config: TrainConfig) -> dict[str, float]:
    name = Path(str(config.run.out)).name
    error = run_or_resume(config, name, tag="hierarchical")
    if error is not None:
        raise RuntimeError(f"{name} failed: {error}")
    summary = json.loads((Path(str(config.run.out)) / "summary.json").read_text())
    levels = summary["levels"]
    return {
        "val": float(summary["final_val_loss"]),
        "utilization": float(summary["utilization"]),
        "time": float(summary["modeled_time_s"]),
        "tokens": float(summary["tokens"]),
        "replica_bytes": float(levels["inner"]["bytes_sent_per_rank"]),
        "outer_bytes": float(levels["outer"]["bytes_sent_per_rank"]),
        "replica_exposed": float(levels["inner"]["exposed_comm_s"]),
        "outer_exposed": float(levels["outer"]["exposed_comm_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    for method, label, config in declared_runs(args):
        r = run_one(config)
        print(
            f"| {method} | {label} | {r['utilization']:.3f} | {r['time']:.2f} "
            f"| {r['replica_bytes'] / 1e6:.2f} | {r['outer_bytes'] / 1e6:.2f} "
            f"| {r['replica_exposed']:.3f} | {r['outer_exposed']:.2f} | {int(r['tokens']):,} "
            f"| {r['val']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
