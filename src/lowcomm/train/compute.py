"""The worker's clock with its compute model (see :mod:`lowcomm.comm.calibration`), and the
token budget that ends an equal-token run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from lowcomm.comm.base import Comm
from lowcomm.comm.calibration import CalibratedClock, Calibration, calibrate
from lowcomm.comm.clock import Clock, make_clock
from lowcomm.config import TrainConfig
from lowcomm.strategies import Strategy
from lowcomm.train import sharding
from lowcomm.train.context import network_profile


def uses_calibration(config: TrainConfig) -> bool:
    """Whether the run charges compute on the calibrated model."""
    return (
        config.clock == "virtual"
        and config.seconds_per_microbatch is None
        and config.compute_model == "calibrated"
    )


def worker_clock(
    config: TrainConfig,
    model: torch.nn.Module,
    timed_loss: Callable[[torch.nn.Module], torch.Tensor],
    bookkeeping: Comm,
    device: torch.device,
    measure: Callable[[], Calibration] | None = None,
) -> Clock:
    """This process's clock: real, virtual on a declared cost or CPU time, or virtual on the
    calibrated model (read from --calibration, or from the checkpoint a resume reads, or
    measured by :func:`finish_calibration`: every process in turn, timing
    ``timed_loss(model)``'s forward and backward (the run's loss on a fixed micro-batch), or
    ``measure`` when the workers of one process share one measurement)."""
    worker_index = bookkeeping.rank // config.ranks_per_worker
    speed_factor = network_profile(config).speed_factor(worker_index)
    if not uses_calibration(config):
        return make_clock(
            config.clock,
            speed_factor=speed_factor,
            seconds_per_microbatch=config.seconds_per_microbatch,
            device=device,
        )
    path = calibration_file(config)
    if path is not None and path.exists():
        return CalibratedClock(Calibration.load(path), speed_factor=speed_factor)
    # Measured after the resume (finish_calibration), unless the checkpoint brings one. A
    # sharded worker's model is sharded by then, and its own pass is timed (no whole copy).
    if measure is not None:
        return CalibratedClock(speed_factor=speed_factor, measure=measure)

    def measured() -> Calibration:
        local = None
        if config.worker_sharding == "fsdp":
            local = sum(sharding.flat_numel(p) for p in model.parameters())
        with sharding.local_collectives(model):
            return calibrate(
                model,
                vocab_size=0,
                micro_batch_size=config.data.micro_batch_size,
                block_size=config.model.block_size,
                bookkeeping=bookkeeping,
                bf16=config.precision == "bf16-mixed",
                loss=timed_loss,
                local_elements=local,
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
    run (a study's one calibration): the run's model on its device, one intra-op thread as a
    worker runs, the same timed passes as :func:`calibrate` on a group of one, or, with
    ``bookkeeping``, on that group's processes in turn (agreeing on one calibration).
    ``model`` and ``timed_loss``: the run's own (a task's, see :func:`worker_clock`); default:
    the model of ``--model.*`` on random tokens of ``vocab_size``."""
    from lowcomm.comm.local import LocalComm
    from lowcomm.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if model is not None:
            pass
        elif config.init_from is None:
            model = build_model(config.model, vocab_size)
        else:
            from lowcomm.models.init_from import preflight_init_from

            model = preflight_init_from(config.init_from, config.model).load()
        return calibrate(
            model.to(torch.device(config.device)),
            vocab_size=vocab_size,
            micro_batch_size=config.data.micro_batch_size,
            block_size=config.model.block_size,
            bookkeeping=LocalComm() if bookkeeping is None else bookkeeping,
            bf16=config.precision == "bf16-mixed",
            loss=timed_loss,
        )
    finally:
        torch.set_num_threads(threads)


def calibration_file(config: TrainConfig) -> Path | None:
    """The --calibration file, if the run names one."""
    return None if config.calibration is None else Path(config.calibration)


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
    budget = config.token_budget
    return budget is not None and committed_tokens(config, strategy, consumed_tokens) >= budget
