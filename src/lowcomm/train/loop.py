"""The one training loop every strategy uses, run inside each worker process.

Per step: ``strategy.step(closure)`` on this worker, then (outside the clock) the workers'
step metrics are gathered on rank 0 and written to ``metrics.jsonl``. Validation runs on the
parameters the method would deploy, on a fixed set of held-out batches split across workers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from lowcomm.comm.base import Comm, Role
from lowcomm.comm.clock import make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.hierarchical import HierarchicalComm, averaging_closure
from lowcomm.config import TrainConfig
from lowcomm.data import WorkerShard, prepare_corpus, validation_batches
from lowcomm.models import build_model
from lowcomm.strategies import MicroBatchResult, build_strategy
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
)


class NonFiniteLoss(FloatingPointError):
    """Training produced a NaN or infinite loss."""


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


def _evaluate(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], raw: Comm
) -> float:
    """Mean validation loss over all workers' batches (each worker evaluates its own)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=batches[0][0].device if batches else "cpu")
    with torch.no_grad():
        for inputs, targets in batches:
            _, loss = model(inputs, targets)
            assert loss is not None
            total[0] += float(loss)
            total[1] += 1
    model.train(was_training)
    raw.all_reduce(total, op="sum", role=Role.OTHER).wait()
    return float(total[0] / total[1]) if total[1] > 0 else math.nan


def train_worker(config: TrainConfig, raw: Comm) -> WorkerSummary:
    """Train on this process. ``raw`` is the un-emulated communicator of the process group;
    strategy traffic goes through a :class:`NetworkComm` around it (or, with
    ``--ranks-per-worker R > 1``, a :class:`HierarchicalComm` over an inner and an outer
    ``NetworkComm``), metrics go around it."""
    rank, world_size = raw.rank, raw.world_size
    ranks_per_worker = config.ranks_per_worker
    # This process is local rank `replica` of worker `worker` (both = rank with flat workers).
    worker, replica = divmod(rank, ranks_per_worker)
    workers = world_size // ranks_per_worker
    device = torch.device(config.device if config.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    torch.manual_seed(config.seed)
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
    strategy = build_strategy(config.method, model, comm, config.strategy_context(), config)

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

    def closure() -> MicroBatchResult:
        inputs, targets = shard.next_batch()
        inputs, targets = inputs.to(device), targets.to(device)
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

    writer = RunWriter(config) if rank == 0 else None
    tokens_total = 0
    start_wall = time.perf_counter()
    val_loss = math.nan
    try:
        for step in range(config.steps):
            before_compute, before_exposed = clock.compute_s, clock.exposed_comm_s
            before_bytes = comm.bytes_sent
            stats = strategy.step(step_closure)
            now = clock.now()
            tokens_total += stats.tokens
            with clock.excluded():
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
                    ],
                    dtype=torch.float64,
                    device=device,
                )
                gathered = torch.zeros(
                    world_size * len(_STEP_FIELDS), dtype=torch.float64, device=device
                )
                raw.all_gather(gathered, local, role=Role.OTHER).wait()
                per_worker = gathered.view(world_size, len(_STEP_FIELDS)).cpu()
                bad = [r for r in range(world_size) if not math.isfinite(float(per_worker[r, 0]))]
                if bad:
                    raise NonFiniteLoss(
                        f"step {step}: worker {bad[0]} reported a non-finite loss "
                        f"({float(per_worker[bad[0], 0])}); lower --optim.lr or check the data"
                    )
                is_last = step == config.steps - 1
                evaluate = (step + 1) % config.eval_every == 0 and not is_last
                if evaluate:
                    with strategy.deployed() as deployed_model:
                        val_loss = _evaluate(deployed_model, my_val, raw)
                if writer is not None:
                    writer.write_step(
                        StepRecord.from_tensor(
                            step,
                            stats.lr,
                            per_worker,
                            _STEP_FIELDS,
                            val_loss if evaluate else None,
                            clock.kind,
                            stats.extras,
                        )
                    )
        strategy.finish()
        final_clock = clock.now()
        with clock.excluded(), strategy.deployed() as deployed_model:
            val_loss = _evaluate(deployed_model, my_val, raw)
    finally:
        if writer is not None:
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
    )
    # Every worker's summary goes to rank 0 through the raw group (uncharged).
    levels = comm.level_counters() if isinstance(comm, HierarchicalComm) else None
    level_columns = (
        [levels[name][key] for name in ("inner", "outer") for key in ("bytes_sent", "exposed_comm_s")]
        if levels is not None
        else [0.0, 0.0, summary.bytes_sent, summary.exposed_comm_s]
    )
    packed = torch.tensor(
        [summary.compute_s, summary.exposed_comm_s, summary.clock_s, summary.bytes_sent,
         float(summary.state_bytes), float(summary.tokens), *level_columns],
        dtype=torch.float64,
        device=device,
    )
    everyone = torch.zeros(world_size * packed.numel(), dtype=torch.float64, device=device)
    raw.all_gather(everyone, packed, role=Role.OTHER).wait()
    everyone = everyone.cpu()
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



def spawned_train(config: TrainConfig) -> WorkerSummary:
    """Entry point of a worker started by the local spawner (the group is initialised)."""
    from lowcomm.comm.torch_comm import TorchComm

    return train_worker(config, TorchComm())
