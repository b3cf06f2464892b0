"""DiLoCo against DDP as the workers grow, at equal tokens (issue 30's study).

For each worker count M (1, 2, 4, ... 64), ddp and diloco train the small model (2 layers,
width 64) on the same total token budget: the global batch is M micro-batches, so a run takes
``tokens / (M x micro-batch x context)`` steps. Every run charges one compute calibration
(measured once, before the first run) on the virtual clock of the ``wan`` link, and, with
``--in-process`` (the default), runs its M workers in one process (``--workers-per-process M``),
which is what lets 64 workers run on a laptop. Reported: final validation loss (mean ± sd over
seeds) and modeled time, per M and method, with a figure. A finished run is reused when the
script runs again (``run_or_resume``).

    python benchmarks/workers_sweep.py --out runs/workers-sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from lowcomm.bench.runs import STUDY_CALIBRATION, run_or_resume, study_calibration
from lowcomm.config import CommConfig, PlacementConfig, RunConfig, TrainConfig
from lowcomm.data import DataConfig, prepare_corpus
from lowcomm.models import ModelConfig


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32,64", help="worker counts M")
    parser.add_argument("--methods", default="ddp,diloco")
    parser.add_argument("--tokens", type=int, default=524_288, help="total token budget per run")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--network", default="wan")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--process-mode", action="store_true", help="a process per worker")
    parser.add_argument("--out", default="runs/workers-sweep")
    return parser.parse_args()


def config_for(args: argparse.Namespace, method: str, workers: int, seed: int) -> TrainConfig:
    """One run: ``workers`` workers on ``args.tokens`` tokens (rounded down to whole steps)."""
    per_step = workers * args.micro_batch_size * args.block_size
    steps = args.tokens // per_step
    if steps < 1:
        raise SystemExit(
            f"--tokens {args.tokens}: fewer than one step of {per_step} tokens at M={workers}"
        )
    per_process = 1 if args.process_mode else workers
    return TrainConfig(
        method=method,
        model=ModelConfig(n_layer=2, n_embd=64, n_head=2, block_size=args.block_size),
        data=DataConfig(micro_batch_size=args.micro_batch_size),
        placement=PlacementConfig(workers=workers, workers_per_process=per_process),
        run=RunConfig(
            steps=steps,
            seed=seed,
            eval_every=max(1, steps // 4),
            eval_batches=8,
            progress=False,
            out=str(Path(args.out) / "runs" / f"{method}-M{workers}-s{seed}"),
        ),
        comm=CommConfig(network=args.network),  # type: ignore[arg-type]
    )


def run(config: TrainConfig) -> dict[str, Any]:
    name = Path(str(config.run.out)).name
    error = run_or_resume(config, name, tag="workers-sweep")
    if error is not None:
        raise RuntimeError(f"{name} failed: {error}")
    summary: dict[str, Any] = json.loads((Path(str(config.run.out)) / "summary.json").read_text())
    return summary


def main() -> None:
    args = parse()
    out = Path(args.out)
    worker_counts = [int(w) for w in args.workers.split(",")]
    methods = args.methods.split(",")
    first = config_for(args, methods[0], worker_counts[0], 0)
    corpus = prepare_corpus(first.data)
    study = study_calibration(
        first, out / STUDY_CALIBRATION, vocab_size=corpus.vocab_size, option="--calibration",
        tag="workers-sweep",
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    for workers in worker_counts:
        for method in methods:
            summaries = []
            for seed in range(args.seeds):
                config = config_for(args, method, workers, seed)
                if study is not None:
                    config = study.apply(config)
                summaries.append(run(config))
            rows.append(row(method, workers, summaries))
            print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    figure(rows, out / "workers_sweep.png", args.network)
    (out / "report.md").write_text(report(args, rows, None if study is None else study))
    print((out / "report.md").read_text())


def row(method: str, workers: int, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [float(s["final_val_loss"]) for s in summaries]
    return {
        "method": method, "workers": workers, "steps": summaries[0]["steps"],
        "tokens": summaries[0]["committed_tokens"],
        "loss_mean": statistics.mean(losses),
        "loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "modeled_time_s": statistics.mean(float(s["modeled_time_s"]) for s in summaries),
        "bytes_per_worker": statistics.mean(float(s["bytes_sent_per_worker"]) for s in summaries),
        "wall_clock_s": statistics.mean(float(s["wall_clock_s"]) for s in summaries),
    }  # fmt: skip


def figure(rows: list[dict[str, Any]], path: Path, network: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ms = [r["workers"] for r in mine]
        loss_ax.errorbar(ms, [r["loss_mean"] for r in mine], yerr=[r["loss_sd"] for r in mine],
                         marker="o", capsize=3, label=method)  # fmt: skip
        time_ax.plot(ms, [r["modeled_time_s"] for r in mine], marker="o", label=method)
    for ax, label in (
        (loss_ax, "final validation loss"),
        (time_ax, f"modeled time on {network} (s)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers M (equal total tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    time_ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], study: Any) -> str:
    lines = [
        "# DiLoCo against DDP as the workers grow, at equal tokens",
        "",
        f"{args.tokens:,} tokens per run, split over M workers (global batch M x "
        f"{args.micro_batch_size} x {args.block_size} tokens), 2-layer GPT of width 64, "
        f"`{args.network}` on the virtual clock, {args.seeds} seed(s), each method at its "
        f"defaults; {'a process per worker' if args.process_mode else 'all M workers in one process'}.",
        "",
    ]
    if study is not None:
        lines += [study.describe("--calibration"), ""]
    lines += [
        "| M | method | steps | final val loss | modeled time | bytes/worker | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['method']} | {r['steps']} | {r['loss_mean']:.4f} ± "
            f"{r['loss_sd']:.4f} | {r['modeled_time_s']:.2f} s | "
            f"{r['bytes_per_worker'] / 1e6:.1f} MB | {r['wall_clock_s']:.0f} s |"
        )
    lines += ["", "![loss and modeled time against M](workers_sweep.png)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
