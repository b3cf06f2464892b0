"""Helpers shared by the tests that run one declared fault trace in two placements (every
worker a thread of one process against several workers a process, a process per worker or
per rank, or torchrun's processes) and hold the numbers of one to those of the other."""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _cli import torchrun
from lowcomm.config import TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.launch.run import run_training
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions

#: The steps of every run of :func:`tiny_config`.
STEPS = 8

#: A run's records (its metrics.jsonl, a line a step) and its summary.
Run = tuple[list[dict[str, Any]], dict[str, Any]]


def tiny_config(method: str, out: Path, trace: Path, **options: Any) -> TrainConfig:
    """``method`` on a 1-layer GPT 32 wide (16-token blocks, micro-batches of 2; diloco's and
    the local methods' rounds of 2 steps) for :data:`STEPS` steps on `wan` on the virtual
    clock at 0.01 s per micro-batch, validated on 4 batches every 4 steps, a record every
    step, the faults of ``trace`` detected after 2.5 s. ``options`` (named as
    :func:`with_options` names them) place the workers and override the rest."""
    defaults: dict[str, Any] = {
        "steps": STEPS, "network": "wan", "clock": "virtual", "seconds_per_microbatch": 0.01,
        "eval_every": 4, "eval_batches": 4, "log_every": 1, "progress": False, "plot": False,
        "out": str(out), "faults": str(trace), "fault_detection_s": 2.5,
    }  # fmt: skip
    return with_options(
        TrainConfig(
            method=method,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=2),
            local=LocalOptions(sync_every=2),
        ),
        **{**defaults, **options},
    )


def trace_file(tmp_path: Path, text: str) -> Path:
    """``text`` written as ``tmp_path / "trace.txt"``."""
    path = tmp_path / "trace.txt"
    path.write_text(text)
    return path


def generated_faults(config: TrainConfig) -> TrainConfig:
    """``config`` (changed in place) with a generated trace instead of its trace file: an MTBF
    of 0.2 s per worker, a replacement 0.05 s after each crash, 40% of the slots 3x slow
    (seed 1), crashes detected after 0.05 s: several crashes and joins within 8 steps."""
    fault = config.fault
    fault.faults, fault.fault_mtbf_s, fault.fault_replace_after_s = None, 0.2, 0.05
    fault.fault_slow_fraction, fault.fault_slow_factor, fault.fault_seed = 0.4, 3.0, 1
    fault.fault_detection_s = 0.05
    return config


def records(out: Path) -> list[dict[str, Any]]:
    """The records of the run in ``out``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trained(config: TrainConfig) -> Run:
    """``config`` trained to its end: its records and summary."""
    summary = run_training(config, report=None)
    assert summary is not None
    return records(Path(str(config.run.out))), summary


def stopped_and_resumed(config: Callable[[], TrainConfig]) -> Run:
    """The run of ``config()`` stopped after step 3, with a checkpoint, and then resumed from
    its directory by a second ``config()``."""
    first = config()
    first.run.stop_after = 3
    assert run_training(first, report=None) is None  # (stopped, with a checkpoint)
    resumed = config()
    resumed.run.resume = str(resumed.run.out)
    return trained(resumed)


def under_torchrun(
    tmp_path: Path, trace: Path, *flags: str, processes: int, eval_batches: int = 4
) -> Run:
    """:func:`tiny_config`'s diloco run of ``trace`` (on ``eval_batches`` batches; ``flags``
    place its workers) launched by torchrun in ``processes`` processes, out in ``tmp_path /
    "torchrun"``: its records and summary."""
    out = tmp_path / "torchrun"
    command = [
        "train", "--method", "diloco", "--steps", str(STEPS), "--network", "wan",
        "--clock", "virtual", "--seconds-per-microbatch", "0.01", "--eval-every", "4",
        "--eval-batches", str(eval_batches), "--log-every", "1", "--progress", "False",
        "--plot", "False", "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "32",
        "--model.block-size", "16", "--micro-batch-size", "2", "--diloco.sync-every", "2",
        *flags, "--faults", str(trace), "--fault-detection-s", "2.5", "--out", str(out),
    ]  # fmt: skip
    launched = subprocess.run(
        [*torchrun(tmp_path), "--standalone", "--nproc-per-node", str(processes), "-m",
         "lowcomm", *command],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    return records(out), json.loads((out / "summary.json").read_text())


def close(a: float | None, b: float | None, *, nan_equal: bool = True) -> bool:
    """Whether two losses agree to 1e-6: both None agree, and both NaN where ``nan_equal``."""
    if a is None or b is None:
        return a is None and b is None
    if nan_equal and math.isnan(a) and math.isnan(b):
        return True
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def same_numbers(got: Run, want: Run, *, nan_equal: bool = True) -> None:
    """Per-step losses to 1e-6 (:func:`close`), modeled times to 1e-9 s, the same quorums,
    membership events, dropped rounds and bytes, and the same summary: its faults block (its
    floats to 1e-9), final loss, times and committed tokens."""
    (steps, summary), (want_steps, expected) = got, want
    assert [r["step"] for r in steps] == [r["step"] for r in want_steps] == list(range(STEPS))
    for g, w in zip(steps, want_steps, strict=True):
        for name in ("train_loss", "val_loss"):
            assert close(g[name], w[name], nan_equal=nan_equal), (name, g, w)
        assert abs(g["clock_s"] - w["clock_s"]) <= 1e-9, (g, w)
        for name in ("quorum", "membership_events", "dropped", "bytes_sent_per_worker"):
            assert g.get(name) == w.get(name), (name, g, w)
    assert summary["faults"].keys() == expected["faults"].keys()
    for key, value in expected["faults"].items():
        if isinstance(value, float):
            assert math.isclose(summary["faults"][key], value, rel_tol=1e-9, abs_tol=1e-9), key
        else:
            assert summary["faults"][key] == value, key
    final = (summary["final_val_loss"], expected["final_val_loss"])
    assert close(*final, nan_equal=nan_equal)
    for name in ("modeled_time_s", "compute_s", "exposed_comm_s"):
        assert abs(summary[name] - expected[name]) <= 1e-9, name
    assert summary["committed_tokens"] == expected["committed_tokens"]
