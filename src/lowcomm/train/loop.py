"""The one training loop every strategy uses, run inside each worker process.

Per step: ``strategy.step(closure)`` on this worker, then (outside the clock) the workers'
step metrics are gathered on rank 0 and written to ``metrics.jsonl``. Validation runs on the
parameters the method would deploy, on a fixed set of held-out batches split across workers.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.comm.base import Comm, Role
from lowcomm.comm.cast import wire_dtype
from lowcomm.comm.clock import Clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.hierarchical import HierarchicalComm
from lowcomm.comm.turns import holding
from lowcomm.config import TrainConfig
from lowcomm.faults.engine import WorkerFaults
from lowcomm.faults.processes import quorum_levels
from lowcomm.models.gpt import drawing_from, dropout_modules
from lowcomm.models.recompute import checkpoint_blocks, compile_blocks
from lowcomm.strategies import MicroBatchResult, StepStats, Strategy, build_strategy
from lowcomm.strategies.base import run_microbatches
from lowcomm.train import checkpoint, sharding
from lowcomm.train.compute import (
    budget_spent,
    committed_tokens,
    finish_calibration,
    worker_clock,
)
from lowcomm.train.context import network_profile, replica_network_profile, strategy_context
from lowcomm.train.metrics import RunWriter, StepRecord
from lowcomm.train.records import ProcessTotals, StepMetrics, peak_memory_bytes
from lowcomm.train.reshard import read_resharded
from lowcomm.train.rundir import run_directory
from lowcomm.train.shared import SharedSetup
from lowcomm.train.step_log import StepLog, WorkerRows, parameters_finite
from lowcomm.train.task import (
    Batch,
    CorpusTask,
    Shard,
    Task,
    model_loss,
    to_device,
)

if TYPE_CHECKING:
    from lowcomm.faults.processes import ProcessFaults


class NonFiniteLoss(FloatingPointError):
    """Training produced a NaN or infinite loss or parameter."""


@dataclass
class WorkerSummary:
    """What one worker reports at the end of training."""

    rank: int
    compute_s: float
    exposed_comm_s: float
    clock_s: float
    bytes_sent: float
    bytes_by_role: dict[str, float]
    state_bytes: int
    tokens: int
    parameters: torch.Tensor | None = None
    """The final parameters, flattened (only with ``train_worker(keep_parameters=True)``)."""
    deployed_parameters: torch.Tensor | None = None
    """The final parameters the method deploys (what the last validation ran on), flattened
    (only with ``train_worker(keep_parameters=True)`` on a run that finished)."""


def _evaluate(
    model: torch.nn.Module, batches: list[Batch], bookkeeping: Comm, task: Task | None = None
) -> float | None:
    """Mean validation loss over all workers' batches (each worker evaluates its own): the
    mean over the batches of the workers that hold any. None when none does (fewer
    --eval-batches than workers, and those that hold them are out of the step's quorum, or
    a torchft worker, whose run is its own, holds none): there is no loss to report.

    The losses are summed on the model's device (no host read per batch) and the two sums
    travel on the bookkeeping group as a CPU tensor on every worker, batches or not: that
    group is Gloo (NCCL would reject a CPU tensor, and a worker without a validation batch
    has no device tensor to offer)."""
    was_training = model.training
    model.eval()
    loss_sum: torch.Tensor | None = None
    with torch.no_grad():
        for batch in batches:
            loss = model_loss(model, batch) if task is None else task.loss(model, batch)
            term = loss.detach().double()
            loss_sum = term if loss_sum is None else loss_sum + term
    model.train(was_training)
    total = torch.zeros(2, dtype=torch.float64)
    if loss_sum is not None:
        total[0] = loss_sum.cpu()  # the one host read of the evaluation
        total[1] = len(batches)
    bookkeeping.all_reduce(total, op="sum", role=Role.OTHER).wait()
    return float(total[0] / total[1]) if total[1] > 0 else None


def _unevaluated(worker: Worker, step: int) -> str:
    """Why a validation at ``step`` has no loss; said once per run on stderr."""
    run = worker.config.run
    reason = (
        f"no worker in the validation held a batch (--eval-batches {run.eval_batches} "
        f"among --workers {worker.config.placement.workers}): its val_loss is left out"
    )
    if not worker.unevaluated_said and worker.rank == 0:
        print(f"lowcomm: step {step}: {reason}", file=sys.stderr, flush=True)
    worker.unevaluated_said = True
    return reason


@dataclass
class Worker:
    """Everything one training process holds between steps (built by :func:`set_up`)."""

    config: TrainConfig
    rank: int
    """This process's global rank."""
    world_size: int
    """Processes in the run (workers x ranks per worker)."""
    device: torch.device
    model: torch.nn.Module
    clock: Clock
    comm: NetworkComm | HierarchicalComm
    """The strategy's communicator (charged to the emulated links)."""
    bookkeeping: Comm
    """Metrics, evaluation sums and checkpoint barriers (uncharged, CPU tensors)."""
    strategy: Strategy
    task: Task
    """The run's model, data and loss (the built-in GPT on the corpus by default)."""
    shard: Shard
    validation: list[Batch]
    """This process's slice of the validation batches (on its device)."""
    validation_batches: int
    """Validation batches of the whole run."""
    step_closure: Callable[[], MicroBatchResult]
    generator: torch.Generator
    """This worker's random stream on the CPU: a generator of its own in every placement,
    started at the state the process-global generator has after building the model (so a
    worker process and a worker thread draw the same numbers)."""
    device_generator: torch.Generator
    """This worker's random stream on its device, which the built-in GPT's dropout draws
    from (``generator`` itself on the CPU; on a GPU a CUDA generator started at the seed, as
    ``torch.manual_seed`` starts the device's own)."""
    one_process: bool = False
    """Every worker of the run is in this process (``--workers-per-process``)."""
    faults: WorkerFaults | None = None
    """This worker's view of the run's declared faults (None: the run has none)."""
    job_tokens: Callable[[], int] | None = None
    """The tokens the whole job has committed, as this worker holds them (a --membership
    torchft worker with --token-budget: every committed round adds the count it carried, the
    same on every live worker); None: summed here at each step (with faults) or counted from
    the tokens consumed."""
    unevaluated_said: bool = False
    """Whether a validation with no batch on any worker has been said (once a run)."""


@dataclass
class Progress:
    """Where training stands: the loop's counters (what a checkpoint saves besides state)."""

    start_step: int = 0
    tokens: int = 0
    val_loss: float = math.nan
    resumed_from: Path | None = None
    """The run directory a resume continued (None: a fresh start)."""
    extended_from: int | None = None
    """The steps of the finished run this one extends (None: not an extension)."""
    end_step: int | None = None
    """The step after which a --token-budget run ended (None: it runs to --steps)."""
    membership: dict[str, int] | None = None
    """The membership change this resume made (old and new workers), or None."""
    stopped: str | None = None
    """Why the run stopped early with a checkpoint, in one line (None: --stop-after)."""


