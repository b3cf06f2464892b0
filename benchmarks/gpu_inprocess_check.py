"""GPU check of K workers sharing one GPU in one process (issue 30, item 5).

Run on a machine with one GPU, from the repository root (no network access needed; the
bundled corpus's tokenizer is trained on first use, cached in ``$LOWCOMM_CACHE_DIR`` or
``~/.cache/lowcomm``)::

    python3 benchmarks/gpu_inprocess_check.py [--out DIR]     # (imports lowcomm from ./src)

Checks, each reported PASS or FAIL, then a summary (exit status 0 only if all pass):

1. ``refusal``: 64 workers of a 200M-parameter GPT on the GPU are refused before any starts, in
   one line with the estimate, the free memory and the largest number that fits.
2. ``equal-<method>`` for ddp, diloco, acco: 4 workers in one process on cuda equal 4 workers
   in one process on cpu: losses to float tolerance (``--tf32 False``; relative 1e-3, the
   largest difference is printed), bytes exactly, modeled time to 1e-9 s (declared cost per
   micro-batch on the virtual clock), and the GPU's peak memory is reported with the
   estimate.
3. ``equal-hierarchical-diloco``: 2 workers x 2 ranks (4 rank threads) on cuda equal cpu.
4. ``dropout``: dropout 0.1 on cuda, run twice, gives the same losses (each worker's masks from
   its own CUDA generator) and not those of dropout 0.
5. ``real-clock``: ddp on the real clock (CUDA timing events per worker) finishes and reports
   compute time.

``--dry-run-on-cpu`` runs the same script with the CPU standing in for the GPU (and the
device-memory queries faked), to check the script itself on a machine without one.
Everything runs through lowcomm's launch path (``run_training``) with its workers as threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: A check that has not started by then is skipped (the whole script should take < 3 min).
BUDGET_S = 170.0
LOSS_RTOL = 1e-3
TIME_ATOL = 1e-9


class _Placeholder:
    """Any attribute, any call: what a tyro annotation needs to exist."""

    def __getattr__(self, name: str) -> _Placeholder:
        return self

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return self


def _stand_in_tyro() -> None:
    """lowcomm's configs carry tyro annotations for its command line; this script builds
    them in Python, so where tyro is not installed a stand-in module satisfies the imports."""
    try:
        import tyro  # noqa: F401
    except ImportError:
        module = types.ModuleType("tyro")
        module.conf = _Placeholder()  # type: ignore[attr-defined]
        module.cli = _Placeholder()  # type: ignore[attr-defined]
        sys.modules["tyro"] = module
        print("note: tyro is not installed; a stand-in serves its annotations", flush=True)


def _find_lowcomm() -> None:
    """Import lowcomm from this checkout's src/ (the code beside the script), whatever is
    installed."""
    source = Path(__file__).resolve().parents[1] / "src"
    if (source / "lowcomm").is_dir():
        sys.path.insert(0, str(source))


_stand_in_tyro()
_find_lowcomm()

import torch  # noqa: E402

from lowcomm.config import (  # noqa: E402
    CommConfig,
    ConfigError,
    NumericsConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
)
from lowcomm.data import DataConfig  # noqa: E402
from lowcomm.launch.run import run_training  # noqa: E402
from lowcomm.models import ModelConfig  # noqa: E402
from lowcomm.optim import AdamWConfig  # noqa: E402
from lowcomm.strategies.acco import AccoOptions  # noqa: E402
from lowcomm.strategies.diloco import DiLoCoOptions  # noqa: E402

GIB = 1024**3


class Report:
    """Each check's outcome and details, printed as they come and summarised at the end."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []
        self.start = time.perf_counter()

    def run(self, name: str, check: Callable[[], str]) -> None:
        elapsed = time.perf_counter() - self.start
        if elapsed > BUDGET_S:
            self._record(name, "SKIP", f"time budget spent ({elapsed:.0f} s)", 0.0)
            return
        print(f"--- {name}", flush=True)
        begin = time.perf_counter()
        try:
            detail = check()
            status = "PASS"
        except AssertionError as failure:
            status, detail = "FAIL", f"{failure}"
        except BaseException as error:  # (a crash of one check must not end the others)
            status = "FAIL"
            detail = f"{type(error).__name__}: {error}".splitlines()[0]
            traceback.print_exc()
        self._record(name, status, detail, time.perf_counter() - begin)

    def _record(self, name: str, status: str, detail: str, seconds: float) -> None:
        self.results.append({"check": name, "status": status, "detail": detail, "s": seconds})
        print(f"{status} {name} ({seconds:.1f} s): {detail}", flush=True)

    def summary(self) -> int:
        print("\n=== summary " + "=" * 60)
        for result in self.results:
            print(f"{result['status']:4}  {result['check']:28} {result['detail']}")
        failed = [r for r in self.results if r["status"] != "PASS"]
        total = time.perf_counter() - self.start
        verdict = "PASS" if not failed else "FAIL"
        print(f"=== {verdict}: {len(self.results) - len(failed)}/{len(self.results)} checks "
              f"passed in {total:.0f} s")  # fmt: skip
        return 0 if not failed else 1


