"""Regression tier: every registered method's exact trajectory on one tiny run, pinned.

Each method in the registry (``lowcomm.strategies.STRATEGIES``, discovered, never listed here)
trains 8 steps of a tiny GPT on 2 Gloo workers, with a fixed seed and a declared cost per
micro-batch on the virtual clock, so the run is deterministic. Its per-step loss, learning
rate, modeled time and bytes, and at the end each worker's clock, bytes by role and a
fingerprint of the deployed parameters (what validation runs on) are compared with
``tests/regression/<method>.json``: losses to 1e-6 relative, bytes exactly, times to 1e-9 s.
Three hierarchical runs (2 workers x 2 ranks: ddp, diloco, streaming_diloco) are pinned the
same way.

All methods run in one pair of worker processes (one spawn, to keep the tier fast; the
hierarchical runs in one spawn of four). Every pinned run is also run with its workers as
threads of the test's process (``--workers-per-process``, hierarchical ranks as threads too)
against the same pins.

A method whose numbers move fails here. If the change is intended, regenerate and commit the
files with a message that says why the numbers moved::

    make regen-regression      # = LOWCOMM_REGEN=1 pytest tests/test_regression.py
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lowcomm.comm.torch_comm import TorchComm
from lowcomm.config import CommConfig, PlacementConfig, RunConfig, TrainConfig
from lowcomm.data import DataConfig
from lowcomm.launch import spawn_workers
from lowcomm.models import ModelConfig
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.acco import AccoOptions
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.decoupled_diloco import DecoupledOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions
from lowcomm.train.loop import WorkerSummary
from lowcomm.train.rundir import run_directory

pytestmark = pytest.mark.regression

STORE = Path(__file__).resolve().parent / "regression"
REGEN = os.environ.get("LOWCOMM_REGEN") == "1"
LOSS_RTOL = 1e-6
#: Pins whose arithmetic runs in bfloat16 on the CPU (Muon's Newton-Schulz, as the reference
#: computes it): a CPU with avx512_bf16 rounds those matmuls differently from one without, so
#: the same commit moved diloco_muon's losses by 1.3e-6 and its deployed parameters by 1.2e-5
#: of their absolute sum between two machines of this project. Still pinned, at a
#: tolerance that separates that from a change of the method. The same holds for the
#: --precision bf16-mixed pins (test_regression_precision.py), whose autocast matmuls run in
#: bfloat16: diloco-bf16 moved by 1e-5 in loss and 3.4e-5 in its deployed parameters' sum
#: between a machine with avx512_bf16 and one without.
BF16_RTOL = {"diloco_muon": 1e-4, "ddp-bf16": 1e-4, "diloco-bf16": 1e-4}
TIME_ATOL = 1e-9
#: Pinned with 2 ranks per worker: plain gradient averaging, an outer exchange, and fragment
#: exchanges over a two-level comm.
HIERARCHICAL = ("ddp", "diloco", "streaming_diloco")
MUON = ("diloco",)  # pinned again with --optim.name muon as "<method>_muon" (MuLoCo)
#: Pinned again with --model.dropout 0.1 as "<method>_dropout": each worker's masks come from
#: its own generator, in a process of its own as in a thread beside the others.
DROPOUT = ("ddp",)
# The bf16-mixed / --comm-dtype bf16 runs are pinned by test_regression_precision.py.

#: What every stored run is; kept in each file so a reviewer sees what the numbers are of.
DESCRIPTION = (
    "2 workers (Gloo), network wan, virtual clock with 0.05 s per micro-batch, seed 0, "
    "GPT 2 layers x 32 wide, block 16, micro-batch 2, 8 steps, AdamW lr 3e-3 with 3 warm-up "
    "steps then cosine, grad clip 1.0, eval every 3 steps on 2 batches; local.sync_every 2, "
    "diloco.sync_every 4 / overlap 1, desloc periods 2/3/4 (others 2), acco.dpu_warmup_steps 2, "
    "sparseloco.sync_every 4, sparta.sync_every 4"
)


def regression_config(method: str, out: Path, ranks_per_worker: int = 1) -> TrainConfig:
    return TrainConfig(
        method=method,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        optim=AdamWConfig(lr=3e-3),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=3),
        local=LocalOptions(sync_every=2),
        diloco=DiLoCoOptions(sync_every=4, overlap_steps=1),
        desloc=(
            DeslocOptions(param_period=2, first_moment_period=3, second_moment_period=4)
            if method == "desloc"
            else DeslocOptions(param_period=2)  # the others refuse moment periods
        ),
        acco=AccoOptions(dpu_warmup_steps=2),
        sparseloco=SparseLoCoOptions(sync_every=4),
        sparta=SpartaOptions(sync_every=4),
        decoupled=DecoupledOptions(sync_every=4, overlap_steps=1),
        placement=PlacementConfig(workers=2, ranks_per_worker=ranks_per_worker),
        run=RunConfig(
            steps=8, seed=0, eval_every=3, eval_batches=2, progress=False, plot=False, out=str(out)
        ),
        comm=CommConfig(network="wan", clock="virtual", seconds_per_microbatch=0.05),
    )


def fingerprint(flat: torch.Tensor) -> dict[str, float]:
    """A checksum of a parameter vector that tolerates last-bit noise: its sum, absolute sum
    and a projection on a fixed direction that weighs every coordinate differently (float64;
    the direction is a formula, not a random draw, so no RNG version can move it)."""
    values = flat.detach().double().reshape(-1)
    direction = torch.sin(0.7 * torch.arange(values.numel(), dtype=torch.float64) + 0.3)
    return {
        "numel": float(values.numel()),
        "sum": float(values.sum()),
        "abs_sum": float(values.abs().sum()),
        "projection": float(values @ direction),
    }


def _record(config: TrainConfig) -> dict[str, Any]:
    """Train ``config`` on this worker; the stored numbers (steps only from rank 0)."""
    from lowcomm.train.loop import train_worker

    summary = train_worker(config, TorchComm(), keep_parameters=True)
    result: dict[str, Any] = {"rank": _rank_numbers(summary)}
    if summary.rank == 0:
        result.update(_run_numbers(config))
    return result


def _rank_numbers(summary: WorkerSummary) -> dict[str, Any]:
    """One worker's stored final numbers."""
    assert summary.deployed_parameters is not None
    return {
        "clock_s": summary.clock_s,
        "compute_s": summary.compute_s,
        "exposed_comm_s": summary.exposed_comm_s,
        "bytes_sent": summary.bytes_sent,
        "bytes_by_role": dict(sorted(summary.bytes_by_role.items())),
        "state_bytes": summary.state_bytes,
        "tokens": summary.tokens,
        "deployed": fingerprint(summary.deployed_parameters),
    }


