"""Does the calibrated compute cost depend on where the workers run?

The same run, placed four ways, each measuring its own calibration (no ``--calibration``
file shared between them): diloco on 4 workers with ``--workers-per-process 1`` (a process
per worker) and 4 (all in one process), and cocodc on 2 workers of 2 ranks each,
``--worker-sharding replicate`` and ``fsdp``. Each placement runs ``--repeats`` times,
alternating; the per-micro-batch cost every run charged (``summary.json``'s
``compute_model.seconds_per_microbatch``), its modeled time and final loss are printed side by
side, with the ratio of the medians of each pair.

    python benchmarks/calibration_placement.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = (
    "--model.n-layer", "2", "--model.n-embd", "64", "--model.n-head", "2",
    "--steps", "4", "--eval-every", "100", "--eval-batches", "2", "--progress", "False",
    "--plot", "False", "--network", "wan", "--seed", "0",
)  # fmt: skip

PLACEMENTS: dict[str, tuple[str, ...]] = {
    "diloco, 4 processes": ("--method", "diloco", "--workers", "4", "--workers-per-process", "1"),
    "diloco, 1 process": ("--method", "diloco", "--workers", "4", "--workers-per-process", "4"),
    "cocodc 2x2, replicate": (
        "--method", "cocodc", "--workers", "2", "--ranks-per-worker", "2",
        "--worker-sharding", "replicate",
    ),
    "cocodc 2x2, fsdp": (
        "--method", "cocodc", "--workers", "2", "--ranks-per-worker", "2",
        "--worker-sharding", "fsdp",
    ),
}  # fmt: skip
PAIRS = (
    ("diloco, 1 process", "diloco, 4 processes"),
    ("cocodc 2x2, fsdp", "cocodc 2x2, replicate"),
)


def run(out: Path, args: tuple[str, ...]) -> dict[str, float]:
    command = [sys.executable, "-m", "lowcomm", "train", *MODEL, *args, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "cost_ms": 1e3 * float(summary["compute_model"]["seconds_per_microbatch"]),
        "modeled_s": float(summary["modeled_time_s"]),
        "loss": float(summary["final_train_loss"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in PLACEMENTS}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(options.repeats):
            for index, (name, args) in enumerate(PLACEMENTS.items()):
                out = Path(scratch) / f"{repeat}-{index}"
                results[name].append(run(out, args))
    print(f"{'placement':<24} {'ms per micro-batch (each run)':<32} {'modeled s':>10} {'loss':>8}")
    for name, runs in results.items():
        costs = " ".join(f"{r['cost_ms']:.1f}" for r in runs)
        modeled = statistics.median(r["modeled_s"] for r in runs)
        print(f"{name:<24} {costs:<32} {modeled:>10.4f} {runs[0]['loss']:>8.4f}")
    for first, second in PAIRS:
        a = statistics.median(r["cost_ms"] for r in results[first])
        b = statistics.median(r["cost_ms"] for r in results[second])
        print(f"{first} / {second}: {a / b:.3f} (medians {a:.1f} / {b:.1f} ms)")


if __name__ == "__main__":
    main()