def base_config(out: Path, method: str, device: str, workers: int = 4) -> TrainConfig:
    """A small deterministic run: declared cost per micro-batch on the virtual clock."""
    return TrainConfig(
        method=method,
        model=ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32),
        data=DataConfig(micro_batch_size=4),
        optim=AdamWConfig(lr=3e-3),
        diloco=DiLoCoOptions(sync_every=4, overlap_steps=1),
        acco=AccoOptions(dpu_warmup_steps=2),
        placement=PlacementConfig(
            workers=workers,
            workers_per_process=workers,
            device=device,  # type: ignore[arg-type]
        ),
        run=RunConfig(
            steps=8,
            seed=0,
            eval_every=4,
            eval_batches=4,
            progress=False,
            out=str(out),
            overwrite=True,
        ),
        comm=CommConfig(
            network="wan", clock="virtual", seconds_per_microbatch=0.05, collective_timeout_s=60.0
        ),
        numerics=NumericsConfig(tf32=False),
    )


def steps_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def compare(got_dir: Path, want_dir: Path, got: dict[str, Any], want: dict[str, Any]) -> str:
    """Assert the two runs agree (losses to LOSS_RTOL, bytes exactly, times to TIME_ATOL);
    return the largest relative loss difference."""
    a_steps, b_steps = steps_of(got_dir), steps_of(want_dir)
    assert [s["step"] for s in a_steps] == [s["step"] for s in b_steps], "different steps"
    worst = 0.0
    for a, b in zip(a_steps, b_steps, strict=True):
        for name in ("train_loss", "val_loss"):
            x, y = a[name], b[name]
            if x is None or y is None:
                assert x is None and y is None, f"step {a['step']} {name}: {x} vs {y}"
                continue
            worst = max(worst, abs(x - y) / abs(y))
            assert math.isclose(x, y, rel_tol=LOSS_RTOL), f"step {a['step']} {name}: {x} vs {y}"
        assert abs(a["clock_s"] - b["clock_s"]) <= TIME_ATOL, f"step {a['step']} clock_s"
        assert a["bytes_sent_per_worker"] == b["bytes_sent_per_worker"], f"step {a['step']} bytes"
        assert a["microbatches_per_worker"] == b["microbatches_per_worker"], "micro-batches"
    assert math.isclose(got["final_val_loss"], want["final_val_loss"], rel_tol=LOSS_RTOL)
    for key in ("bytes_sent_per_worker", "bytes_by_role", "tokens"):
        assert got[key] == want[key], f"{key}: {got[key]} vs {want[key]}"
    assert abs(got["modeled_time_s"] - want["modeled_time_s"]) <= TIME_ATOL, "modeled time"
    return f"max relative loss difference {worst:.2e}"