def _run_numbers(config: TrainConfig) -> dict[str, Any]:
    """The run's stored steps and final validation loss (what rank 0 wrote)."""
    run_dir = run_directory(config)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {
        "steps": [
            {
                "step": r["step"],
                "lr": r["lr"],
                "train_loss": r["train_loss"],
                "val_loss": r["val_loss"],
                "clock_s": r["clock_s"],
                "compute_s": r["compute_s"],
                "exposed_comm_s": r["exposed_comm_s"],
                "bytes_sent_per_worker": r["bytes_sent_per_worker"],
                "microbatches_per_worker": r["microbatches_per_worker"],
                "committed_steps": r["committed_steps"],
            }
            for r in map(json.loads, lines)
        ],
        "final_val_loss": json.loads((run_dir / "summary.json").read_text())["final_val_loss"],
    }


def _run_config(key: str, method: str, out: Path, ranks: int) -> TrainConfig:
    """The configuration of the stored run ``key``."""
    config = regression_config(method, out, ranks)
    if key.endswith("_muon"):
        config.optim = AdamWConfig(lr=3e-3, name="muon")
    if key.endswith("_dropout"):
        config.model = dataclasses.replace(config.model, dropout=0.1)
    return config


def _run_all(base: str, runs: list[tuple[str, str, int]]) -> dict[str, dict[str, Any] | str]:
    """Each (key, method, ranks per worker) in turn on this worker; an error is reported by
    that run's own test."""
    results: dict[str, dict[str, Any] | str] = {}
    for key, method, ranks in runs:
        try:
            results[key] = _record(_run_config(key, method, Path(base) / key, ranks))
        except Exception as error:
            results[key] = f"{type(error).__name__}: {error}"
    return results


def _merge(per_rank: list[dict[str, dict[str, Any] | str]]) -> dict[str, dict[str, Any] | str]:
    """One record per run: rank 0's steps and every rank's final numbers."""
    merged: dict[str, dict[str, Any] | str] = {}
    for key in per_rank[0]:
        failures = [
            f"rank {r}: {got[key]}" for r, got in enumerate(per_rank) if isinstance(got[key], str)
        ]
        if failures:
            merged[key] = "; ".join(failures)
            continue
        first = per_rank[0][key]
        assert isinstance(first, dict)
        merged[key] = {
            "steps": first["steps"],
            "final_val_loss": first["final_val_loss"],
            "ranks": [got[key]["rank"] for got in per_rank],  # type: ignore[index]
        }
    return merged