def train_worker(
    config: TrainConfig,
    raw: Comm,
    *,
    keep_parameters: bool = False,
    bookkeeping: Comm | None = None,
    shared: SharedSetup | None = None,
    task: Task | None = None,
    levels: tuple[Comm, Comm] | None = None,
) -> WorkerSummary:
    """Train on this process. ``raw`` is the un-emulated communicator of the process group;
    strategy traffic goes through a :class:`NetworkComm` around it (or, with
    ``--ranks-per-worker R > 1``, a :class:`HierarchicalComm` over a replica-level and an
    outer ``NetworkComm``). Metrics, evaluation sums and checkpoint barriers go on
    ``bookkeeping``, a separate group of CPU tensors (by default a Gloo group made here on
    every rank, see :func:`bookkeeping_comm`), never on the strategy's group: on NCCL one
    communicator is one queue, and a small gather behind an in-flight all-reduce would wait
    for all of it. With ``keep_parameters`` the summary carries the final parameters (for
    tests). ``shared``: what the workers of this process share (``--workers-per-process``
    K > 1, :mod:`lowcomm.train.shared`); None: this process is this worker's own. ``task``
    gives the model, the data and the loss (default: :class:`CorpusTask`, ``lowcomm
    train``'s). ``levels``: with ``--ranks-per-worker R > 1``, this rank's (replica, outer)
    raw communicators when the caller made them (ranks as threads); None: made here over
    ``torch.distributed`` (:func:`lowcomm.launch.groups.level_comms`)."""
    set_up_start = time.perf_counter()
    books = bookkeeping_comm(raw) if bookkeeping is None else bookkeeping
    levels = quorum_levels(config, raw) if levels is None else levels  # (faults, R ranks)
    worker = set_up(config, raw, books, shared, task, levels)
    progress = resume(worker)
    finish_calibration(worker.clock, worker.config, worker.rank)  # (none to measure on a resume)
    if _first(worker):
        print(
            f"lowcomm: training: {_parameter_count(worker.model) / 1e6:.2f} M "
            f"parameters, {worker.validation_batches} validation batches; worker set-up "
            f"{time.perf_counter() - set_up_start:.1f} s",
            flush=True,
        )
    writer = _run_writer(worker, progress)
    start_wall = time.perf_counter()
    final = FinalState()
    try:
        with worker.clock.training():  # (the calibrated model counts the work done in it)
            if not train_steps(worker, progress, writer, final):
                return _stopped(worker, progress, final.writer or writer, keep_parameters)
            final_evaluation(worker, progress, final, keep_parameters)
            if progress.start_step < worker.config.run.steps:
                # The last step's checkpoint: `--resume OUT --steps MORE` extends the run.
                with worker.clock.excluded():
                    _save_checkpoint(worker, progress.end_step or worker.config.run.steps, progress)
    finally:
        writer = final.writer or writer  # (taken over from a killed worker 0)
        if writer is not None:
            if final.last_record is not None:
                writer.write_step(final.last_record)  # without val_loss if the evaluation failed
            writer.close_steps()
    return finish(
        worker, progress, writer, final, keep_parameters, time.perf_counter() - start_wall
    )


# --- set-up ------------------------------------------------------------------------------


def set_up(
    config: TrainConfig,
    raw: Comm,
    bookkeeping: Comm,
    shared: SharedSetup | None = None,
    task: Task | None = None,
    levels: tuple[Comm, Comm] | None = None,
) -> Worker:
    """Build this worker's model, clock, communicators, strategy, data shard and closure
    (``shared``: from what the workers of this process share, see :mod:`lowcomm.train.shared`;
    the model, data and loss from ``task``, default :class:`CorpusTask`; ``levels``: see
    :func:`train_worker`)."""
    task = CorpusTask() if task is None else task
    rank, world_size = raw.rank, raw.world_size
    device = _worker_device(config)
    model, rng_state, deferred = _initial_model(config, task, raw, device, shared)
    generator, device_generator = _worker_generators(rng_state, config.run.seed, device)
    if config.numerics.activation_checkpointing:
        checkpoint_blocks(model)
    if config.numerics.compile:  # (compiled on the first pass)
        compile_blocks(model)
    clock = worker_clock(config, task, bookkeeping, device)
    comm: NetworkComm | HierarchicalComm
    if (
        config.placement.worker_sharding == "fsdp"
    ):  # FSDP2 over the worker's ranks (train/sharding.py)
        links = (network_profile(config.comm), replica_network_profile(config.comm))
        comm = sharding.shard_worker(config, model, clock, device, links, deferred, levels)
    else:
        # The launch-time agreements of the virtual clock go on the world's host group (a
        # host float there, where on NCCL each was a device all-reduce and a host read).
        # With faults a round's collectives run over its quorum, which the world's group
        # does not follow: the quorum's own group agrees its launch times.
        books = None if bookkeeping is raw or _has_faults(config) else bookkeeping
        comm, _ = _strategy_comms(config, raw, clock, device, levels, books)
    # The strategy sees the Comm protocol and the runtime the comm describes (read-only
    # clock, replica group, uncharged channel, restoring of settled handles), nothing else.
    # (A worker of several ranks takes part in a quorum on each rank's outer group, where
    # its slot is the worker's index: its ranks enter, leave and heal together.)
    faults = _worker_faults(config, raw if levels is None else levels[1], clock, bookkeeping)
    runtime = comm.runtime() if faults is None else replace(comm.runtime(), membership=faults)
    if faults is not None and isinstance(comm, NetworkComm):
        comm.link_model = faults.transfer_time  # (link events: degraded or down)
    context = replace(strategy_context(config), runtime=runtime)
    strategy = build_strategy(config.method, model, comm, context, config)
    data = task.data(config, rank, None if shared is None else shared.validation)
    validation = [to_device(batch, device) for batch in data.validation]
    # Synchronous data parallel inside a worker (R > 1): the strategy averages its flat
    # gradient over the worker's ranks once per step (gradient_step.accumulate), charged to
    # the replica link (runtime.replica_group).
    bf16 = config.numerics.precision == "bf16-mixed"
    step_closure = _closure(model, task, data.shard, clock, device, bf16, device_generator)
    return Worker(
        config=config, rank=rank, world_size=world_size, device=device, model=model, clock=clock,
        comm=comm, bookkeeping=bookkeeping, strategy=strategy, task=task, shard=data.shard,
        validation=validation, validation_batches=data.validation_batches,
        step_closure=step_closure, generator=generator, device_generator=device_generator,
        one_process=shared is not None and shared.whole_run, faults=faults,
    )  # fmt: skip


