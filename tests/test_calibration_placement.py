"""The calibrated compute cost belongs to the model, the micro-batch, the precision and the
device, not to the placement: one standard pass of the whole model, in a fixed heap setting,
measures it whatever the workers per process, the ranks per worker or the sharding."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch
from tests._cli import lowcomm

from lowcomm.comm.calibration import STANDARD_MMAP_THRESHOLD, standard_heap
from lowcomm.comm.local import LocalComm
from lowcomm.config import PlacementConfig, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.models import ModelConfig
from lowcomm.train.compute import (
    finish_calibration,
    fixed_mmap_threshold,
    standard_setting,
    worker_clock,
)
from lowcomm.train.task import CorpusTask

MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)


def _config(**changes: object) -> TrainConfig:
    base = TrainConfig(
        method="diloco",
        model=MODEL,
        data=DataConfig(micro_batch_size=2),
        placement=PlacementConfig(workers=4),
    )
    return with_options(base, **changes)


def test_the_standard_setting_does_not_depend_on_the_placement() -> None:
    setting = standard_setting(_config())
    placements = [
        _config(workers_per_process=4),
        _config(workers_per_process=2),
        _config(workers=2, ranks_per_worker=2),
        _config(workers=2, ranks_per_worker=2, worker_sharding="fsdp"),
        _config(method="cocodc", workers=8, network="wan"),
    ]
    assert all(standard_setting(config) == setting for config in placements)
    # What a rank computes does change it: --micro-batch-size is a rank's micro-batch.
    assert standard_setting(_config(data=DataConfig(micro_batch_size=4))) != setting
    assert standard_setting(_config(precision="bf16-mixed")) != setting


def test_the_standard_pass_sets_aside_the_placements_heap_threshold() -> None:
    assert fixed_mmap_threshold(_config()) is None  # glibc's dynamic threshold
    assert fixed_mmap_threshold(_config(workers_per_process=4)) == 1 << 20
    fsdp = _config(workers=2, ranks_per_worker=2, worker_sharding="fsdp")
    assert fixed_mmap_threshold(fsdp) == 1 << 20


def _mapped(libc: ctypes.CDLL, size: int) -> bool:
    """Whether glibc serves a block of ``size`` bytes by a mapping of its own (the IS_MMAPPED
    bit of the chunk's size field, just before the block)."""
    block = libc.malloc(size)
    assert block
    try:
        header = ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value
    finally:
        libc.free(block)
    return bool(header & 2)


def _heap_in_a_fresh_process() -> tuple[bool, bool, bool]:
    from lowcomm.launch.heap import MMAP_THRESHOLD, return_large_blocks

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert return_large_blocks()  # as the in-process launcher does
    size = 4 << 20
    before = _mapped(libc, size)
    with standard_heap(MMAP_THRESHOLD):
        during = _mapped(libc, size)
    return before, during, _mapped(libc, size)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="not glibc")
def test_the_standard_heap_serves_activation_sized_blocks_from_the_heap() -> None:
    """In a process whose workers map every block of a megabyte or more (in-process workers,
    sharded CPU workers), the standard pass's blocks come from the heap as in a process of
    one worker; the process's own threshold is back afterwards."""
    from lowcomm.launch import spawn_workers

    assert STANDARD_MMAP_THRESHOLD > 4 << 20
    [(before, during, after)] = spawn_workers(_heap_in_a_fresh_process, 1)
    assert (before, during, after) == (True, False, True)


class _RecordingTask(CorpusTask):
    """lowcomm train's task, keeping every model it builds."""

    def __init__(self) -> None:
        super().__init__()
        self.built: list[torch.nn.Module] = []

    def model(self, config: TrainConfig) -> torch.nn.Module:
        model = super().model(config)
        self.built.append(model)
        return model


