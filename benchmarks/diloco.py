"""Benchmark sweep of the DiLoCo family (issue 5) through the ``lowcomm train`` CLI.

Runs diloco, streaming_diloco (tau 1 and 5), diloco_delayed (default and lowered outer LR),
eager (1 and 2 outer steps) and cocodc at H in {16, 64}, equal tokens, several seeds, on the
virtual clock, and prints: final validation loss mean +- sd, steps to a target validation
loss, utilisation and modeled time on wan and slow-wan, bytes per worker.

Full scale:   python benchmarks/diloco.py
Reduced:      python benchmarks/diloco.py --steps 128 --seeds 0 1 --n-layer 2 --n-embd 128 --jobs 2
Utilisation and modeled time come from one run per (method, H) per network with seed 0.
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

VARIANTS: dict[str, list[str]] = {
    "diloco": ["--method", "diloco"],
    "streaming tau=1": ["--method", "streaming_diloco", "--diloco.overlap-steps", "1"],
    "streaming tau=5": ["--method", "streaming_diloco", "--diloco.overlap-steps", "5"],
    "delayed": ["--method", "diloco_delayed"],
    "delayed low lr": ["--method", "diloco_delayed", "--diloco.outer-lr", "0.35"],
    "eager N=1": ["--method", "eager", "--diloco.outer-delay", "1"],
    "eager N=2": ["--method", "eager", "--diloco.outer-delay", "2"],
    "cocodc": ["--method", "cocodc", "--diloco.overlap-steps", "5"],  # CoCoDC paper: tau 5
}


def run(out: Path, args: list[str]) -> dict[str, object]:
    summary = out / "summary.json"
    if not summary.exists():
        command = [sys.executable, "-m", "lowcomm", "train", "--out", str(out), *args]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
        if result.returncode != 0:
            return {"error": result.stderr.strip().splitlines()[-1] if result.stderr else "failed"}
    data: dict[str, object] = json.loads(summary.read_text())
    vals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    data["val_curve"] = [(r["step"], r["val_loss"]) for r in vals if r.get("val_loss") is not None]
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--syncs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--target", type=float, default=None, help="target val loss (default: worst final mean + 0.05)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_diloco"))
    options = parser.parse_args()
    common = [
        "--workers", str(options.workers), "--steps", str(options.steps),
        "--model.n-layer", str(options.n_layer), "--model.n-embd", str(options.n_embd),
        "--model.n-head", "4", "--model.block-size", "64", "--micro-batch-size", "8",
        "--eval-batches", "4", "--eval-every", str(max(1, options.steps // 16)),
        "--progress", "False", "--clock", "virtual",
    ]  # fmt: skip
    jobs: dict[tuple[str, int, int, str], list[str]] = {}
    for h in options.syncs:
        fragments = min(4, options.n_layer)
        for name, extra in VARIANTS.items():
            per_method = ["--diloco.sync-every", str(h)]
            if "streaming" in name or name == "cocodc":
                per_method += ["--diloco.fragments", str(fragments)]
            if name in ("cocodc", "streaming tau=5") and h // fragments <= 5:
                # tau must be < H/K: use the largest overlap the schedule allows (reported).
                per_method += ["--diloco.overlap-steps", str(h // fragments - 1)]
            for seed in options.seeds:
                jobs[(name, h, seed, "wan")] = [*common, *extra, *per_method, "--seed", str(seed), "--network", "wan"]
            jobs[(name, h, options.seeds[0], "slow-wan")] = [
                *common, *extra, *per_method, "--seed", str(options.seeds[0]), "--network", "slow-wan",
            ]  # fmt: skip
    with ThreadPoolExecutor(options.jobs) as pool:
        futures = {
            key: pool.submit(run, options.out / f"{key[0].replace(' ', '_').replace('=', '')}-H{key[1]}-s{key[2]}-{key[3]}", args)
            for key, args in jobs.items()
        }
        results = {key: future.result() for key, future in futures.items()}
    finals: dict[tuple[str, int], list[float]] = {}
    for (name, h, _seed, network), data in results.items():
        if "final_val_loss" in data and network == "wan":
            finals.setdefault((name, h), []).append(float(data["final_val_loss"]))  # type: ignore[arg-type]
    target = options.target
    if target is None and finals:
        target = max(statistics.mean(v) for v in finals.values()) + 0.05
    print(f"target val loss {target:.3f}; steps {options.steps}; seeds {options.seeds}; workers {options.workers}")
    header = "| method | H | final val loss (mean ± sd) | steps to target | util wan | time wan (s) | util slow-wan | time slow-wan (s) | bytes/worker |"
    print(header)
    print("|" + "---|" * 9)
    for (name, h), values in finals.items():
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        reach = []
        for seed in options.seeds:
            data = results.get((name, h, seed, "wan"), {})
            curve = [*data.get("val_curve", []), (options.steps - 1, data.get("final_val_loss"))]  # type: ignore[operator]
            hit = next((s + 1 for s, v in curve if v is not None and v <= target), None)  # type: ignore[operator]
            reach.append(str(hit) if hit else "-")
        wan = results[(name, h, options.seeds[0], "wan")]
        slow = results.get((name, h, options.seeds[0], "slow-wan"), {})
        print(
            f"| {name} | {h} | {statistics.mean(values):.3f} ± {sd:.3f} | {'/'.join(reach)} | "
            f"{wan['utilization']:.3f} | {wan['modeled_time_s']:.1f} | "
            f"{slow.get('utilization', float('nan')):.3f} | {slow.get('modeled_time_s', float('nan')):.1f} | "
            f"{wan['bytes_sent_per_worker'] / 1e6:.2f} MB |"
        )
    errors = {key: data["error"] for key, data in results.items() if "error" in data}
    for key, error in errors.items():
        print("failed:", key, error)


if __name__ == "__main__":
    main()
