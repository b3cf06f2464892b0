"""The one training loop every strategy uses, run inside each worker process.

Per step: ``strategy.step(closure)`` on this worker, then (outside the clock) the workers'
step metrics are gathered on rank 0 and written to ``metrics.jsonl``. Validation runs on the
parameters the method would deploy, on a fixed set of held-out batches split across workers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lowcomm.comm.base import Comm, Role
from lowcomm.comm.clock import Clock, make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.hierarchical import HierarchicalComm, averaging_closure
from lowcomm.config import TrainConfig
from lowcomm.data import WorkerShard, prepare_corpus, validation_batches
from lowcomm.models import build_model
from lowcomm.strategies import MicroBatchResult, Strategy, build_strategy
from lowcomm.train import checkpoint
from lowcomm.train.metrics import RunWriter, StepRecord

# Order of the per-step numbers each worker contributes to the gather on rank 0.
_STEP_FIELDS = (
    "loss",
    "compute_s",
    "exposed_comm_s",
    "bytes_sent",
    "clock_s",
    "microbatches",
    "tokens",
    "committed_steps",
    "params_finite",
)


class NonFiniteLoss(FloatingPointError):
    """Training produced a NaN or infinite loss or parameter."""


def _all_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (a NaN/inf gradient shows up here after the update)."""
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(flags).all()) if flags else True


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
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], bookkeeping: Comm
) -> float:
    """Mean validation loss over all workers' batches (each worker evaluates its own).

    The losses are summed on the model's device (no host read per batch) and the two sums
    travel on the bookkeeping group as a CPU tensor on every worker, batches or not: that
    group is Gloo (NCCL would reject a CPU tensor, and a worker without a validation batch
    has no device tensor to offer)."""
    was_training = model.training
    model.eval()
    loss_sum: torch.Tensor | None = None
    with torch.no_grad():
        for inputs, targets in batches:
            _, loss = model(inputs, targets)
            assert loss is not None
            term = loss.detach().double()
            loss_sum = term if loss_sum is None else loss_sum + term
    model.train(was_training)
    total = torch.zeros(2, dtype=torch.float64)
    if loss_sum is not None:
        total[0] = loss_sum.cpu()  # the one host read of the evaluation
        total[1] = len(batches)
    bookkeeping.all_reduce(total, op="sum", role=Role.OTHER).wait()
    return float(total[0] / total[1]) if total[1] > 0 else math.nan


