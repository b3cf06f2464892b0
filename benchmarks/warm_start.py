"""Warm-start benchmark (issue 16): the protocol of the DiLoCo and eager papers at CPU scale.

1. Pretrain with ``ddp`` on ``wan`` and keep the model (``OUT/model/``, every run writes it).
2. From that model (``--init-from``), run ddp, diloco, streaming_diloco, eager and cocodc for
   the same number of steps, each with its default options, for several seeds (the seed
   changes the data order; the starting weights are the pretrained ones). Report the final
   validation loss (mean ± sd) and the modeled time.
3. The same DiLoCo from random initialisation, for contrast: is the default outer step
   (Nesterov, lr 0.7, momentum 0.9) stable from the warm start where it is not from scratch?
4. fp32 against ``--precision bf16-mixed`` on the default run (the default model and
   workers, fewer steps): final loss, tokens per second of wall time and per CPU second of
   compute on this machine, state bytes per worker.

Every run goes through lowcomm's one launch path (``lowcomm.bench.runs.run_or_resume``), so a
finished run is reused when the script is run again. Defaults: the scale of
docs/results/warm-start.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from lowcomm.bench.runs import run_or_resume
from lowcomm.config import (
    CommConfig,
    NumericsConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
    with_options,
)
from lowcomm.data import DataConfig
from lowcomm.models import ModelConfig

METHODS = ("ddp", "diloco", "streaming_diloco", "eager", "cocodc")


def _run(config: TrainConfig) -> dict[str, Any]:
    name = Path(str(config.run.out)).name
    error = run_or_resume(config, name, tag="warm-start")
    if error is not None:
        raise RuntimeError(f"{name} failed: {error}")
    summary: dict[str, Any] = json.loads((Path(str(config.run.out)) / "summary.json").read_text())
    return summary


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def small(args: argparse.Namespace, **changes: Any) -> TrainConfig:
    """The reduced-scale run every comparison uses."""
    base = TrainConfig(
        model=ModelConfig(
            n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size
        ),
        data=DataConfig(micro_batch_size=args.micro_batch_size),
        placement=PlacementConfig(workers=args.workers),
        comm=CommConfig(network="wan", clock="virtual"),
        run=RunConfig(progress=False, eval_every=args.steps, eval_batches=args.eval_batches),
    )
    return with_options(base, **changes)


def warm_start(args: argparse.Namespace, out: Path) -> None:
    pretrain = out / "pretrain"
    _run(small(args, method="ddp", steps=args.pretrain_steps, seed=0, out=str(pretrain)))
    start = json.loads((pretrain / "summary.json").read_text())["final_val_loss"]
    tokenizer = str(pretrain / "model" / "tokenizer.json")
    print(f"pretrained: ddp, {args.pretrain_steps} steps, final val loss {start:.3f}\n")
    print("| method | start | final val loss (mean ± sd) | per seed | modeled time (s) |")
    print("|---|---|---|---|---|")
    # (row label, method, DiLoCo H or None for the method's default, start)
    rows = [(method, method, None, "warm") for method in METHODS]
    rows += [("ddp", "ddp", None, "random"), ("diloco", "diloco", None, "random")]
    h = args.short_sync
    rows += [(f"diloco H={h}", "diloco", h, "warm"), (f"diloco H={h}", "diloco", h, "random")]
    for label, method, sync_every, start_from in rows:
        losses, times = [], []
        for seed in args.seeds:
            changes: dict[str, Any] = {}
            if start_from == "warm":
                changes = {"init_from": str(pretrain)}
                changes["data"] = dataclasses.replace(small(args).data, tokenizer=tokenizer)
            if sync_every is not None:
                changes["diloco"] = dataclasses.replace(small(args).diloco, sync_every=sync_every)
            name = label.replace(" ", "-").replace("=", "")
            run = small(
                args, method=method, steps=args.steps, seed=seed,
                out=str(out / f"{name}-{start_from}-s{seed}"), **changes,
            )  # fmt: skip
            summary = _run(run)
            losses.append(float(summary["final_val_loss"]))
            times.append(float(summary["modeled_time_s"]))
        start = "pretrained" if start_from == "warm" else "random init"
        each = " / ".join(f"{loss:.3f}" for loss in losses)
        print(
            f"| {label} | {start} | {_mean_sd(losses)} | {each} | {_mean_sd(times)} |",
            flush=True,
        )


def precision(args: argparse.Namespace, out: Path) -> None:
    print(
        f"\nfp32 against bf16-mixed on the default run (default model and workers), "
        f"{args.precision_steps} steps, seed 0:\n"
    )
    print(
        "| precision | final val loss | tokens / s (wall) | tokens / CPU s (compute) "
        "| state bytes / worker | wall (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("fp32", "bf16-mixed"):
        config = TrainConfig(
            run=RunConfig(
                steps=args.precision_steps,
                eval_every=args.precision_steps,
                progress=False,
                out=str(out / f"default-{name}"),
            ),
            numerics=NumericsConfig(precision=name),
        )
        summary = _run(config)
        wall = float(summary["wall_clock_s"])
        tokens = float(summary["tokens"])
        compute = sum(float(s) for s in summary["per_worker"]["compute_s"])
        print(
            f"| {name} | {float(summary['final_val_loss']):.4f} | {tokens / wall:,.0f} "
            f"| {tokens / compute:,.0f} | {int(summary['state_bytes_per_worker']):,} "
            f"| {wall:.1f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=96, help="steps of every warm-start run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--short-sync", type=int, default=8, help="DiLoCo H of the extra rows")
    parser.add_argument("--precision-steps", type=int, default=20)
    parser.add_argument("--out", default="runs/bench-warm-start")
    args = parser.parse_args()
    out = Path(args.out)
    print(
        f"scale: {args.workers} workers, GPT {args.n_layer} layers x {args.n_embd} wide, block "
        f"{args.block_size}, micro-batch {args.micro_batch_size}, wan, virtual clock; pretrain "
        f"{args.pretrain_steps} steps, warm-start runs {args.steps} steps, seeds {args.seeds}\n"
    )
    warm_start(args, out)
    precision(args, out)


if __name__ == "__main__":
    main()
