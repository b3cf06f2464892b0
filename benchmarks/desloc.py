"""DES-LOC family benchmark (issue 6): DDP, local_adam(K), desloc(K, 3K, 6K), favg_opt and
favg_reset at K in {16, 64}, equal tokens, several seeds; plus the join experiment (F4) and the
measured relative rate of change of the two Adam moments (F1).

Every training run goes through the ``lowcomm train`` CLI on the virtual clock (CPU time, so
other load on the machine does not inflate it). The table reports final validation loss
mean +- sd over seeds and bytes sent per worker relative to DDP.

F1 is measured in-process with the strategy API (the CLI's metrics do not carry step extras):
one worker (``LocalComm``), local Adam with betas (0.9, 0.999) and ADOPT (0.9, 0.9999), on the
same corpus and model; the number is the mean of ||s_{t+1} - s_t|| / ||s_t|| over the second
half of the steps.

Full scale (docs/ALGORITHMS.md §7.2) would be ``--workers 4 --steps 2000 --seeds 0 1 2 --n-layer 4
--n-embd 256``; the defaults below are the reduced scale that fits a shared 2-core machine.

    LOWCOMM_CACHE_DIR=/tmp/lcache_demo python benchmarks/desloc.py [--steps 256] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _scale_args(args: argparse.Namespace) -> list[str]:
    return [
        "--workers", str(args.workers), "--steps", str(args.steps),
        "--model.n-layer", str(args.n_layer), "--model.n-embd", str(args.n_embd),
        "--model.n-head", str(args.n_head), "--model.block-size", str(args.block_size),
        "--micro-batch-size", str(args.micro_batch_size), "--optim.lr", str(args.lr),
        "--optim.weight-decay", "0.0",
        "--eval-batches", str(args.eval_batches), "--eval-every", str(10 * args.steps),
        "--progress", "False", "--clock", "virtual",
    ]  # fmt: skip


def _configs(args: argparse.Namespace) -> list[tuple[str, str, int | None, list[str]]]:
    """(label, method, K, extra CLI args) of every run of the sweep."""
    runs: list[tuple[str, str, int | None, list[str]]] = [("ddp", "ddp", None, [])]
    for k in args.periods:
        period = ["--desloc.param-period", str(k)]
        runs += [
            ("local_adam", "local_adam", k, period),
            ("desloc", "desloc", k, period),  # K_u = 3K, K_v = 6K by default
            ("favg_opt", "favg_opt", k, period),
            ("favg_reset", "favg_reset", k, period),
        ]
    join_k = min(args.periods)
    join = ["--desloc.param-period", str(join_k), "--desloc.rejoin-rank", "1",
            "--desloc.rejoin-step", str(args.steps // 2)]  # fmt: skip
    runs += [
        ("join:desloc", "desloc", join_k, join),
        ("join:favg_opt", "favg_opt", join_k, join),
        ("join:local_adam", "local_adam", join_k, join),
    ]
    return runs


def _run(out_root: Path, label: str, method: str, k: int | None, extra: list[str], seed: int, scale: list[str]) -> dict[str, object]:
    out = out_root / f"{label.replace(':', '-')}-K{k}-s{seed}"
    summary_path = out / "summary.json"
    if not summary_path.exists():
        command = [sys.executable, "-m", "lowcomm", "train", "--method", method, "--seed", str(seed),
                   "--out", str(out), *scale, *extra]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{label} K={k} seed={seed} failed:\n{result.stderr[-2000:]}")
    summary: dict[str, object] = json.loads(summary_path.read_text())
    return summary


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}"


def measure_moment_change(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """F1: mean relative change of u and v per step, local Adam (0.9, 0.999) and ADOPT."""
    import torch

    from lowcomm.comm import LocalComm
    from lowcomm.config import TrainConfig
    from lowcomm.data import WorkerShard, prepare_corpus
    from lowcomm.models import ModelConfig, build_model
    from lowcomm.optim import AdamWConfig, ScheduleConfig
    from lowcomm.strategies import MicroBatchResult, StrategyContext
    from lowcomm.strategies.desloc import DeslocOptions, LocalAdamMethod

    torch.set_num_threads(1)
    config = TrainConfig()
    corpus = prepare_corpus(config.data)
    results: dict[str, tuple[float, float]] = {}
    for label, optimizer, betas in (("adam (0.9, 0.999)", "adam", (0.9, 0.999)), ("adopt (0.9, 0.9999)", "adopt", (0.9, 0.9999))):
        torch.manual_seed(0)
        model_config = ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size)
        model = build_model(model_config, corpus.vocab_size)
        shard = WorkerShard(corpus, rank=0, world_size=1, seq_len=args.block_size,
                            micro_batch_size=args.micro_batch_size, seed=0, split=config.data.split)  # fmt: skip
        context = StrategyContext(
            optim=AdamWConfig(lr=args.lr, weight_decay=0.0),
            schedule=ScheduleConfig(kind="cosine", warmup_steps=10),
            total_steps=args.f1_steps,
        )
        options = DeslocOptions(param_period=args.f1_steps + 1, optimizer=optimizer, betas=betas, track_state_change=True)  # type: ignore[arg-type]
        strategy = LocalAdamMethod(model, LocalComm(), context, options=options)

        def closure(model: torch.nn.Module = model, shard: WorkerShard = shard) -> MicroBatchResult:
            inputs, targets = shard.next_batch()
            _, loss = model(inputs, targets)
            assert loss is not None
            loss.backward()
            return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

        first, second = [], []
        for step in range(args.f1_steps):
            extras = strategy.step(closure).extras
            if step >= args.f1_steps // 2:
                first.append(extras["first_moment_change"])
                second.append(extras["second_moment_change"])
        results[label] = (statistics.mean(first), statistics.mean(second))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--periods", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=1)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--f1-steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-desloc"))
    parser.add_argument("--skip-f1", action="store_true")
    args = parser.parse_args()

    scale = _scale_args(args)
    configs = _configs(args)
    jobs = [(label, method, k, extra, seed) for label, method, k, extra in configs for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        summaries = list(
            pool.map(lambda job: _run(args.out, job[0], job[1], job[2], job[3], job[4], scale), jobs)
        )

    by_config: dict[tuple[str, int | None], list[dict[str, object]]] = {}
    for (label, _method, k, _extra, _seed), summary in zip(jobs, summaries, strict=True):
        by_config.setdefault((label, k), []).append(summary)
    ddp_bytes = statistics.mean(float(s["bytes_sent_per_worker"]) for s in by_config[("ddp", None)])  # type: ignore[arg-type]

    print(f"scale: {' '.join(scale)}; seeds {args.seeds}")
    print(f"{'method':<18} {'K':>4} {'final val loss':>20} {'bytes / DDP':>12} {'modeled time s':>15}")
    for (label, k), runs in by_config.items():
        losses = [float(s["final_val_loss"]) for s in runs]  # type: ignore[arg-type]
        sent = statistics.mean(float(s["bytes_sent_per_worker"]) for s in runs)  # type: ignore[arg-type]
        modeled = statistics.mean(float(s["modeled_time_s"]) for s in runs)  # type: ignore[arg-type]
        print(f"{label:<18} {k if k else '-':>4} {_mean_sd(losses):>20} {sent / ddp_bytes:>12.4f} {modeled:>15.2f}")
    if not args.skip_f1:
        print(f"\nF1: mean relative change per step over steps {args.f1_steps // 2}..{args.f1_steps - 1} (one worker)")
        for label, (first, second) in measure_moment_change(args).items():
            ratio = second / first if first > 0 else math.nan
            print(f"  {label:<20} u: {first:.4f}  v: {second:.4f}  v/u: {ratio:.3f}")


if __name__ == "__main__":
    main()