def _worker_device(config: TrainConfig) -> torch.device:
    """This worker's device (on cuda the one its process is bound to), its peak memory
    counter reset and its TF32 setting (--tf32) applied."""
    device = torch.device(
        config.placement.device
        if config.placement.device == "cpu"
        else f"cuda:{torch.cuda.current_device()}"
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.backends.cuda.matmul.allow_tf32 = config.numerics.tf32
        torch.backends.cudnn.allow_tf32 = config.numerics.tf32
    return device


def _has_faults(config: TrainConfig) -> bool:
    """Whether the run replays a fault trace (a file or generated options)."""
    from lowcomm.faults.run import FaultSettings

    return FaultSettings.of(config.fault).enabled


def _worker_faults(
    config: TrainConfig, raw: Comm, clock: Clock, bookkeeping: Comm
) -> WorkerFaults | None:
    """This worker's view of the run's fault trace (None without one). The options were
    checked before any worker started (``config.validate()`` and the pre-flight): the
    workers are threads of this process on an in-process group, or processes whose raw
    communicator follows the quorum (lowcomm.faults.processes)."""
    from lowcomm.comm.inprocess import InProcessComm
    from lowcomm.comm.torch_comm import QuorumTorchComm
    from lowcomm.faults.run import run_trace, trace_extension
    from lowcomm.strategies import strategy_class

    trace = run_trace(config)
    rule = strategy_class(config.method).membership
    if trace is None or rule is None:
        return None
    from lowcomm.faults.stacked import QuorumStackedComm

    assert isinstance(raw, InProcessComm | QuorumTorchComm | QuorumStackedComm), (
        "a raw group that follows quorums"
    )
    extend, horizon_s = trace_extension(config)
    cls: type[WorkerFaults] = WorkerFaults
    if isinstance(raw, QuorumTorchComm):  # (worker processes: a group per quorum)
        from lowcomm.faults.processes import ProcessFaults

        cls = ProcessFaults
    elif isinstance(raw, QuorumStackedComm):  # (processes of several workers)
        from lowcomm.faults.stacked import StackedFaults

        cls = StackedFaults
    return cls(
        trace,
        slot=raw.slot,
        round_kind=rule.round,
        detection_s=config.fault.fault_detection_s,
        clock=clock,
        raw=raw,
        books=bookkeeping,
        extend=extend,
        horizon_s=horizon_s,
        min_workers=config.fault.fault_min_workers,
        quorum_wait_s=config.fault.fault_quorum_wait_s,
        say=_say,
    )


def _say(line: str) -> None:
    print(line, flush=True)


def _worker_generators(
    rng_state: torch.Tensor, seed: int, device: torch.device
) -> tuple[torch.Generator, torch.Generator]:
    """The worker's own (CPU, device) generators: the CPU one at ``rng_state`` (the global
    generator's after building the model), the device's at ``seed`` (a GPU's own generator
    after ``torch.manual_seed``; nothing draws from it before training)."""
    generator = torch.Generator()
    generator.set_state(rng_state)
    if device.type == "cpu":
        return generator, generator
    return generator, torch.Generator(device=device).manual_seed(seed)


def _initial_model(
    config: TrainConfig, task: Task, raw: Comm, device: torch.device, shared: SharedSetup | None
) -> tuple[torch.nn.Module, torch.Tensor, sharding.Rows | None]:
    """This worker's initial model, the state of the global generator after building it (the
    worker's generator starts there), and for a sharded worker the model's deferred values
    (the model then on ``meta``: sharding.initial_model)."""
    if shared is not None:  # one of several workers in this process: a copy of the one model
        room = (
            config.placement.workers * config.placement.ranks_per_worker
        )  # (any strategy's padding fits)
        return shared.copy_model(room), shared.rng_state, None
    torch.manual_seed(config.run.seed)
    if config.placement.worker_sharding == "fsdp":  # (made shard by shard, after fully_shard)
        model, deferred = sharding.initial_model(config, lambda: task.model(config), raw.rank)
        return model, torch.get_rng_state(), deferred
    return _shared_initial_model(config, task, raw, device), torch.get_rng_state(), None


def _shared_initial_model(
    config: TrainConfig, task: Task, raw: Comm, device: torch.device
) -> torch.nn.Module:
    model = task.model(config).to(device)
    # Same seed gives the same initial model everywhere; broadcast anyway (uncharged) so that
    # workers on different machines or library builds provably start from one point.
    with torch.no_grad():
        for parameter in model.parameters():
            raw.broadcast(parameter.data, src=0, role=Role.PARAMETER).wait()
    return model


def _strategy_comms(
    config: TrainConfig,
    raw: Comm,
    clock: Clock,
    device: torch.device,
    levels: tuple[Comm, Comm] | None = None,
    bookkeeping: Comm | None = None,
) -> tuple[NetworkComm | HierarchicalComm, Comm | None]:
    """The strategy's communicator and, with ranks per worker > 1, the replica-level one
    (between the ranks of one worker) the averaging closure uses. ``levels``: the raw
    (replica, outer) communicators, when the caller made them. ``bookkeeping``: a host group
    of ``raw``'s ranks, on which a flat worker's virtual clock agrees on launch times (the
    level groups made here get host groups of their own for that)."""
    profile = network_profile(config.comm)
    wire = wire_dtype(config.comm.comm_dtype)
    if config.placement.ranks_per_worker == 1:
        comm = NetworkComm(
            raw, profile, clock, device=device, wire_dtype=wire, bookkeeping=bookkeeping
        )
        return comm, None
    books: tuple[Comm | None, Comm | None] = (None, None)
    if levels is None:
        from lowcomm.launch.groups import level_comms

        timeout = config.comm.collective_timeout_s
        levels = level_comms(config.placement.ranks_per_worker, timeout)
        if bookkeeping is not None:
            books = level_comms(config.placement.ranks_per_worker, timeout, backend="gloo")
    replica_raw, outer_raw = levels
    replica_profile = replica_network_profile(config.comm)
    replica_comm = NetworkComm(
        replica_raw, replica_profile, clock, device=device, wire_dtype=wire, bookkeeping=books[0]
    )
    outer_comm = NetworkComm(
        outer_raw, profile, clock, device=device, wire_dtype=wire, bookkeeping=books[1]
    )
    return HierarchicalComm(replica_comm, outer_comm, clock), replica_comm


def _closure(
    model: torch.nn.Module, task: Task, shard: Shard, clock: Clock, device: torch.device,
    bf16: bool, generator: torch.Generator,
) -> Callable[[], MicroBatchResult]:  # fmt: skip
    """Forward and backward on the next micro-batch at the model's current parameters (with
    ``bf16``, under bfloat16 autocast: the backward runs in the forward's dtypes, the
    gradients land in the float32 parameters' float32 ``.grad``). The batch goes to the
    device from pinned memory on a GPU (:func:`to_device`). The built-in GPT's dropout draws
    from ``generator`` (the worker's device generator) during the micro-batch only: nothing
    else (a calibration pass) moves the worker's stream."""
    dropouts = dropout_modules(model)

    def closure() -> MicroBatchResult:
        with clock.microbatch(), drawing_from(dropouts, generator):
            batch = to_device(shard.next_batch(), device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = task.loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
        samples, units = task.count(batch)
        # The loss stays on the device: it is read every --log-every steps (train/step_log.py).
        return MicroBatchResult(loss=loss.detach(), samples=samples, tokens=units)

    return closure


# --- resume ------------------------------------------------------------------------------


def resume(worker: Worker) -> Progress:
    """Restore the latest checkpoint when the run resumes (else a fresh start); every process
    has read its file before anyone may write a new one."""
    config = worker.config
    progress = Progress()
    resume_from = _resume_directory(config, run_directory(config), worker.bookkeeping)
    if resume_from is not None:
        # Each rank verifies its own files; all agree on the newest intact for everyone.
        start_step, directory = checkpoint.agree_latest(
            resume_from, worker.world_size, checkpoint.fingerprint(config), worker.bookkeeping
        )
        # Written with another number of workers: re-sharded here (train/reshard.py).
        saved = read_resharded(directory, config, worker.rank, worker.device)
        progress = restore(worker, saved, start_step, resume_from, directory)
    worker.bookkeeping.barrier().wait()
    if resume_from is not None and _first(worker):
        # Said whatever --progress is: a resumed run must not look like a fresh one.
        print(
            f"lowcomm: resumed {resume_from} from step {progress.start_step} (checkpoint "
            f"{directory.name}{_membership_note(progress)}); training steps "
            f"{progress.start_step + 1} to {config.run.steps}",
            flush=True,
        )
    return progress


def restore(
    worker: Worker, saved: dict[str, Any], start_step: int, resume_from: Path, directory: Path
) -> Progress:
    """Load a checkpoint's state of this worker (``saved``, read from ``directory``); the
    progress it resumes at."""
    sharding.load_model_state(worker.model, saved["model"])
    worker.strategy.load_state_dict(saved["strategy"])
    worker.shard.load_state_dict(saved["data"])
    worker.clock.load_state_dict(saved["clock"])
    if saved["comm"] is not None:  # None: another --ranks-per-worker, counters afresh
        worker.comm.load_state_dict(saved["comm"])
    _restore_rng(saved["rng"], worker.generator, worker.device_generator)
    if worker.faults is not None:  # (the fingerprint has checked it is the same trace)
        worker.faults.load_state_dict(saved["faults"])
    return Progress(
        start_step=start_step, tokens=int(saved["tokens"]), val_loss=float(saved["val_loss"]),
        resumed_from=resume_from, membership=saved.get("membership"),
        extended_from=checkpoint.extension_of(directory, worker.config.run.steps),
    )  # fmt: skip


def _membership_note(progress: Progress) -> str:
    change = progress.membership
    if change is None:
        return ""
    return f", re-sharded from {change['old_workers']} to {change['new_workers']} workers"


def _first(worker: Worker) -> bool:
    """Whether this is the run's first process (rank 0; with declared faults in worker
    processes a worker may have several processes in turn, and only the first of worker 0's
    is the run's)."""
    from lowcomm.faults.processes import ProcessFaults

    if isinstance(worker.faults, ProcessFaults):
        return worker.faults.process == 0
    return worker.rank == 0


def _run_writer(worker: Worker, progress: Progress) -> RunWriter | None:
    """Rank 0's writer of the run directory (None on the other ranks)."""
    if not _first(worker):
        return None
    resumed = progress.resumed_from is not None
    writer = RunWriter(worker.config, resume_step=progress.start_step if resumed else None)
    if progress.extended_from is not None:
        writer.extended_at.append(progress.extended_from)
    writer.membership = progress.membership
    return writer


# --- steps -------------------------------------------------------------------------------


@dataclass
class FinalState:
    """What the end of training fills in."""

    last_record: StepRecord | None = None
    """The last step's record, written once the final validation gives it its val_loss."""
    clock_s: float = math.nan
    """The clock after the final drain."""
    writer: RunWriter | None = None
    """The run directory's writer, when this process took it over from worker 0's killed
    process (worker processes with declared faults)."""
    deployed: torch.Tensor | None = None
    """The deployed parameters, flattened (with keep_parameters)."""
    unevaluated: str | None = None
    """Why the final validation has no loss (None: it has one)."""


def train_steps(
    worker: Worker, progress: Progress, writer: RunWriter | None, final: FinalState
) -> bool:
    """Train from the start step to the end; False if the run stopped early (--stop-after)."""
    config = worker.config
    log = StepLog(config.run.log_every)
    for step in range(progress.start_step, config.run.steps):
        if not train_step(worker, step, progress, final.writer or writer, final, log):
            return False
        if progress.end_step is not None:
            return True
    return True


def train_step(
    worker: Worker,
    step: int,
    progress: Progress,
    writer: RunWriter | None,
    final: FinalState,
    log: StepLog,
) -> bool:
    """One optimizer step, then (outside the clock) its evaluation and checkpoint; its
    metrics are held in ``log`` and read, checked and written every --log-every steps and
    before a checkpoint or the end. False if the run stops after it (--stop-after), or
    before it when no quorum of --fault-min-workers formed for it in --fault-quorum-wait-s."""
    config, clock, comm = worker.config, worker.clock, worker.comm
    # (Markers: on a GPU the step's compute and exposed times are known once the device has
    # run it; they are read with the loss, every --log-every steps.)
    begin = clock.marker()
    before_bytes = comm.bytes_sent
    member = True
    # (A wait for the quorum is the step's: its clock and exposed time include it.)
    lost = worker.faults is not None and worker.faults.quorum_lost(step)
    if _processes_at(worker, step, progress, writer, final, log):  # (took over its slot)
        begin, before_bytes = clock.marker(), comm.bytes_sent
    writer = final.writer or writer  # (taken over from a killed worker 0)
    if lost:
        assert worker.faults is not None
        _stop_without_quorum(worker, worker.faults, step, progress, writer, final, log)
        return False
    if worker.faults is None:
        stats = worker.strategy.step(worker.step_closure)
    else:
        stats, member = _step_with_faults(worker, worker.faults, step)
    now = clock.now()
    end = clock.marker()
    progress.tokens += stats.tokens
    if _budget_spent(worker, progress):
        progress.end_step = step + 1
    with clock.excluded():
        mine = _own_metrics(stats, comm.bytes_sent - before_bytes, now)
        is_last = step == config.run.steps - 1 or progress.end_step is not None
        evaluate = (step + 1) % config.run.eval_every == 0 and not is_last
        val_loss = _step_evaluation(worker, member) if evaluate else None
        if val_loss is not None:
            progress.val_loss = val_loss
        elif evaluate:
            _unevaluated(worker, step)
        log.hold(
            step, stats, mine, parameters_finite(worker.model), val_loss, (begin, end)
        )  # fmt: skip
        stopped = config.run.stop_after is not None and step + 1 == config.run.stop_after
        every = config.run.checkpoint_every
        save = (every is not None and (step + 1) % every == 0 and not is_last) or stopped
        if save or is_last or log.due(step):
            # (Before a checkpoint: a non-finite state must stop the run, not be saved.)
            _write_held(worker, log, writer, final, clock.kind, is_last)
        if save:
            _save_checkpoint(worker, step + 1, progress)
    return not stopped


def _own_metrics(stats: StepStats, bytes_sent: float, clock_s: float) -> StepMetrics:
    """This worker's metrics of a step as it ends: its bytes, clock and counts; its loss and
    times are read later, with the held steps."""
    return StepMetrics(
        loss=math.nan,  # (held on the device until the read)
        compute_s=math.nan,  # (from the markers, at the read)
        exposed_comm_s=math.nan,
        bytes_sent=bytes_sent,
        clock_s=clock_s,
        microbatches=stats.microbatches,
        tokens=stats.tokens,
        committed_steps=stats.committed_steps,
        params_finite=math.nan,
    )


def _processes_at(
    worker: Worker,
    step: int,
    progress: Progress,
    writer: RunWriter | None,
    final: FinalState,
    log: StepLog,
) -> bool:
    """Worker processes (:mod:`lowcomm.faults.processes`): at a step where a slot changes
    process, the held steps are written first (their rows are the old processes'), then each
    process that a crash kills hands over its totals and state and dies, the others go on
    with their bookkeeping over the live processes, and a process that stood by for a slot
    takes it over from what its killed process handed over (True: this one did)."""
    from lowcomm.comm.torch_comm import LiveBookkeeping
    from lowcomm.faults.processes import ProcessFaults

    faults, books = worker.faults, worker.bookkeeping
    if not isinstance(faults, ProcessFaults) or not isinstance(books, LiveBookkeeping):
        return False
    # (A resumed run started again the processes killed before its checkpoint.)
    since = 0 if step == progress.start_step else None
    killed = faults.killed_at(step, since=since)
    if killed or faults.changed_at(step):
        with worker.clock.excluded():
            _write_held(worker, log, writer, final, worker.clock.kind, False)
            if faults.process in killed:
                summary = _worker_summary(worker, progress, worker.clock.now(), False)
                totals = _process_totals(worker, summary).to_tensor()
                state = _state(worker, step, progress)
                faults.hand_over(step, totals, state, summary.bytes_by_role)
            if killed:
                books.barrier().wait()  # (what the killed hand over is written)
            if faults.process in killed:
                faults.die(step)
            books.leave_out(killed)
    books.hold(faults.holders(step))
    if writer is None and final.writer is None and faults.writes(step):
        # Worker 0's process was killed: the lowest live worker writes the run directory on,
        # from the steps already in it.
        final.writer = RunWriter(worker.config, resume_step=step)
        if progress.extended_from is not None:
            final.writer.extended_at.append(progress.extended_from)
    if not faults.took_over(step):
        return False
    with worker.clock.excluded():
        _take_over(worker, faults, progress)
    return True


def _take_over(worker: Worker, faults: ProcessFaults, progress: Progress) -> None:
    """This process takes over its slot at a join: the state its killed process handed
    over (the model, the method's state, the data position, the clock and counters, the
    random streams), which the join then heals as it would the slot's thread."""
    saved = faults.handed_over(faults.rank_slot)["state"]
    sharding.load_model_state(worker.model, saved["model"])
    worker.strategy.load_state_dict(saved["strategy"])
    worker.shard.load_state_dict(saved["data"])
    worker.clock.load_state_dict(saved["clock"])
    if saved["comm"] is not None:
        worker.comm.load_state_dict(saved["comm"])
    _restore_rng(saved["rng"], worker.generator, worker.device_generator)
    faults.take_over(saved["faults"])
    progress.tokens = int(saved["tokens"])


def _step_evaluation(worker: Worker, member: bool) -> float | None:
    """The validation loss of the deployed parameters after a step (a worker outside the
    step's quorum takes its turn in the sums with no batch); None: no worker held one."""
    if not member:
        return _evaluate(worker.model, [], worker.bookkeeping, worker.task)
    with worker.strategy.deployed() as deployed_model:
        return _evaluate(deployed_model, worker.validation, worker.bookkeeping, worker.task)


def _stop_without_quorum(
    worker: Worker,
    faults: WorkerFaults,
    step: int,
    progress: Progress,
    writer: RunWriter | None,
    final: FinalState,
    log: StepLog,
) -> None:
    """No quorum formed for ``step`` in the time the run waits for one: write the steps
    held, checkpoint the state before ``step`` (every worker, the live ones' clocks at the
    wait's end) and say in one line how to continue."""
    stall = faults.stalled
    assert stall is not None
    with worker.clock.excluded():
        _write_held(worker, log, writer, final, worker.clock.kind, False)
        _save_checkpoint(worker, step, progress)
    out = run_directory(worker.config)
    live = ", ".join(map(str, stall.alive))
    missing = ", ".join(map(str, stall.missing))
    progress.stopped = (
        f"lowcomm: no quorum at step {step}: --fault-min-workers {stall.min_workers} needs "
        f"{stall.min_workers} live workers, worker {live} waited {stall.waited_s:g} s "
        f"(--fault-quorum-wait-s {stall.quorum_wait_s:g}) and worker {missing} did not join; "
        f"stopped with a checkpoint in {out}; continue with: lowcomm train --resume {out} "
        f"--fault-quorum-wait-s {max(2 * stall.quorum_wait_s, 60.0):g} (a longer wait) or "
        f"--fault-min-workers {len(stall.alive)}"
    )


def _step_with_faults(worker: Worker, faults: WorkerFaults, step: int) -> tuple[StepStats, bool]:
    """One step under the fault trace (:mod:`lowcomm.faults.engine`); returns the step's
    stats and whether this worker was a member of its quorum."""
    strategy = worker.strategy
    plan = faults.plan(step)
    if not plan.member:
        faults.lose_pending()
        if faults.loses_state_in_place and faults.slot in plan.lost:
            from lowcomm.faults.processes import lose_state

            with worker.clock.excluded():
                lose_state(worker.model, strategy)
        absent = StepStats(
            loss=math.nan, microbatches=0, samples=0, tokens=0,
            lr=strategy.lr_at(strategy.step_index), committed_steps=0,
        )  # fmt: skip
        return absent, False
    faults.begin(plan, step)
    if plan.joining:
        assert plan.source is not None
        joined = plan.quorum.joined
        strategy.heal(plan.source, joining=joined, kept=joined and faults.kept_state(plan))
    if plan.dropped:
        # The step's collectives cannot complete: its gradient is computed, then discarded
        # once the crash is detected; the next step's accumulation zeroes it.
        count = worker.config.run.microbatches_per_step
        loss, samples, tokens = run_microbatches(worker.step_closure, count)
        faults.drop()
        stats = StepStats(
            loss=loss, microbatches=count, samples=samples, tokens=tokens,
            lr=strategy.lr_at(strategy.step_index), committed_steps=0,
        )  # fmt: skip
        return stats, True
    stats = strategy.step(worker.step_closure)
    faults.account(
        stats.tokens, committed_round=strategy.round_committed(stats),
        settled=strategy.settled_syncs(), launched_at=strategy.step_index,
    )  # fmt: skip
    faults.note_failed_syncs(step, int(stats.extras.get("syncs_dropped", 0)))
    return stats, True


def _write_held(
    worker: Worker,
    log: StepLog,
    writer: RunWriter | None,
    final: FinalState,
    clock_kind: str,
    is_last: bool,
) -> None:
    """Read and gather the held steps' metrics and write them, in order, up to a step with a
    non-finite loss or parameter, which stops the run."""
    steps = log.read(worker.bookkeeping, worker.clock)
    faults = worker.faults
    for index, (held, everyone) in enumerate(steps):
        members = _stepped(everyone, None if faults is None else _member_rows(worker, held.step))
        _check_finite(held.step, everyone, members)
        if writer is None:
            continue
        rows = everyone.records()
        record = StepRecord.from_workers(
            held.step, held.lr, rows if members is None else [rows[k] for k in members],
            held.val_loss, clock_kind, held.extras,
        )  # fmt: skip
        if faults is not None:
            fault_record(record, faults, held.step)
        if is_last and index == len(steps) - 1:
            # Written once the final validation gives it its val_loss, so metrics.jsonl
            # and loss.png end on summary.json's final_val_loss.
            final.last_record = record
        else:
            writer.write_step(record)


def _member_rows(worker: Worker, step: int) -> tuple[int, ...]:
    """The bookkeeping rows of ``step``'s quorum: each member's ranks (a worker of R ranks
    has rows ``w R .. w R + R - 1``, one per rank thread or process)."""
    assert worker.faults is not None
    ranks = worker.config.placement.ranks_per_worker
    return tuple(w * ranks + r for w in worker.faults.members(step) for r in range(ranks))


def _stepped(everyone: WorkerRows, members: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The workers whose rows make the step's record: the quorum's members (every worker
    without faults), less those that took no step at this loop step (a method whose workers go
    at their own pace, decoupled_diloco, reports no micro-batch and a NaN loss then)."""
    idle = (everyone.column("microbatches") == 0) & torch.isnan(everyone.column("loss"))
    if not bool(idle.any()):
        return members
    pool = range(len(everyone)) if members is None else members
    stepped = tuple(k for k in pool if not bool(idle[k]))
    return stepped or members


def fault_record(record: StepRecord, faults: WorkerFaults, step: int) -> None:
    """Add the step's quorum size and its membership events to its record."""
    plan = faults.plan(step)
    record.quorum = plan.quorum.size
    if plan.events:
        record.membership_events = [
            {"worker": int(event.worker or 0), "kind": event.kind} for event in plan.events
        ]
    if plan.dropped:
        record.dropped = True


def _check_finite(step: int, everyone: WorkerRows, members: tuple[int, ...] | None = None) -> None:
    """Stop the run on a non-finite loss or parameter on any worker (of ``members``, the
    step's quorum, when the run has faults: the others took no step)."""
    losses = everyone.column("loss")
    # (A worker that took no step at this loop step reports a NaN loss and no micro-batch:
    # decoupled_diloco's learner ahead of the others, the only row of a torchft worker's run.)
    finite = torch.isfinite(losses) | ((everyone.column("microbatches") == 0) & losses.isnan())
    if members is not None:
        outside = torch.ones_like(finite)
        outside[list(members)] = False
        finite |= outside
    bad = (~finite).nonzero()
    if len(bad):
        rank = int(bad[0])
        raise NonFiniteLoss(
            f"step {step}: worker {rank} reported a non-finite loss ({float(losses[rank])}); "
            f"lower --optim.lr or check the data{_NOT_SAVED}"
        )
    flags = everyone.column("params_finite") == 1.0
    if members is not None:
        outside = torch.ones_like(flags)
        outside[list(members)] = False
        flags |= outside
    bad = (~flags).nonzero()
    if len(bad):
        rank = int(bad[0])
        raise NonFiniteLoss(
            f"step {step}: worker {rank} has non-finite parameters after the update (a "
            f"NaN/inf gradient); lower --optim.lr or --max-grad-norm{_NOT_SAVED}"
        )


# --- finish ------------------------------------------------------------------------------


def _stopped(
    worker: Worker, progress: Progress, writer: RunWriter | None, keep_parameters: bool
) -> WorkerSummary:
    """The summary of a run that stopped early with a checkpoint (--stop-after)."""
    if writer is not None:
        writer.close_steps()
        print(
            progress.stopped
            or f"lowcomm: stopped after step {worker.config.run.stop_after} with a checkpoint in "
            f"{run_directory(worker.config)}; continue with: lowcomm train --resume "
            f"{run_directory(worker.config)}",
            flush=True,
        )
    return _worker_summary(worker, progress, worker.clock.now(), keep_parameters)


def final_evaluation(
    worker: Worker, progress: Progress, final: FinalState, keep_parameters: bool
) -> None:
    """Drain the method's communication, then validate the parameters it deploys (a
    worker outside the last step's quorum takes its turn in the sums with no batch)."""
    faults, last = worker.faults, worker.config.run.steps - 1
    if faults is not None and not faults.plan(last).member:
        final.clock_s = worker.clock.now()
        with worker.clock.excluded():
            value = _evaluate(worker.model, [], worker.bookkeeping, worker.task)
        _final_val_loss(worker, progress, final, value)
        return
    worker.strategy.finish()
    settled = worker.strategy.settled_syncs()
    if faults is not None and settled is not None:  # (the drain settles the last syncs)
        at = worker.strategy.step_index
        faults.account(0, committed_round=True, settled=settled, launched_at=at)
        faults.note_failed_syncs(last, sum(1 for _, applied in settled if not applied))
    final.clock_s = worker.clock.now()
    with worker.clock.excluded(), worker.strategy.deployed() as deployed_model:
        value = _evaluate(deployed_model, worker.validation, worker.bookkeeping, worker.task)
        if keep_parameters:
            final.deployed = _flat_parameters(deployed_model)
        # (sharded: gathered whole by worker 0's ranks)
        exported = sharding.exportable(
            deployed_model, worker.rank, worker.config.placement.ranks_per_worker
        )
        if worker.rank == 0 and exported is not None:
            # The deployed parameters (rank 0's: worker 0's outer copy for eager and the
            # delayed DiLoCo) become OUT/model/.
            worker.task.export(exported, run_directory(worker.config) / "model", worker.config)
    _final_val_loss(worker, progress, final, value)


def _final_val_loss(
    worker: Worker, progress: Progress, final: FinalState, value: float | None
) -> None:
    """The final validation's loss into the last step's record and the summary; with no
    loss (no worker held a batch) both leave it out, and the summary says why."""
    progress.val_loss = math.nan if value is None else value
    if value is None:
        final.unevaluated = _unevaluated(worker, worker.config.run.steps - 1)
    if final.last_record is not None:
        final.last_record.val_loss = value


def _worker_summary(
    worker: Worker, progress: Progress, clock_s: float, keep_parameters: bool,
    deployed: torch.Tensor | None = None,
) -> WorkerSummary:  # fmt: skip
    clock, comm = worker.clock, worker.comm
    clock.settle_timing()
    return WorkerSummary(
        rank=worker.rank, compute_s=clock.compute_s, exposed_comm_s=clock.exposed_comm_s,
        clock_s=clock_s, bytes_sent=comm.bytes_sent, bytes_by_role=comm.counters(),
        state_bytes=worker.strategy.state_bytes(), tokens=progress.tokens,
        parameters=_flat_parameters(worker.model) if keep_parameters else None,
        deployed_parameters=deployed,
    )  # fmt: skip


def finish(
    worker: Worker, progress: Progress, writer: RunWriter | None, final: FinalState,
    keep_parameters: bool, wall_clock_s: float,
) -> WorkerSummary:  # fmt: skip
    """Gather every process's totals on rank 0 (uncharged), which writes the summary."""
    summary = _worker_summary(worker, progress, final.clock_s, keep_parameters, final.deployed)
    everyone = _process_totals(worker, summary).all_gather(worker.bookkeeping)
    fault_committed, failed_syncs = None, 0
    if worker.faults is not None:
        fault_committed = _fault_committed(worker, worker.faults)
        # (Every member of a step sees its failed syncs alike; a worker away saw none.)
        failed = torch.zeros(worker.config.run.steps, dtype=torch.float64)
        for at, count in worker.faults.failed_syncs.items():
            failed[at] = count
        worker.bookkeeping.all_reduce(failed, op="max", role=Role.OTHER).wait()
        failed_syncs = int(failed.sum())
    bytes_by_role = _bytes_by_role(worker, summary)
    if writer is not None:
        _add_killed(worker, everyone)
        config = worker.config
        if worker.faults is not None:
            assert fault_committed is not None
            writer.faults = fault_summary(
                worker.faults, writer.records, fault_committed, config, failed_syncs
            )
        writer.finish(
            per_process=everyone,
            bytes_by_role=bytes_by_role,
            num_params=_parameter_count(worker.model),
            final_val_loss=progress.val_loss if final.unevaluated is None else None,
            final_val_loss_note=final.unevaluated,
            wall_clock_s=wall_clock_s,
            clock_kind=worker.clock.kind,
            compute_model=worker.clock.describe_compute(),
            committed_tokens=_committed(worker, progress, fault_committed),
            network=network_profile(config.comm),
            task=worker.task.describe(),
            replica_network=replica_network_profile(config.comm)
            if config.placement.ranks_per_worker > 1
            else None,
        )
    return summary


def _committed(worker: Worker, progress: Progress, fault_committed: int | None) -> int:
    """summary.json's committed tokens: the job's, summed over its workers."""
    if fault_committed is not None:
        return fault_committed
    if worker.job_tokens is not None:
        return worker.job_tokens()
    consumed = progress.tokens * worker.world_size
    return committed_tokens(worker.config, worker.strategy, consumed)


def _add_killed(worker: Worker, everyone: list[ProcessTotals]) -> None:
    """The totals of the workers whose processes were killed (their rows of ``everyone``
    gathered empty), from what they handed over."""
    from lowcomm.faults.processes import ProcessFaults

    if isinstance(worker.faults, ProcessFaults):
        for slot in worker.faults.vacant_now():
            totals = worker.faults.handed_over(slot)["totals"]
            everyone[slot] = ProcessTotals.from_rows(totals)[0]


def _bytes_by_role(worker: Worker, summary: WorkerSummary) -> dict[str, float]:
    """Worker 0's bytes by role, as summary.json gives them: this process's, or with
    declared faults in worker processes those of worker 0's process (an uncharged sum over
    the live processes, which every one takes part in), or what its killed process handed
    over."""
    from lowcomm.faults.processes import ProcessFaults

    faults = worker.faults
    if not isinstance(faults, ProcessFaults):
        return summary.bytes_by_role
    if 0 in faults.vacant_now():
        return dict(faults.handed_over(0)["bytes_by_role"])
    names = [role.value for role in Role]
    holds = worker.rank == 0 and faults.holds_now()
    mine = [summary.bytes_by_role.get(name, 0.0) if holds else 0.0 for name in names]
    ours = torch.tensor(mine, dtype=torch.float64)
    worker.bookkeeping.all_reduce(ours, op="sum", role=Role.OTHER).wait()
    return dict(zip(names, ours.tolist(), strict=True))


def _budget_spent(worker: Worker, progress: Progress) -> bool:
    """Whether a --token-budget run has committed its budget at this step's end (False
    without a budget). With faults, committed is goodput's numerator (a dropped round's
    tokens, and those a lost worker had not committed, do not count), summed over every
    worker on the bookkeeping group at every step: every worker of every placement, member
    of the step's quorum or not, reads the same sum and ends at the same step."""
    config = worker.config
    budget = config.run.token_budget
    if budget is None:
        return False
    if worker.job_tokens is not None:  # (replicated on every worker: no collective here)
        return worker.job_tokens() >= budget
    if worker.faults is None:
        return budget_spent(config, worker.strategy, progress.tokens * worker.world_size)
    return _fault_committed(worker, worker.faults) >= budget


def _fault_committed(worker: Worker, faults: WorkerFaults) -> int:
    """Every worker's committed tokens so far, summed (uncharged; collective over the
    bookkeeping group), with those of killed worker processes."""
    committed = torch.tensor([float(faults.committed_tokens)], dtype=torch.float64)
    worker.bookkeeping.all_reduce(committed, op="sum", role=Role.OTHER).wait()
    return int(committed[0]) + _killed_committed(worker)


def _killed_committed(worker: Worker) -> int:
    from lowcomm.faults.processes import ProcessFaults

    faults = worker.faults
    return faults.committed_by_vacant() if isinstance(faults, ProcessFaults) else 0


def fault_summary(
    faults: WorkerFaults,
    records: list[StepRecord],
    committed: int,
    config: TrainConfig,
    failed_syncs: int = 0,
) -> dict[str, object]:
    """summary.json's ``faults``: goodput, rounds dropped (steps dropped, and ``failed_syncs``:
    syncs that failed on every member), worker-seconds lost and the membership changes
    (lowcomm.faults.goodput).

    Goodput's fault-free step time is the mean modeled time of this run's steps that had
    every worker, no membership event and no slow worker: what a step costs without a fault.
    The mean, not the median: a local method's steps are mostly inner steps, and the median
    would leave out the sync that one step in H pays, overstating the fault-free rate. A run
    with no such step reports no goodput (null)."""
    from lowcomm.faults import goodput as accounting

    trace, workers = faults.trace, config.placement.workers
    rates = faults.rates  # (the slow events, without the membership ones)
    modeled_s = max((r.clock_s for r in records), default=0.0)
    clean, previous = [], 0.0
    for record in records:
        slow = any(
            rates.speed_factor(k, step=record.step, time=previous) != 1.0 for k in range(workers)
        )
        if record.quorum == workers and not record.membership_events and not slow:
            clean.append(record.clock_s - previous)
        previous = record.clock_s
    per_step = config.run.microbatches_per_step * config.tokens_per_microbatch()
    ratio: float | None = None
    lost: float | None = None
    if clean and modeled_s > 0:
        step_s = sum(clean) / len(clean)
        free = accounting.fault_free_tokens(
            workers=workers, tokens_per_worker_step=per_step, fault_free_step_s=step_s,
            modeled_s=modeled_s,
        )  # fmt: skip
        ratio = accounting.goodput(committed_tokens=committed, fault_free_tokens=free)
        lost = accounting.worker_seconds_lost(
            workers=workers, modeled_s=modeled_s, goodput=min(ratio, 1.0)
        )
    return {
        "source": trace.source,
        "detection_s": faults.detection_s,
        "committed_tokens": committed,
        "goodput": ratio,
        "rounds_dropped": sum(1 for r in records if r.dropped) + failed_syncs,
        "worker_seconds_lost": lost,
        "membership_changes": [
            {"step": r.step, "events": r.membership_events, "quorum": r.quorum}
            for r in records
            if r.membership_events
        ],
    }


def _process_totals(worker: Worker, summary: WorkerSummary) -> ProcessTotals:
    comm, device = worker.comm, worker.device
    if isinstance(comm, HierarchicalComm | sharding.ShardedWorkerComm):  # two links
        levels = comm.level_counters()
        replica, outer = levels["inner"], levels["outer"]
    else:  # flat workers: everything on the outer link
        replica = {"bytes_sent": 0.0, "exposed_comm_s": 0.0}
        outer = {"bytes_sent": summary.bytes_sent, "exposed_comm_s": summary.exposed_comm_s}
    return ProcessTotals(
        compute_s=summary.compute_s, exposed_comm_s=summary.exposed_comm_s,
        clock_s=summary.clock_s, bytes_sent=summary.bytes_sent,
        state_bytes=float(summary.state_bytes), tokens=float(summary.tokens),
        replica_bytes_sent=replica["bytes_sent"], replica_exposed_comm_s=replica["exposed_comm_s"],
        outer_bytes_sent=outer["bytes_sent"], outer_exposed_comm_s=outer["exposed_comm_s"],
        peak_memory=float(peak_memory_bytes(device)),
    )  # fmt: skip


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


_NOT_SAVED = "; the run stopped here and no checkpoint holds this state"

#: Held by the worker that writes its checkpoint file (the workers of one process take turns).
_WRITE_TURN = threading.Lock()


def _resume_directory(config: TrainConfig, run_dir: Path, bookkeeping: Comm) -> Path | None:
    """Where to resume from: --resume DIR, or with --resume auto the run directory when it
    holds a checkpoint (an elastic restart), else nowhere (a fresh start).

    With --resume auto every rank looks at its own disk, and the ranks agree on what they
    saw (a collective over ``bookkeeping``) before any branches: a rank that resumed while
    another started afresh would wait in collectives the other never makes.

    Raises:
        CheckpointError: on every rank alike, when some ranks see a checkpoint and others
            do not.
    """
    if config.run.resume is None:
        return None
    if config.run.resume != "auto":
        return Path(config.run.resume)
    mine = int(checkpoint.has_checkpoint(run_dir))
    seen = torch.tensor([mine, -mine], dtype=torch.int64)
    bookkeeping.all_reduce(seen, op="max", role=Role.OTHER).wait()
    anyone, everyone = int(seen[0]) == 1, -int(seen[1]) == 1
    if everyone:
        return run_dir
    if not anyone:
        return None
    where = "sees one" if mine else "sees none"
    raise checkpoint.CheckpointError(
        f"--resume auto: ranks disagree on whether {run_dir / 'checkpoints'} holds a "
        f"checkpoint (rank {bookkeeping.rank} {where}); give every rank the run directory "
        f"(a shared filesystem, or a copy of the checkpoints on each node), or --resume DIR"
    )


def _rng_state(
    generator: torch.Generator, device_generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """The random generators a resumed run must continue: the worker's CPU generator and, on
    a GPU, its device generator (dropout masks are drawn there)."""
    state = {"torch": generator.get_state()}
    if device_generator is not generator:
        state["cuda"] = device_generator.get_state()
    return state


def _restore_rng(
    saved: dict[str, torch.Tensor], generator: torch.Generator, device_generator: torch.Generator
) -> None:
    """Undo :func:`_rng_state` (the tensors may have been loaded onto the GPU). A checkpoint
    written on the CPU and resumed on a GPU has no CUDA state to restore; such a resume is
    not bit-exact anyway (other kernels)."""
    generator.set_state(saved["torch"].cpu())
    if device_generator is not generator and "cuda" in saved:
        device_generator.set_state(saved["cuda"].cpu())


def _save_checkpoint(worker: Worker, step: int, progress: Progress) -> None:
    """Every rank writes and checksums its own file; the checksums are gathered and every
    rank commits the same manifest into its own view of the run directory."""
    config, bookkeeping, run_dir = worker.config, worker.bookkeeping, run_directory(worker.config)
    # The state's copies are freed once written, before waiting for the other workers; in one
    # process the workers write in turn, so one worker's copies are alive at a time.
    if _stands_by(worker):  # (its slot's file is its holder's, or written for it)
        digest = "00" * 32
    else:
        with _write_turn(worker):
            state = _state(worker, step, progress)
            path = checkpoint.write_rank_state(run_dir, step, bookkeeping.rank, state)
            del state
        digest = checkpoint.file_digest(path)
    digests = checkpoint.gather_digests(bookkeeping, digest)
    digests = _killed_checkpoints(worker, step, progress, digests)
    if bookkeeping.rank == 0 or not worker.one_process:  # (one process: one disk, one commit)
        checkpoint.commit_checkpoint(
            run_dir,
            step,
            bookkeeping.world_size,
            checkpoint.fingerprint(config),
            keep=config.run.keep_checkpoints,
            digests=digests,
        )
    bookkeeping.barrier().wait()


def _stands_by(worker: Worker) -> bool:
    """Whether this process stands by for a slot that another holds or whose process was
    killed (worker processes with declared faults)."""
    from lowcomm.faults.processes import ProcessFaults

    return isinstance(worker.faults, ProcessFaults) and not worker.faults.holds_now()


def _killed_checkpoints(
    worker: Worker, step: int, progress: Progress, digests: list[str]
) -> list[str]:
    """The files of the workers whose processes were killed, written from what they handed
    over, and ``digests`` with theirs (:mod:`lowcomm.faults.processes`)."""
    from lowcomm.comm.torch_comm import LiveBookkeeping
    from lowcomm.faults.processes import ProcessFaults

    faults, books = worker.faults, worker.bookkeeping
    if not isinstance(faults, ProcessFaults) or not isinstance(books, LiveBookkeeping):
        return digests
    run_dir = run_directory(worker.config)
    return faults.write_killed_checkpoints(run_dir, step, progress.val_loss, books, digests)


@contextlib.contextmanager
def _write_turn(worker: Worker) -> Iterator[None]:
    """Hold the process's write turn (:data:`_WRITE_TURN`) for the block, for a worker of
    several in one process with one rank each: building its state then only waits for
    collectives every worker has issued, so no turn waits on another. A worker of several
    ranks settles its two-level exchanges with a new collective on its replica group, which
    its other ranks could not issue while waiting for the turn: its ranks write at once."""
    if not worker.one_process or worker.config.placement.ranks_per_worker > 1:
        yield
        return
    with holding(_WRITE_TURN):  # (the worker that writes may need this thread's CPU turn)
        yield


def _state(worker: Worker, step: int, progress: Progress) -> dict[str, object]:
    """What a checkpoint holds of this worker."""
    return {
        # The strategy first: it settles in-flight collectives, which the comm must not hold.
        "strategy": worker.strategy.state_dict(),
        "model": sharding.model_state(worker.model),  # a sharded worker: its own shards
        "fsdp_layout": sharding.fsdp_layout(worker.model),  # (None: a whole replica)
        "data": worker.shard.state_dict(),
        "clock": worker.clock.state_dict(),
        "comm": worker.comm.state_dict(),
        "rng": _rng_state(worker.generator, worker.device_generator),
        "tokens": progress.tokens,
        "val_loss": progress.val_loss,
        "step": step,
        # Where the worker stands in the fault trace (None: the run has no faults).
        "faults": None if worker.faults is None else worker.faults.state_dict(),
    }


def spawned_train(config: TrainConfig, task: Task | None = None) -> WorkerSummary:
    """Entry point of a worker started by the local spawner (the group is initialised)."""
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm(timeout_s=config.comm.collective_timeout_s)
    if raw.rank == 0:
        # The group is up: Gloo has connected every pair of processes.
        print(f"lowcomm: workers connected: {raw.world_size} processes", flush=True)
    return train_worker(config, raw, task=task)


def spawned_train_with_faults(config: TrainConfig, task: Task | None = None) -> WorkerSummary:
    """Entry point of a worker process of a run with declared faults (started by the local
    spawner; the world's group is initialised): the strategy's raw communicator follows the
    round's quorum."""
    from lowcomm.comm.torch_comm import QuorumTorchComm
    from lowcomm.faults.processes import dist_rank, process_layout
    from lowcomm.launch.spawn import launch_folder

    layout = process_layout(config) if launch_folder() is not None else None
    raw = QuorumTorchComm(timeout_s=config.comm.collective_timeout_s, layout=layout)
    if dist_rank() == 0:  # (a process standing by for worker 0 says nothing)
        print(f"lowcomm: workers connected: {len(raw.layout)} processes", flush=True)
    return train_worker(config, raw, task=task)


def bookkeeping_comm(raw: Comm) -> Comm:
    """The communicator for metrics, evaluation sums and checkpoint barriers.

    Over ``torch.distributed``: a new Gloo group of the same ranks (every rank must call this,
    in the same order as its other group creations, as ``new_group`` requires), whatever the
    strategy's backend. Otherwise (one worker, test fakes): ``raw`` itself."""
    from lowcomm.comm.torch_comm import QuorumTorchComm, TorchComm

    if isinstance(raw, QuorumTorchComm):  # (declared faults: over the live processes)
        return raw.live_bookkeeping()
    if isinstance(raw, TorchComm):
        return raw.cpu_side_group()
    return raw
