"""The worker's clock with its compute model (see :mod:`lowcomm.comm.calibration`), and the
token budget that ends an equal-token run."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lowcomm.comm.base import Comm
from lowcomm.comm.calibration import CalibratedClock, Calibration, calibrate
from lowcomm.comm.clock import Clock, make_clock
from lowcomm.config import TrainConfig
from lowcomm.models import ModelConfig
from lowcomm.models.recompute import checkpoint_blocks, compile_blocks
from lowcomm.strategies import Strategy
from lowcomm.train import sharding
from lowcomm.train.context import network_profile
from lowcomm.train.task import Task, calibration_pass


def uses_calibration(config: TrainConfig) -> bool:
    """Whether the run charges compute on the calibrated model."""
    return (
        config.comm.clock == "virtual"
        and config.comm.seconds_per_microbatch is None
        and config.comm.compute_model == "calibrated"
    )


@dataclass(frozen=True)
class StandardSetting:
    """Everything the standard calibration pass depends on: the model (its options, or the
    weights it starts from), the micro-batch's shape, the precision, the device and what
    changes the pass's own work (recomputation, compilation). Nothing of the placement (how
    many workers share a process, ranks per worker, sharding): every placement of a run
    measures the same pass."""

    model: ModelConfig
    init_from: str | None
    micro_batch_size: int
    block_size: int
    bf16: bool
    device: str
    activation_checkpointing: bool
    compile: bool


def standard_setting(config: TrainConfig) -> StandardSetting:
    """The setting of ``config``'s standard calibration pass."""
    return StandardSetting(
        model=config.model,
        init_from=config.run.init_from,
        micro_batch_size=config.data.micro_batch_size,
        block_size=config.model.block_size,
        bf16=config.numerics.precision == "bf16-mixed",
        device=config.placement.device,
        activation_checkpointing=config.numerics.activation_checkpointing,
        compile=config.numerics.compile,
    )


def standard_model(
    setting: StandardSetting, build: Callable[[], torch.nn.Module], device: torch.device
) -> torch.nn.Module:
    """The model the standard pass times: ``build()`` (the task's model, whole) on
    ``device``, its blocks recomputed and compiled as the setting says; the global random
    state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        model = build().to(device)
    if setting.activation_checkpointing:
        checkpoint_blocks(model)
    if setting.compile:
        compile_blocks(model)
    return model


def fixed_mmap_threshold(config: TrainConfig) -> int | None:
    """The mmap threshold this process of ``config``'s run fixed (the user's
    ``MALLOC_MMAP_THRESHOLD_``; workers that share a process, and sharded CPU workers, fix
    one of a megabyte: :mod:`lowcomm.launch.heap`, :func:`lowcomm.train.sharding.
    return_freed_memory`), which the standard pass sets aside; None: glibc's own."""
    from lowcomm.launch.heap import MMAP_THRESHOLD

    chosen = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if chosen is not None and chosen.strip().isdigit():
        return int(chosen)
    if config.placement.workers_per_process > 1:
        return MMAP_THRESHOLD
    if config.placement.worker_sharding == "fsdp" and config.placement.device == "cpu":
        return sharding.MMAP_THRESHOLD
    return None


def worker_clock(config: TrainConfig, task: Task, bookkeeping: Comm, device: torch.device) -> Clock:
    """This worker's clock: real, virtual on a declared cost or CPU time, or virtual on the
    calibrated model (read from --calibration, or from the checkpoint a resume reads, or
    measured by :func:`finish_calibration`: the standard pass of ``task``'s whole model on
    its fixed micro-batch, once for the run, see :func:`lowcomm.comm.calibration.calibrate`)."""
    worker_index = bookkeeping.rank // config.placement.ranks_per_worker
    speed_factor = network_profile(config.comm).speed_factor(worker_index)
    if not uses_calibration(config):
        return make_clock(
            config.comm.clock,
            speed_factor=speed_factor,
            seconds_per_microbatch=config.comm.seconds_per_microbatch,
            device=device,
        )
    path = calibration_file(config)
    if path is not None and path.exists():
        return CalibratedClock(Calibration.load(path), speed_factor=speed_factor)
    setting = standard_setting(config)
    timed_loss = calibration_pass(task, config, device)

    def measured() -> Calibration:  # (after the resume, unless the checkpoint brings one)
        return calibrate(
            lambda: standard_model(setting, lambda: task.model(config), device),
            vocab_size=0,
            micro_batch_size=setting.micro_batch_size,
            block_size=setting.block_size,
            bookkeeping=bookkeeping,
            bf16=setting.bf16,
            loss=timed_loss,
            fixed_threshold=fixed_mmap_threshold(config),
        )

    return CalibratedClock(speed_factor=speed_factor, measure=measured)


def calibrate_in_process(
    config: TrainConfig,
    vocab_size: int,
    *,
    model: torch.nn.Module | None = None,
    timed_loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    bookkeeping: Comm | None = None,
) -> Calibration:
    """Measure the calibration a run of ``config`` would measure, in this process, before any
    run (a study's one calibration): the same standard pass as :func:`worker_clock`'s, of
    ``model`` and ``timed_loss`` (a task's), default the model of ``--model.*`` on random
    tokens of ``vocab_size``; with ``bookkeeping``, measured by its rank 0 and shared."""
    from lowcomm.comm.local import LocalComm
    from lowcomm.models import build_model

    setting = standard_setting(config)
    device = torch.device(config.placement.device)

    def build() -> torch.nn.Module:
        if model is not None:  # (a copy: the pass recomputes or compiles its own blocks)
            return copy.deepcopy(model)
        if config.run.init_from is None:
            return build_model(config.model, vocab_size)
        from lowcomm.models.init_from import preflight_init_from

        return preflight_init_from(config.run.init_from, config.model).load()

    return calibrate(
        lambda: standard_model(setting, build, device),
        vocab_size=vocab_size,
        micro_batch_size=setting.micro_batch_size,
        block_size=setting.block_size,
        bookkeeping=LocalComm() if bookkeeping is None else bookkeeping,
        bf16=setting.bf16,
        loss=timed_loss,
        fixed_threshold=fixed_mmap_threshold(config),
    )


def calibration_file(config: TrainConfig) -> Path | None:
    """The --calibration file, if the run names one."""
    return None if config.comm.calibration is None else Path(config.comm.calibration)


def finish_calibration(clock: Clock, config: TrainConfig, rank: int) -> None:
    """Measure a calibrated clock's calibration if it has none yet (every process of the run
    calls this at the same point: after a resume, before training); when --calibration names
    a file that does not exist yet, rank 0 writes the run's calibration there (measured, or
    the checkpoint's)."""
    if not isinstance(clock, CalibratedClock):
        return
    clock.finish_calibration()
    path = calibration_file(config)
    if path is not None and rank == 0 and not path.exists():
        clock.calibration.save(path)


def committed_tokens(config: TrainConfig, strategy: Strategy, consumed_tokens: int) -> int:
    """Tokens (summed over workers) whose gradients the run has committed: the micro-batches
    a method with a variable number per step has committed (its ``committed_gradients``, the
    same on every worker), else every token consumed (``consumed_tokens``: this process's
    count times the processes, which take equal counts)."""
    committed = getattr(strategy, "committed_gradients", None)
    if committed is None:
        return consumed_tokens
    return int(committed) * config.tokens_per_microbatch()


def budget_spent(config: TrainConfig, strategy: Strategy, consumed_tokens: int) -> bool:
    """Whether a --token-budget run has committed its budget (False without a budget)."""
    budget = config.run.token_budget
    return budget is not None and committed_tokens(config, strategy, consumed_tokens) >= budget
