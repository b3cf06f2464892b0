"""Exact resume for every method: 2k steps straight equal k steps, a stop, a resume and k more.

Every registered method runs in one pair of Gloo worker processes (one spawn for all of them,
to keep the suite fast); each method's result is then checked by its own test. The clock is
virtual with a declared cost per micro-batch, so clock-driven choices (ACCO's micro-batch
counts, CoCoDC's transmission schedule) are deterministic and must survive the resume too.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import torch

from _cli import TINY, lowcomm
from lowcomm.comm.torch_comm import TorchComm
from lowcomm.config import TrainConfig
from lowcomm.data import DataConfig
from lowcomm.launch import spawn_workers
from lowcomm.models import ModelConfig
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.acco import AccoOptions
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions

STEPS = 8
STOP = 5  # mid-period for every method below, with collectives in flight


def tiny_config(method: str, out: Path, **overrides: object) -> TrainConfig:
    config = TrainConfig(
        method=method,
        workers=2,
        steps=STEPS,
        network="wan",
        clock="virtual",
        seconds_per_microbatch=0.01,
        eval_every=3,
        eval_batches=2,
        progress=False,
        out=str(out),
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
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _run_every_method(base: str) -> dict[str, dict[str, float] | str]:
    results: dict[str, dict[str, float] | str] = {}
    for method in sorted(STRATEGIES):
        try:
            results[method] = _straight_and_resumed(Path(base) / method, method)
        except Exception as error:  # reported by the method's own test
            results[method] = f"{type(error).__name__}: {error}"
    return results


def _straight_and_resumed(root: Path, method: str) -> dict[str, float]:
    from lowcomm.train.loop import train_worker

    straight = train_worker(
        tiny_config(method, root / "straight"), TorchComm(), keep_parameters=True
    )
    train_worker(
        tiny_config(method, root / "resumed", stop_after=STOP, checkpoint_every=2), TorchComm()
    )
    resumed = train_worker(
        tiny_config(method, root / "resumed", resume=str(root / "resumed")),
        TorchComm(),
        keep_parameters=True,
    )
    assert straight.parameters is not None and resumed.parameters is not None
    return {
        "max_abs_diff": float((straight.parameters - resumed.parameters).abs().max()),
        "clock_diff": abs(straight.clock_s - resumed.clock_s),
        "bytes_diff": abs(straight.bytes_sent - resumed.bytes_sent),
    }


@pytest.fixture(scope="module")
def resume_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, dict[str, float] | str]]:
    from lowcomm.data import prepare_corpus

    base = tmp_path_factory.mktemp("resume")
    prepare_corpus(DataConfig(micro_batch_size=2))  # the tokenizer once, before the workers
    return spawn_workers(_run_every_method, 2, (str(base),), timeout_s=120)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_resume_is_exact(
    method: str, resume_results: list[dict[str, dict[str, float] | str]]
) -> None:
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


def _hierarchical_straight_and_resumed(base: str) -> dict[str, dict[str, float] | str]:
    results: dict[str, dict[str, float] | str] = {}
    for method in HIERARCHICAL_METHODS:
        try:
            results[method] = _hierarchical_method(Path(base) / method, method)
        except Exception as error:  # reported by the method's own test
            results[method] = f"{type(error).__name__}: {error}"
    return results


def _hierarchical_method(root: Path, method: str) -> dict[str, float]:
    from dataclasses import replace

    from lowcomm.train.loop import train_worker

    hierarchical = {"ranks_per_worker": 2}
    straight = train_worker(
        tiny_config(method, root / "straight", **hierarchical), TorchComm(), keep_parameters=True
    )
    stop = tiny_config(method, root / "resumed", stop_after=STOP, **hierarchical)
    train_worker(stop, TorchComm())
    resumed = train_worker(
        replace(stop, stop_after=None, resume=str(root / "resumed")),
        TorchComm(),
        keep_parameters=True,
    )
    assert straight.parameters is not None and resumed.parameters is not None
    return {
        "max_abs_diff": float((straight.parameters - resumed.parameters).abs().max()),
        "clock_diff": abs(straight.clock_s - resumed.clock_s),
        "exposed_diff": abs(straight.exposed_comm_s - resumed.exposed_comm_s),
        "bytes_diff": abs(straight.bytes_sent - resumed.bytes_sent),
    }


@pytest.fixture(scope="module")
def hierarchical_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, dict[str, float] | str]]:
    from lowcomm.data import prepare_corpus

    base = tmp_path_factory.mktemp("hierarchical-resume")
    prepare_corpus(DataConfig(micro_batch_size=2))
    return spawn_workers(_hierarchical_straight_and_resumed, 4, (str(base),), timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("method", HIERARCHICAL_METHODS)
def test_hierarchical_resume_is_exact(
    method: str, hierarchical_results: list[dict[str, dict[str, float] | str]]
) -> None:
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
