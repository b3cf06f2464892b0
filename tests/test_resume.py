"""Exact resume for every method: 2k steps straight equal k steps, a stop, a resume and k more.

Every registered method runs on two workers as threads of the test's process (one fixture for
all of them); each method's result is then checked by its own test. The clock is
virtual with a declared cost per micro-batch, so clock-driven choices (ACCO's micro-batch
counts, CoCoDC's transmission schedule) are deterministic and must survive the resume too.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

import pytest
import torch

from _cli import TINY, lowcomm
from lowcomm.config import CommConfig, PlacementConfig, RunConfig, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.launch.inprocess import train_in_process
from lowcomm.models import ModelConfig
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.acco import AccoOptions
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions
from lowcomm.train.loop import WorkerSummary

STEPS = 8
STOP = 5  # mid-period for every method below, with collectives in flight


def tiny_config(method: str, out: Path, **overrides: object) -> TrainConfig:
    config = TrainConfig(
        method=method,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        local=LocalOptions(sync_every=2),
        diloco=DiLoCoOptions(sync_every=4, overlap_steps=1),
        desloc=(
            DeslocOptions(param_period=2, first_moment_period=3, second_moment_period=4)
            if method == "desloc"
            else DeslocOptions(param_period=2)
        ),
        acco=AccoOptions(dpu_warmup_steps=2),
        # Rounds before STOP, so the checkpoint holds a non-zero error buffer / outer state.
        sparseloco=SparseLoCoOptions(sync_every=2),
        sparta=SpartaOptions(sync_every=4),
        placement=PlacementConfig(workers=2),
        run=RunConfig(
            steps=STEPS, eval_every=3, eval_batches=2, progress=False, plot=False, out=str(out)
        ),
        comm=CommConfig(network="wan", clock="virtual", seconds_per_microbatch=0.01),
    )
    config = with_options(config, **overrides)
    return config


def train_threads(config: TrainConfig, *, keep_parameters: bool = False) -> list[WorkerSummary]:
    """Train ``config``'s workers as threads of this process (``--workers-per-process`` all
    of them, whose numbers equal worker processes', as the regression tier checks); every
    rank's summary, in rank order. These tests check the methods' state, not the process
    machinery (test_inprocess.py and test_stacked.py resume across placements)."""
    config.placement.workers_per_process = config.placement.workers
    config.validate()
    return train_in_process(config, keep_parameters=keep_parameters)


Results = list[dict[str, dict[str, float] | str]]
"""Per rank: per method, the differences found, or the error that stopped the method."""


def every_method(
    methods: Iterable[str], ranks: int, run: Callable[[str], list[dict[str, float]]]
) -> Results:
    """``run(method)`` for each method, its per-rank results rearranged per rank; a method
    that raised is its error on every rank (reported by the method's own test)."""
    results: Results = [{} for _ in range(ranks)]
    for method in methods:
        try:
            per_rank: list[dict[str, float]] | str = run(method)
        except Exception as error:
            per_rank = f"{type(error).__name__}: {error}"
        for rank in range(ranks):
            results[rank][method] = per_rank if isinstance(per_rank, str) else per_rank[rank]
    return results


def _differences(
    straight: list[WorkerSummary], resumed: list[WorkerSummary]
) -> list[dict[str, float]]:
    out = []
    for a, b in zip(straight, resumed, strict=True):
        assert a.parameters is not None and b.parameters is not None
        out.append({
            "max_abs_diff": float((a.parameters - b.parameters).abs().max()),
            "clock_diff": abs(a.clock_s - b.clock_s),
            "exposed_diff": abs(a.exposed_comm_s - b.exposed_comm_s),
            "bytes_diff": abs(a.bytes_sent - b.bytes_sent),
        })  # fmt: skip
    return out


def _straight_and_resumed(root: Path, method: str) -> list[dict[str, float]]:
    straight = train_threads(tiny_config(method, root / "straight"), keep_parameters=True)
    train_threads(tiny_config(method, root / "resumed", stop_after=STOP, checkpoint_every=2))
    resumed = train_threads(
        tiny_config(method, root / "resumed", resume=str(root / "resumed")), keep_parameters=True
    )
    return _differences(straight, resumed)


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    from lowcomm.data import prepare_corpus

    base = tmp_path_factory.mktemp("resume")
    prepare_corpus(DataConfig(micro_batch_size=2))  # the tokenizer once, before the workers
    return every_method(
        sorted(STRATEGIES), 2, lambda method: _straight_and_resumed(base / method, method)
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_resume_is_exact(method: str, resume_results: Results) -> None:
    for rank, results in enumerate(resume_results):
        got = results[method]
        assert isinstance(got, dict), f"{method} rank {rank} failed: {got}"
        assert got["max_abs_diff"] <= 1e-6, f"{method} rank {rank}: parameters differ by {got}"
        # The modeled clock and the byte counters continue exactly, too.
        assert got["clock_diff"] <= 1e-9, f"{method} rank {rank}: clock differs {got}"
        assert got["bytes_diff"] == 0, f"{method} rank {rank}: bytes differ {got}"


def _lowcomm(*args: str) -> subprocess.CompletedProcess[str]:
    return lowcomm("train", *args, timeout=120)


TINY_FLAGS = (*TINY, "--steps", "6")


@pytest.mark.slow
def test_cli_stop_resume_and_refusals(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _lowcomm(*TINY_FLAGS, "--method", "co2", "--local.sync-every", "2", "--out", str(out),
                     "--stop-after", "3")  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert f"--resume {out}" in first.stdout
    manifest = json.loads((out / "checkpoints" / "step-000003" / "manifest.json").read_text())
    assert set(manifest["sha256"]) == {"rank0.pt", "rank1.pt"}
    assert not (out / "summary.json").exists()

    # A changed setting is refused before any worker starts, naming it.
    changed = _lowcomm("--resume", str(out), "--optim.lr", "0.5")
    assert changed.returncode == 2
    assert "optim" in changed.stderr and "exact resume" in changed.stderr

    # The saved config supplies every option: `--resume DIR` alone finishes the run.
    second = _lowcomm("--resume", str(out))
    assert second.returncode == 0, second.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(6))
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


@pytest.mark.slow
def test_corrupted_or_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _lowcomm(*TINY_FLAGS, "--method", "ddp", "--out", str(out), "--stop-after", "2")
    assert first.returncode == 0, first.stderr
    state = out / "checkpoints" / "step-000002" / "rank1.pt"
    payload = state.read_bytes()
    state.write_bytes(payload[: len(payload) // 2])
    truncated = _lowcomm("--resume", str(out))
    assert truncated.returncode == 2
    assert "rank1.pt" in truncated.stderr and "checksum" in truncated.stderr
    assert "Traceback" not in truncated.stderr

    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 0xFF
    state.write_bytes(bytes(flipped))
    corrupted = _lowcomm("--resume", str(out))
    assert corrupted.returncode == 2 and "checksum" in corrupted.stderr

    (out / "checkpoints" / "step-000002" / "manifest.json").write_text("{not json")
    torn = _lowcomm("--resume", str(out))
    assert torn.returncode == 2 and "manifest.json" in torn.stderr


def test_checkpoint_loading_never_unpickles_objects(tmp_path: Path) -> None:
    from lowcomm.train.checkpoint import CheckpointError, read_rank_state

    # Any class outside torch's allow-list would run code on unpickling; it must be refused.
    torch.save({"format": 1, "evil": PurePosixPath("x")}, tmp_path / "rank0.pt")
    with pytest.raises(CheckpointError, match="cannot load"):
        read_rank_state(tmp_path, 0)


#: Methods whose hierarchical run has collectives in flight at the stop: staggered fragment
#: exchanges (streaming_diloco), a one-round-delayed exchange (co2), an eager outer exchange
#: and CoCoDC's clock-driven transmission schedule, which must survive the resume too.
HIERARCHICAL_METHODS = ("streaming_diloco", "co2", "eager", "cocodc")


def _hierarchical_method(root: Path, method: str) -> list[dict[str, float]]:
    from dataclasses import replace

    hierarchical = {"ranks_per_worker": 2}
    straight = train_threads(
        tiny_config(method, root / "straight", **hierarchical), keep_parameters=True
    )
    stop = tiny_config(method, root / "resumed", stop_after=STOP, **hierarchical)
    train_threads(stop)
    resumed = train_threads(
        replace(
            stop,
            run=replace(stop.run, stop_after=None, resume=str(root / "resumed")),
        ),
        keep_parameters=True,
    )
    return _differences(straight, resumed)


@pytest.fixture(scope="module")
def hierarchical_results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    from lowcomm.data import prepare_corpus

    base = tmp_path_factory.mktemp("hierarchical-resume")
    prepare_corpus(DataConfig(micro_batch_size=2))
    return every_method(
        HIERARCHICAL_METHODS, 4, lambda method: _hierarchical_method(base / method, method)
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", HIERARCHICAL_METHODS)
def test_hierarchical_resume_is_exact(method: str, hierarchical_results: Results) -> None:
    """2 workers x 2 ranks, stopped with exchanges in flight and resumed, equal the straight
    run in parameters, bytes and modeled time: every in-flight handle, the two-level one
    included, is settled without charging the clock and charged again when waited for."""
    for rank, results in enumerate(hierarchical_results):
        got = results[method]
        assert isinstance(got, dict), f"{method} rank {rank} failed: {got}"
        assert got["max_abs_diff"] <= 1e-6, f"{method} rank {rank}: parameters differ by {got}"
        assert got["bytes_diff"] == 0, f"{method} rank {rank}: bytes differ {got}"
        assert got["clock_diff"] <= 1e-9, f"{method} rank {rank}: clock differs {got}"
        assert got["exposed_diff"] <= 1e-9, f"{method} rank {rank}: exposed time differs {got}"