def train_worker(
    config: TrainConfig,
    raw: Comm,
    *,
    keep_parameters: bool = False,
    bookkeeping: Comm | None = None,
) -> WorkerSummary:
    """Train on this process. ``raw`` is the un-emulated communicator of the process group;
    strategy traffic goes through a :class:`NetworkComm` around it (or, with
    ``--ranks-per-worker R > 1``, a :class:`HierarchicalComm` over an inner and an outer
    ``NetworkComm``). Metrics, evaluation sums and checkpoint barriers go on ``bookkeeping``,
    a separate group of CPU tensors (by default a Gloo group made here on every rank, see
    :func:`bookkeeping_comm`), never on the strategy's group: on NCCL one communicator is one
    queue, and a small gather behind an in-flight all-reduce would wait for all of it. With
    ``keep_parameters`` the summary carries the final parameters (for tests)."""
    set_up_start = time.perf_counter()
    rank, world_size = raw.rank, raw.world_size
    if bookkeeping is None:
        bookkeeping = bookkeeping_comm(raw)
    ranks_per_worker = config.ranks_per_worker
    # This process is local rank `replica` of worker `worker` (both = rank with flat workers).
    worker, replica = divmod(rank, ranks_per_worker)
    workers = world_size // ranks_per_worker
    device = torch.device(config.device if config.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    corpus = prepare_corpus(config.data)
    model = build_model(config.model, corpus.vocab_size).to(device)
    # Same seed gives the same initial model everywhere; broadcast anyway (uncharged) so that
    # workers on different machines or library builds provably start from one point.
    with torch.no_grad():
        for parameter in model.parameters():
            raw.broadcast(parameter.data, src=0, role=Role.PARAMETER).wait()

    profile = config.network_profile()
    clock = make_clock(
        config.clock,
        speed_factor=profile.speed_factor(worker),
        seconds_per_microbatch=config.seconds_per_microbatch,
        device=device,
    )
    comm: NetworkComm | HierarchicalComm
    inner_comm: Comm | None = None
    if ranks_per_worker > 1:
        from lowcomm.launch.groups import level_comms

        inner_raw, outer_raw = level_comms(ranks_per_worker)
        inner_comm = NetworkComm(inner_raw, config.inner_network_profile(), clock, device=device)
        outer_comm = NetworkComm(outer_raw, profile, clock, device=device)
        comm = HierarchicalComm(inner_comm, outer_comm, clock)
    else:
        comm = NetworkComm(raw, profile, clock, device=device)
    # The strategy sees the Comm protocol and the runtime the comm describes (read-only
    # clock, replica group, uncharged channel, restoring of settled handles), nothing else.
    context = replace(config.strategy_context(), runtime=comm.runtime())
    strategy = build_strategy(config.method, model, comm, context, config)

    shard = WorkerShard(
        corpus,
        rank=worker,
        world_size=workers,
        seq_len=config.model.block_size,
        micro_batch_size=config.data.micro_batch_size,
        seed=config.seed,
        split=config.data.split,
        replica=replica,
        replicas=ranks_per_worker,
    )
    # A worker evaluates the batches a flat worker would (R x the micro-batch size), each of
    # its ranks a slice of every batch.
    all_val = validation_batches(
        corpus,
        seq_len=config.model.block_size,
        batch_size=config.data.micro_batch_size * ranks_per_worker,
        num_batches=config.eval_batches,
    )
    rows = slice(replica * config.data.micro_batch_size, (replica + 1) * config.data.micro_batch_size)
    my_val = [
        (x[rows].to(device), y[rows].to(device))
        for x, y in all_val[worker::workers]
        if x[rows].shape[0] > 0
    ]

    def to_device(batch: torch.Tensor) -> torch.Tensor:
        if device.type != "cuda":
            return batch.to(device)
        # From pinned memory the copy is asynchronous: the host goes on queuing kernels.
        return batch.pin_memory().to(device, non_blocking=True)

    def closure() -> MicroBatchResult:
        inputs, targets = shard.next_batch()
        inputs, targets = to_device(inputs), to_device(targets)
        _, loss = model(inputs, targets)
        assert loss is not None
        loss.backward()
        clock.microbatch_done()
        return MicroBatchResult(
            loss=float(loss.detach()), samples=inputs.shape[0], tokens=inputs.numel()
        )

    # Inner synchronous data parallel (R > 1): gradients averaged over the worker after each
    # micro-batch, charged to the inner link.
    step_closure = closure if inner_comm is None else averaging_closure(closure, model, inner_comm)


    run_dir = config.run_dir()
    start_step, tokens_total, val_loss = 0, 0, math.nan
    resume_from = _resume_directory(config, run_dir)
    if resume_from is not None:
        start_step, directory = checkpoint.find_latest(
            resume_from, world_size, checkpoint.fingerprint(config)
        )
        saved = checkpoint.read_rank_state(directory, rank, device)
        model.load_state_dict(saved["model"])
        strategy.load_state_dict(saved["strategy"])
        shard.load_state_dict(saved["data"])
        clock.load_state_dict(saved["clock"])
        comm.load_state_dict(saved["comm"])
        _restore_rng(saved["rng"], device)
        tokens_total = int(saved["tokens"])
        val_loss = float(saved["val_loss"])
    bookkeeping.barrier().wait()  # every worker has read its file before anyone writes a new one
    if resume_from is not None and rank == 0:
        # Said whatever --progress is: a resumed run must not look like a fresh one.
        print(
            f"lowcomm: resumed {resume_from} from step {start_step} (checkpoint "
            f"{directory.name}); training steps {start_step + 1} to {config.steps}",
            flush=True,
        )

    if rank == 0:
        print(
            f"lowcomm: training: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M "
            f"parameters, {len(all_val)} validation batches; worker set-up "
            f"{time.perf_counter() - set_up_start:.1f} s",
            flush=True,
        )
    writer = RunWriter(config, resume_step=start_step if resume_from is not None else None) if rank == 0 else None
    start_wall = time.perf_counter()
    stopped = False
    last_record: StepRecord | None = None
    try:
        for step in range(start_step, config.steps):
            before_compute, before_exposed = clock.compute_s, clock.exposed_comm_s
            before_bytes = comm.bytes_sent
            stats = strategy.step(step_closure)
            now = clock.now()
            tokens_total += stats.tokens
            with clock.excluded():
                # CPU: the bookkeeping group is Gloo (the readings are host floats anyway).
                local = torch.tensor(
                    [
                        stats.loss,
                        clock.compute_s - before_compute,
                        clock.exposed_comm_s - before_exposed,
                        comm.bytes_sent - before_bytes,
                        now,
                        stats.microbatches,
                        stats.tokens,
                        stats.committed_steps,
                        float(_all_finite(model)),
                    ],
                    dtype=torch.float64,
                )
                gathered = torch.zeros(world_size * len(_STEP_FIELDS), dtype=torch.float64)
                bookkeeping.all_gather(gathered, local, role=Role.OTHER).wait()
                per_worker = gathered.view(world_size, len(_STEP_FIELDS))
                bad = [r for r in range(world_size) if not math.isfinite(float(per_worker[r, 0]))]
                if bad:
                    raise NonFiniteLoss(
                        f"step {step}: worker {bad[0]} reported a non-finite loss "
                        f"({float(per_worker[bad[0], 0])}); lower --optim.lr or check the data"
                        f"{_NOT_SAVED}"
                    )
                bad = [r for r in range(world_size) if float(per_worker[r, -1]) != 1.0]
                if bad:
                    raise NonFiniteLoss(
                        f"step {step}: worker {bad[0]} has non-finite parameters after the "
                        f"update (a NaN/inf gradient); lower --optim.lr or --max-grad-norm"
                        f"{_NOT_SAVED}"
                    )
                is_last = step == config.steps - 1
                evaluate = (step + 1) % config.eval_every == 0 and not is_last
                if evaluate:
                    with strategy.deployed() as deployed_model:
                        val_loss = _evaluate(deployed_model, my_val, bookkeeping)
                if writer is not None:
                    record = StepRecord.from_tensor(
                        step,
                        stats.lr,
                        per_worker,
                        _STEP_FIELDS[:-1],
                        val_loss if evaluate else None,
                        clock.kind,
                        stats.extras,
                    )
                    if is_last:
                        # Written once the final validation below gives it its val_loss, so
                        # metrics.jsonl and loss.png end on summary.json's final_val_loss.
                        last_record = record
                    else:
                        writer.write_step(record)
                stopped = config.stop_after is not None and step + 1 == config.stop_after
                every = config.checkpoint_every
                if (every is not None and (step + 1) % every == 0 and not is_last) or stopped:
                    _save_checkpoint(
                        config, run_dir, step + 1, bookkeeping, model, strategy, shard, clock, comm,
                        tokens_total, val_loss,
                    )
            if stopped:
                break
        if stopped:
            if writer is not None:
                writer.close_steps()
                print(
                    f"lowcomm: stopped after step {config.stop_after} with a checkpoint in "
                    f"{run_dir}; continue with: lowcomm train --resume {run_dir}",
                    flush=True,
                )
            return WorkerSummary(
                rank=rank, compute_s=clock.compute_s, exposed_comm_s=clock.exposed_comm_s,
                clock_s=clock.now(), bytes_sent=comm.bytes_sent, bytes_by_role=comm.counters(),
                state_bytes=strategy.state_bytes(), tokens=tokens_total,
                parameters=_flat_parameters(model) if keep_parameters else None,
            )  # fmt: skip
        strategy.finish()
        final_clock = clock.now()
        deployed: torch.Tensor | None = None
        with clock.excluded(), strategy.deployed() as deployed_model:
            val_loss = _evaluate(deployed_model, my_val, bookkeeping)
            if keep_parameters:
                deployed = _flat_parameters(deployed_model)
        if last_record is not None:
            last_record.val_loss = val_loss
    finally:
        if writer is not None:
            if last_record is not None:
                writer.write_step(last_record)  # without val_loss if the evaluation failed
            writer.close_steps()

    summary = WorkerSummary(
        rank=rank,
        compute_s=clock.compute_s,
        exposed_comm_s=clock.exposed_comm_s,
        clock_s=final_clock,
        bytes_sent=comm.bytes_sent,
        bytes_by_role=comm.counters(),
        state_bytes=strategy.state_bytes(),
        tokens=tokens_total,
        parameters=_flat_parameters(model) if keep_parameters else None,
        deployed_parameters=deployed,
    )
    # Every worker's summary goes to rank 0 through the bookkeeping group (uncharged).
    levels = comm.level_counters() if isinstance(comm, HierarchicalComm) else None
    level_columns = (
        [levels[name][key] for name in ("inner", "outer") for key in ("bytes_sent", "exposed_comm_s")]
        if levels is not None
        else [0.0, 0.0, summary.bytes_sent, summary.exposed_comm_s]
    )
    peak_memory = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0
    packed = torch.tensor(
        [summary.compute_s, summary.exposed_comm_s, summary.clock_s, summary.bytes_sent,
         float(summary.state_bytes), float(summary.tokens), *level_columns, peak_memory],
        dtype=torch.float64,
    )
    everyone = torch.zeros(world_size * packed.numel(), dtype=torch.float64)
    bookkeeping.all_gather(everyone, packed, role=Role.OTHER).wait()
    if writer is not None:
        num_params = sum(p.numel() for p in model.parameters())
        writer.finish(
            per_worker=everyone.view(world_size, packed.numel()),
            bytes_by_role=summary.bytes_by_role,
            num_params=num_params,
            final_val_loss=val_loss,
            wall_clock_s=time.perf_counter() - start_wall,
            clock_kind=clock.kind,
            network=profile,
            inner_network=config.inner_network_profile() if ranks_per_worker > 1 else None,
        )
    return summary



def _flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


_NOT_SAVED = "; the run stopped here and no checkpoint holds this state"


def _resume_directory(config: TrainConfig, run_dir: Path) -> Path | None:
    """Where to resume from: --resume DIR, or with --resume auto the run directory when it
    holds a checkpoint (an elastic restart), else nowhere (a fresh start)."""
    if config.resume is None:
        return None
    if config.resume == "auto":
        return run_dir if checkpoint.has_checkpoint(run_dir) else None
    return Path(config.resume)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The random generators a resumed run must continue: the CPU's and, on a GPU, the
    device's (dropout masks are drawn there)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(saved: dict[str, torch.Tensor], device: torch.device) -> None:
    """Undo :func:`_rng_state` (the tensors may have been loaded onto the GPU). A checkpoint
    written on the CPU and resumed on a GPU has no CUDA state to restore; such a resume is
    not bit-exact anyway (other kernels)."""
    torch.set_rng_state(saved["torch"].cpu())
    if device.type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"].cpu(), device)


def _save_checkpoint(
    config: TrainConfig,
    run_dir: Path,
    step: int,
    bookkeeping: Comm,
    model: torch.nn.Module,
    strategy: Strategy,
    shard: WorkerShard,
    clock: Clock,
    comm: NetworkComm | HierarchicalComm,
    tokens: int,
    val_loss: float,
) -> None:
    """Every worker writes its file; once all have, rank 0 checksums them and commits."""
    state = {
        # The strategy first: it settles in-flight collectives, which the comm must not hold.
        "strategy": strategy.state_dict(),
        "model": model.state_dict(),
        "data": shard.state_dict(),
        "clock": clock.state_dict(),
        "comm": comm.state_dict(),
        "rng": _rng_state(_model_device(model)),
        "tokens": tokens,
        "val_loss": val_loss,
        "step": step,
    }
    checkpoint.write_rank_state(run_dir, step, bookkeeping.rank, state)
    bookkeeping.barrier().wait()
    if bookkeeping.rank == 0:
        checkpoint.commit_checkpoint(
            run_dir, step, bookkeeping.world_size, checkpoint.fingerprint(config),
            keep=config.keep_checkpoints,
        )
    bookkeeping.barrier().wait()


def spawned_train(config: TrainConfig) -> WorkerSummary:
    """Entry point of a worker started by the local spawner (the group is initialised)."""
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm(timeout_s=config.collective_timeout_s)
    if raw.rank == 0:
        # The group is up: Gloo has connected every pair of processes.
        print(f"lowcomm: workers connected: {raw.world_size} processes", flush=True)
    return train_worker(config, raw)


def bookkeeping_comm(raw: Comm) -> Comm:
    """The communicator for metrics, evaluation sums and checkpoint barriers.

    Over ``torch.distributed``: a new Gloo group of the same ranks (every rank must call this,
    in the same order as its other group creations, as ``new_group`` requires), whatever the
    strategy's backend. Otherwise (one worker, test fakes): ``raw`` itself."""
    from lowcomm.comm.torch_comm import TorchComm

    if isinstance(raw, TorchComm):
        return raw.cpu_side_group()
    return raw