class Checks:
    def __init__(self, out: Path, gpu: str, dry_run: bool) -> None:
        self.out, self.gpu, self.dry_run = out, gpu, dry_run
        self.peaks: dict[str, float] = {}

    def train(self, config: TrainConfig) -> dict[str, Any]:
        summary = run_training(config, report=None)
        assert summary is not None, "no summary"
        return summary

    def refusal(self) -> str:
        """64 workers of a ~200M-parameter GPT cannot share the GPU."""
        config = base_config(self.out / "refusal", "ddp", self.gpu, workers=64)
        config.model = ModelConfig(n_layer=4, n_head=16, n_embd=2048, block_size=32)
        if self.dry_run:
            return _dry_refusal(config)
        try:
            self.train(config)
        except ConfigError as error:
            return _checked_refusal(str(error))
        raise AssertionError("64 workers of 200M parameters were not refused")

    def equal(self, method: str, ranks: int = 1) -> str:
        name = method if ranks == 1 else f"hier-{method}"
        workers = 4 if ranks == 1 else 2
        runs = {}
        for device in (self.gpu, "cpu"):
            config = base_config(self.out / f"{name}-{device}", method, device, workers)
            config.placement.ranks_per_worker = ranks
            runs[device] = self.train(config)
        gpu, cpu = runs[self.gpu], runs["cpu"]
        detail = compare(self.out / f"{name}-{self.gpu}", self.out / f"{name}-cpu", gpu, cpu)
        peak = gpu.get("peak_device_memory_bytes_per_worker")
        if self.gpu == "cuda":
            assert peak, "summary.json has no peak_device_memory_bytes_per_worker"
            self.peaks[name] = float(peak)
            detail += f"; GPU peak {peak / 2**20:.1f} MiB (all {workers * ranks} threads)"
        return detail

    def dropout(self) -> str:
        losses = []
        for tag, dropout in (("a", 0.1), ("b", 0.1), ("none", 0.0)):
            config = base_config(self.out / f"dropout-{tag}", "ddp", self.gpu)
            config.model = dataclasses.replace(config.model, dropout=dropout)
            self.train(config)
            losses.append([s["train_loss"] for s in steps_of(self.out / f"dropout-{tag}")])
        first, again, none = losses
        worst = max(abs(x - y) / abs(y) for x, y in zip(first, again, strict=True))
        assert worst <= 1e-5, f"a rerun moved the losses by {worst:.2e} (masks not per worker?)"
        drop = max(abs(x - y) / abs(y) for x, y in zip(first, none, strict=True))
        assert drop > 1e-3, f"dropout 0.1 changed the losses by {drop:.2e} only"
        return f"rerun differs by {worst:.2e}; dropout 0 differs by {drop:.2e}"

    def real_clock(self) -> str:
        config = base_config(self.out / "real", "ddp", self.gpu)
        config.comm.clock, config.comm.seconds_per_microbatch = "real", None
        summary = self.train(config)
        assert summary["compute_s"] > 0, f"compute_s {summary['compute_s']}"
        return f"compute {summary['compute_s']:.3f} s, modeled {summary['modeled_time_s']:.3f} s"


def _checked_refusal(message: str) -> str:
    assert "\n" not in message, f"not one line: {message!r}"
    assert message.startswith("--workers-per-process: 64 workers on "), message
    for part in ("need about", " each: parameters", " are free", "fit"):
        assert part in message, f"{part!r} missing from: {message}"
    print(f"refusal: {message}", flush=True)
    return message[: message.index("(")].strip() + " ... " + message[message.index("but") :]


def _dry_refusal(config: TrainConfig) -> str:
    """On the CPU: the same estimate and refusal, the device's queries faked (40 GiB free,
    1 GiB of activations)."""
    from lowcomm.launch import device_memory
    from lowcomm.models import build_model

    config.placement.device = "cuda"
    model = build_model(config.model, vocab_size=2048)
    try:
        device_memory.check_device_memory(
            config, model, lambda m: torch.zeros(()), torch.device("cuda", 0),
            free_bytes=lambda device: 40.0 * GIB, measure=lambda *args: GIB,
        )  # fmt: skip
    except ConfigError as error:
        return _checked_refusal(str(error))
    raise AssertionError("not refused")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--dry-run-on-cpu", action="store_true", help="the CPU plays the GPU")
    args = parser.parse_args()
    report = Report()
    gpu = "cpu" if args.dry_run_on_cpu else "cuda"
    if gpu == "cuda" and not torch.cuda.is_available():
        print("FAIL: no GPU visible (torch.cuda.is_available() is False)")
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="lowcomm-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, device {_device_name(gpu)}, runs in {out}", flush=True)
    checks = Checks(out, gpu, args.dry_run_on_cpu)
    report.run("refusal", checks.refusal)
    for method in ("ddp", "diloco", "acco"):
        report.run(f"equal-{method}", lambda method=method: checks.equal(method))
    report.run("equal-hierarchical-diloco", lambda: checks.equal("diloco", ranks=2))
    report.run("dropout", checks.dropout)
    report.run("real-clock", checks.real_clock)
    status = report.summary()
    (out / "gpu_check.json").write_text(
        json.dumps({"results": report.results, "peaks": checks.peaks}, indent=1)
    )
    return status


def _device_name(gpu: str) -> str:
    if gpu != "cuda":
        return "cpu (dry run)"
    free, total = torch.cuda.mem_get_info()
    return f"{torch.cuda.get_device_name()} ({free / GIB:.1f} of {total / GIB:.1f} GiB free)"


if __name__ == "__main__":
    sys.exit(main())
