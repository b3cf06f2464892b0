"""``lowcomm demo``: DDP against DiLoCo on a slow link, on the same tokens, with a verdict.

A preset of ``lowcomm bench compare`` (:mod:`lowcomm.bench.compare`): the two methods train
the default model on the bundled corpus over the ``wan`` preset (1 Gbit/s, 10 ms), from the
same start and data order, on the same token budget, their workers threads of one process
(``--workers-per-process``), timed on the virtual clock charged from one compute calibration.
The output ends with three lines::

    ddp     modeled time 23.44 s, sent 1.1 GB per worker (1,067,065,344 B), final val loss 5.8288  (OUT/runs/ddp-s0)
    diloco  modeled time 13.50 s, sent 133.4 MB per worker (133,383,168 B), final val loss 6.0246  (OUT/runs/diloco-s0)
    diloco vs ddp: modeled time 0.576x, bytes 0.125x, loss +0.1958

each number read from the run's summary.json (the modeled times follow this machine's compute
calibration; bytes and losses do not). OUT also holds bench compare's report.md,
results.json and figures, and the verdict again as verdict.txt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowcomm.atomic import atomic_write_text
from lowcomm.config import TrainConfig

#: The reference and the low-communication method, in the verdict's order.
METHODS = ("ddp", "diloco")

#: The declared link both methods train over.
NETWORK = "wan"

#: glibc's largest mmap threshold on 64-bit systems (its dynamic threshold's ceiling).
DEMO_MMAP_THRESHOLD = 32 << 20


@dataclass(kw_only=True)
class DemoConfig:
    """Train DDP and DiLoCo over the wan link on the same tokens; print a three-line verdict
    (modeled time, bytes sent, final loss, and the ratios)."""

    out: str = "runs/demo"
    """Output directory: the two run directories under runs/, report.md, figures and
    verdict.txt. Finished runs there are reused."""

    steps: int = 48
    """DDP's optimizer steps; their tokens are both methods' budget."""

    workers: int = 4
    """Workers per run, all threads of one process."""

    sync_every: int = 8
    """DiLoCo's inner steps between two outer synchronisations (--diloco.sync-every)."""

    def __post_init__(self) -> None:
        for name, least in (("steps", 1), ("workers", 2), ("sync_every", 1)):
            value = getattr(self, name)
            if value < least:
                raise ValueError(
                    f"--{name.replace('_', '-')}: {value} is below {least}; pass {least} or more"
                )


def demo_train_config(demo: DemoConfig, base: TrainConfig | None = None) -> TrainConfig:
    """The training options both runs share: ``base`` (default: the defaults) on the wan link,
    the virtual clock, ``demo``'s steps, workers (in one process) and DiLoCo period."""
    base = TrainConfig() if base is None else base
    return dataclasses.replace(
        base,
        diloco=dataclasses.replace(base.diloco, sync_every=demo.sync_every),
        comm=dataclasses.replace(base.comm, network=NETWORK, clock="virtual"),
        run=dataclasses.replace(base.run, steps=demo.steps),
        placement=dataclasses.replace(
            base.placement, workers=demo.workers, workers_per_process=demo.workers
        ),
    )


def run_demo(demo: DemoConfig, base: TrainConfig | None = None) -> list[str]:
    """Run (or reuse) both runs through ``bench compare``; print and return the verdict."""
    from lowcomm.bench.compare import CompareBench, run_compare

    bench = CompareBench(
        methods=METHODS, out=demo.out, budget="tokens", train=demo_train_config(demo, base)
    )
    with _keep_freed_blocks():
        results = run_compare(bench)
    if results["failures"]:
        names = ", ".join(sorted(results["failures"]))
        raise RuntimeError(f"demo: the run(s) {names} failed; see {demo.out}/report.md")
    runs = {method: Path(results["methods"][method]["runs"][0]) for method in METHODS}
    summaries = {
        method: json.loads((run / "summary.json").read_text()) for method, run in runs.items()
    }
    lines = verdict(summaries, runs)
    heading = (
        f"verdict: {' vs '.join(METHODS)} on {NETWORK}, {demo.workers} workers, "
        f"{bench.token_budget():,} tokens each (report: {Path(demo.out) / 'report.md'})"
    )
    atomic_write_text(Path(demo.out) / "verdict.txt", "\n".join([heading, *lines]) + "\n")
    print(f"\n{heading}")
    print("\n".join(lines))
    return lines


@contextlib.contextmanager
def _keep_freed_blocks() -> Iterator[None]:
    """Leave freed blocks of up to 32 MiB in glibc's heaps, as glibc's own threshold does,
    instead of the in-process launcher's 1 MiB (:mod:`lowcomm.launch.heap`, which skips its
    own when ``MALLOC_MMAP_THRESHOLD_`` is set). 1 MiB bounds the memory of dozens of workers
    in one process; with the demo's few it only costs the kernel's mapping of fresh pages for
    every activation. The default demo, measured: 42 s of system time and a 1.1 GB peak with
    1 MiB, 4 s and 1.6 GB with this. A threshold the user set wins; the environment is
    restored afterwards."""
    import ctypes

    from lowcomm.launch.heap import _M_MMAP_THRESHOLD

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        yield
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to keep
        yield
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, DEMO_MMAP_THRESHOLD):
        yield
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(DEMO_MMAP_THRESHOLD)
    try:
        yield
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]


def verdict(summaries: dict[str, dict[str, Any]], runs: dict[str, Path]) -> list[str]:
    """The three lines: each method's modeled time, bytes sent per worker and final
    validation loss, with its run directory; then DiLoCo's ratios to DDP."""
    reference, method = METHODS
    width = max(len(name) for name in METHODS)
    lines = [
        f"{name.ljust(width)}  modeled time {s['modeled_time_s']:.2f} s, "
        f"sent {_human_bytes(s['bytes_sent_per_worker'])} per worker "
        f"({int(s['bytes_sent_per_worker']):,} B), final val loss {s['final_val_loss']:.4f}  "
        f"({runs[name]})"
        for name, s in summaries.items()
    ]
    ours, theirs = summaries[method], summaries[reference]
    lines.append(
        f"{method} vs {reference}: modeled time "
        f"{ours['modeled_time_s'] / theirs['modeled_time_s']:.3g}x, bytes "
        f"{ours['bytes_sent_per_worker'] / theirs['bytes_sent_per_worker']:.3g}x, loss "
        f"{ours['final_val_loss'] - theirs['final_val_loss']:+.4f}"
    )
    return lines


def _human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000:
            return f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