FLAT = [(method, method, 1) for method in sorted(STRATEGIES)]
FLAT += [(f"{method}_muon", method, 1) for method in MUON]
FLAT += [(f"{method}_dropout", method, 1) for method in DROPOUT]
HIER = [(f"hierarchical-{method}", method, 2) for method in HIERARCHICAL]
#: Methods whose workers must be threads of one process (``one_process_refusal``): pinned
#: from that run, since worker processes refuse them.
ONE_PROCESS = {m for m, cls in STRATEGIES.items() if cls.one_process_refusal is not None}
PROCESSES = [run for run in FLAT if run[1] not in ONE_PROCESS]


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any] | str]:
    from lowcomm.data import prepare_corpus

    base = tmp_path_factory.mktemp("regression")
    prepare_corpus(DataConfig(micro_batch_size=2))  # the tokenizer once, before the workers
    results = _merge(spawn_workers(_run_all, 2, (str(base), PROCESSES), timeout_s=240))
    results.update(_merge(spawn_workers(_run_all, 4, (str(base), HIER), timeout_s=240)))
    return results


def _dumps(record: dict[str, Any]) -> str:
    """JSON with one line per step and per rank, so a reviewed diff shows what moved where."""
    lines = ["{"]
    items = list(record.items())
    for i, (name, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if isinstance(value, list):
            rows = [f"  {json.dumps(row)}" for row in value]
            body = ",\n".join(rows)
            lines.append(f" {json.dumps(name)}: [\n{body}\n ]{comma}")
        else:
            lines.append(f" {json.dumps(name)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _stored_path(key: str) -> Path:
    return STORE / f"{key}.json"


def _compare(key: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Every difference between a fresh run and the stored one, as readable lines."""
    problems: list[str] = []
    rtol = BF16_RTOL.get(key, LOSS_RTOL)

    def loss(where: str, a: float | None, b: float | None) -> None:
        if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
            if not (
                a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))
            ):
                problems.append(f"{where}: {a} != stored {b}")
        elif not math.isclose(a, b, rel_tol=rtol, abs_tol=0.0):
            problems.append(f"{where}: {a!r} != stored {b!r} (rel {rtol:g})")

    def time(where: str, a: float, b: float) -> None:
        if abs(a - b) > TIME_ATOL:
            problems.append(f"{where}: {a!r} s != stored {b!r} s (1e-9 s)")

    def exact(where: str, a: object, b: object) -> None:
        if a != b:
            problems.append(f"{where}: {a!r} != stored {b!r} (exact)")

    exact("number of steps", len(got["steps"]), len(want["steps"]))
    for g, w in zip(got["steps"], want["steps"], strict=False):
        at = f"step {w['step']}"
        for name in ("train_loss", "val_loss", "lr"):
            loss(f"{at} {name}", g[name], w[name])
        for name in ("clock_s", "compute_s", "exposed_comm_s"):
            time(f"{at} {name}", g[name], w[name])
        for name in ("bytes_sent_per_worker", "microbatches_per_worker", "committed_steps"):
            exact(f"{at} {name}", g[name], w[name])
    loss("final_val_loss", got["final_val_loss"], want["final_val_loss"])
    exact("number of ranks", len(got["ranks"]), len(want["ranks"]))
    for rank, (g, w) in enumerate(zip(got["ranks"], want["ranks"], strict=False)):
        at = f"rank {rank}"
        for name in ("clock_s", "compute_s", "exposed_comm_s"):
            time(f"{at} {name}", g[name], w[name])
        for name in ("bytes_sent", "bytes_by_role", "state_bytes", "tokens"):
            exact(f"{at} {name}", g[name], w[name])
        scale = w["deployed"]["abs_sum"]
        exact(f"{at} deployed numel", g["deployed"]["numel"], w["deployed"]["numel"])
        for name in ("sum", "abs_sum", "projection"):
            a, b = g["deployed"][name], w["deployed"][name]
            if abs(a - b) > rtol * scale:
                problems.append(f"{at} deployed parameters {name}: {a!r} != stored {b!r}")
    return problems


@pytest.mark.parametrize("key", [key for key, _, _ in PROCESSES + HIER])
def test_run_matches_stored_numbers(key: str, fresh_runs: dict[str, dict[str, Any] | str]) -> None:
    got = fresh_runs[key]
    assert isinstance(got, dict), f"{key} failed: {got}"
    path = _stored_path(key)
    if REGEN:
        STORE.mkdir(exist_ok=True)
        path.write_text(_dumps({"run": key, "setup": DESCRIPTION, **got}))
        return
    assert path.exists(), (
        f"{path.name} is missing: a method with no stored numbers. Run `make regen-regression` "
        f"and commit the new file"
    )
    want = json.loads(path.read_text())
    problems = _compare(key, got, want)
    assert not problems, (
        f"{key} moved from {path.name} ({len(problems)} differences; first ones below). If "
        f"intended, run `make regen-regression` and commit saying why the numbers moved.\n"
        + "\n".join(problems[:15])
    )


@pytest.mark.parametrize("key", [key for key, _, _ in FLAT + HIER])
def test_in_process_run_matches_stored_numbers(key: str, tmp_path: Path) -> None:
    """The same run with both workers in this process (--workers-per-process 2: threads on an
    in-process comm; a hierarchical worker's ranks are threads too, on in-process replica and
    outer groups) gives the numbers the worker processes stored."""
    from lowcomm.launch.inprocess import train_in_process

    method, ranks = next((method, r) for k, method, r in FLAT + HIER if k == key)
    if REGEN and method not in ONE_PROCESS:
        pytest.skip("the stored numbers are made by worker processes")
    config = _run_config(key, method, tmp_path / key, ranks)
    config.placement.workers_per_process = config.placement.workers
    summaries = train_in_process(config, keep_parameters=True)
    got = {**_run_numbers(config), "ranks": [_rank_numbers(s) for s in summaries]}
    if REGEN:
        STORE.mkdir(exist_ok=True)
        _stored_path(key).write_text(_dumps({"run": key, "setup": DESCRIPTION, **got}))
        return
    problems = _compare(key, got, json.loads(_stored_path(key).read_text()))
    assert not problems, (
        f"{key} in one process differs from the processes' {key}.json ({len(problems)} "
        f"differences; first ones below)\n" + "\n".join(problems[:15])
    )


#: Methods checked at 4 workers too (one process against four), unpinned.
FOUR = ("ddp", "diloco", "acco", "desloc", "co2", "zero1")


@pytest.mark.slow
def test_four_workers_in_one_process_equal_four_processes(tmp_path: Path) -> None:
    from lowcomm.launch.inprocess import train_in_process

    runs = [(method, method, 1) for method in FOUR]
    processes = _merge(spawn_workers(_run_four, 4, (str(tmp_path / "processes"), runs)))
    for method in FOUR:
        want = processes[method]
        assert isinstance(want, dict), f"{method} failed in processes: {want}"
        config = _run_config(method, method, tmp_path / "threads" / method, 1)
        config.placement.workers = config.placement.workers_per_process = 4
        summaries = train_in_process(config, keep_parameters=True)
        got = {**_run_numbers(config), "ranks": [_rank_numbers(s) for s in summaries]}
        problems = _compare(method, got, want)
        assert not problems, f"{method} at 4 workers:\n" + "\n".join(problems[:15])


def _run_four(base: str, runs: list[tuple[str, str, int]]) -> dict[str, dict[str, Any] | str]:
    results: dict[str, dict[str, Any] | str] = {}
    for key, method, ranks in runs:
        config = _run_config(key, method, Path(base) / key, ranks)
        config.placement.workers = 4
        results[key] = _record(config)
    return results


def test_dropout_drops() -> None:
    """The pinned dropout run is not the plain one: its masks changed every step's loss."""
    for method in DROPOUT:
        plain = json.loads(_stored_path(method).read_text())["steps"]
        dropped = json.loads(_stored_path(f"{method}_dropout").read_text())["steps"]
        assert len(plain) == len(dropped)
        for a, b in zip(plain, dropped, strict=True):
            assert not math.isclose(a["train_loss"], b["train_loss"], rel_tol=1e-4), (a, b)


def test_every_stored_file_belongs_to_a_run() -> None:
    """A file left behind by a removed or renamed method fails too (no silent stale pins);
    regeneration deletes it."""
    expected = {f"{key}.json" for key, _, _ in FLAT + HIER}
    if REGEN:
        for path in STORE.glob("*.json"):
            if path.name not in expected:
                path.unlink()
    stored = {path.name for path in STORE.glob("*.json")}
    assert stored <= expected, f"stale regression files: {sorted(stored - expected)}"