def test_a_sharded_worker_calibrates_the_whole_unsharded_model() -> None:
    """A --worker-sharding fsdp worker's clock never times the worker's own (sharded) model,
    so FSDP's collectives, charged on the inner link, are no part of the compute cost: the
    standard pass builds the whole model from the task, unwrapped, and measures it as a
    replicated worker's clock does."""
    from torch.distributed.fsdp import FSDPModule

    from lowcomm.comm.calibration import CalibratedClock
    from lowcomm.data import prepare_corpus

    prepare_corpus(DataConfig(micro_batch_size=2))
    device = torch.device("cpu")
    calibrations = []
    for sharding in ("fsdp", "replicate"):
        config = _config(workers=2, ranks_per_worker=2, worker_sharding=sharding)
        task = _RecordingTask()
        clock = worker_clock(config, task, LocalComm(), device)
        assert isinstance(clock, CalibratedClock) and clock.pending
        finish_calibration(clock, config, rank=0)
        [model] = task.built  # built for the pass, once
        assert not any(isinstance(module, FSDPModule) for module in model.modules())
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # no DTensor
        whole = sum(p.numel() for p in model.parameters())
        assert clock.calibration.num_params == whole
        calibrations.append(clock.calibration)
    fsdp, replicated = calibrations
    assert (fsdp.num_params, fsdp.micro_batch_size, fsdp.block_size, fsdp.bf16) == (
        replicated.num_params,
        replicated.micro_batch_size,
        replicated.block_size,
        replicated.bf16,
    )


FLAGS = (
    "--method", "diloco", "--workers", "4", "--model.n-layer", "1", "--model.n-embd", "32",
    "--model.n-head", "2", "--model.block-size", "16", "--micro-batch-size", "2",
    "--steps", "4", "--eval-every", "100", "--eval-batches", "2", "--progress", "False",
    "--plot", "False", "--network", "wan", "--seed", "3",
)  # fmt: skip


def _train(out: Path, *args: str) -> dict[str, object]:
    result = lowcomm("train", *FLAGS, "--out", str(out), *args, timeout=300)
    assert result.returncode == 0, result.stderr
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def _charged_elements(summary: dict[str, object], calibration: dict[str, float]) -> float:
    """The elements a run's clock charged outside micro-batches: its compute less its
    micro-batches at the calibrated cost, in elements at the calibrated cost per element."""
    tokens = summary["tokens"]
    assert isinstance(tokens, int)
    microbatches = tokens / (4 * 2 * 16)  # per worker: 4 workers, 2 x 16 tokens each
    compute = summary["compute_s"]
    assert isinstance(compute, float)
    spent = compute - microbatches * calibration["seconds_per_microbatch"]
    return spent / calibration["seconds_per_element"]


@pytest.mark.slow
def test_workers_in_one_process_and_in_processes_measure_and_charge_the_same(
    tmp_path: Path,
) -> None:
    """Each placement measures its own calibration; both charge the same work (the same
    micro-batches and elements), train the same, and charge the same time on one cost."""
    runs = {}
    for k in ("1", "4"):
        calibration = tmp_path / f"calibration-{k}.json"
        summary = _train(
            tmp_path / k, "--workers-per-process", k, "--calibration", str(calibration)
        )
        runs[k] = (summary, json.loads(calibration.read_text()))
    (one, one_cal), (four, four_cal) = runs["1"], runs["4"]
    for key in ("tokens", "final_train_loss", "final_val_loss"):
        assert one[key] == four[key], key
    for measured in (one_cal, four_cal):  # one pass's repeats, not every worker's
        assert measured["num_params"] == one_cal["num_params"]
        assert len(measured["microbatch_samples"]) <= 80
    assert _charged_elements(one, one_cal) == pytest.approx(
        _charged_elements(four, four_cal), rel=1e-6
    )
    again = _train(
        tmp_path / "4-again",
        "--workers-per-process", "4", "--calibration", str(tmp_path / "calibration-1.json"),
    )  # fmt: skip
    assert again["modeled_time_s"] == pytest.approx(one["modeled_time_s"], rel=1e-12)


@pytest.mark.benchmark
def test_placements_measuring_independently_agree_within_noise(tmp_path: Path) -> None:
    """(Benchmark tier: timings on a possibly loaded machine.) Timed in the placement's own
    setting, in-process workers cost 1.6x and sharded CPU workers 1.7-1.9x one worker per
    process (the kernel's mapping of their activations); measured independently by the
    standard pass, the costs stay within a generous noise band."""
    costs = {}
    for name, args in {
        "processes": ("--workers-per-process", "1"),
        "one process": ("--workers-per-process", "4"),
        "fsdp": ("--workers", "2", "--ranks-per-worker", "2", "--worker-sharding", "fsdp"),
        "replicate": ("--workers", "2", "--ranks-per-worker", "2", "--workers-per-process", "1"),
    }.items():
        summary = _train(tmp_path / name.replace(" ", "-"), *args)
        model = summary["compute_model"]
        assert isinstance(model, dict)
        costs[name] = float(model["seconds_per_microbatch"])
    assert 0.8 < costs["one process"] / costs["processes"] < 1.25, costs
    assert 0.8 < costs["fsdp"] / costs["replicate"] < 1.25, costs
