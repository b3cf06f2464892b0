"""``lowcomm bench overhead``: lowcomm's DDP step against a hand-written PyTorch DDP loop.

Both run on the same model, the same pre-loaded batches and the same process group, with no
network emulation (preset ``none``, real clock). Timed blocks of steps alternate between the
two (ABAB..., the first one flipped every repeat) so drift on a shared machine hits both alike.
The printed ratio is lowcomm's median step time over the hand-written loop's (goal <= 1.03).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowcomm.comm.base import Comm
from lowcomm.comm.clock import RealClock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.network import NetworkProfile
from lowcomm.data import DataConfig, WorkerShard, prepare_corpus
from lowcomm.models import ModelConfig, build_model
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.schedule import ScheduleConfig
from lowcomm.strategies import DDP, MicroBatchResult, StrategyContext


@dataclass(kw_only=True)
class OverheadBench:
    """Time lowcomm's DDP step against a plain hand-written PyTorch DDP loop."""

    workers: int = 2
    """Worker processes (Gloo on loopback)."""

    steps_per_block: int = 5
    """Steps in one timed block."""

    repeats: int = 6
    """Timed blocks per side, interleaved."""

    warmup_steps: int = 2
    """Untimed steps per side first."""

    seed: int = 0
    """Seed for model init and data."""

    model: ModelConfig
    data: DataConfig


def _handwritten_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    world_size: int,
) -> None:
    """The loop a user writes by hand: backward, flatten, all-reduce, unflatten, AdamW."""
    optimizer.zero_grad(set_to_none=False)
    _, loss = model(*batch)
    assert loss is not None
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    optimizer.step()


def overhead_worker(bench: OverheadBench) -> dict[str, list[float]]:
    """Run inside each worker; returns per-step times of both sides (seconds)."""
    from lowcomm.comm.torch_comm import TorchComm

    raw = TorchComm()
    torch.manual_seed(bench.seed)
    corpus = prepare_corpus(bench.data)
    shard = WorkerShard(
        corpus, rank=raw.rank, world_size=raw.world_size, seq_len=bench.model.block_size,
        micro_batch_size=bench.data.micro_batch_size, seed=bench.seed, split=bench.data.split,
    )  # fmt: skip
    batches = [shard.next_batch() for _ in range(bench.steps_per_block)]
    base = build_model(bench.model, corpus.vocab_size)
    sides = {
        "lowcomm": _lowcomm_side(bench, raw, copy.deepcopy(base), batches),
        "handwritten": _handwritten_side(copy.deepcopy(base), batches, raw.world_size),
    }
    for run in sides.values():
        run(bench.warmup_steps)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(bench.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            dist.barrier()
            begin = time.perf_counter()
            sides[name](bench.steps_per_block)
            dist.barrier()
            times[name].append((time.perf_counter() - begin) / bench.steps_per_block)
    return times


_Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _lowcomm_side(
    bench: OverheadBench, raw: Comm, model: torch.nn.Module, batches: _Batches
) -> Callable[[int], None]:
    """Steps of lowcomm's DDP on a free link (no emulated cost) over ``raw``."""
    comm = NetworkComm(raw, NetworkProfile.from_preset("none"), RealClock())
    total = bench.warmup_steps + bench.repeats * bench.steps_per_block
    schedule = ScheduleConfig(kind="constant", warmup_steps=0)
    strategy = DDP(
        model, comm, StrategyContext(optim=AdamWConfig(), schedule=schedule, total_steps=total)
    )
    cursor = [0]

    def closure() -> MicroBatchResult:
        inputs, targets = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        _, loss = strategy.model(inputs, targets)
        assert loss is not None
        loss.backward()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    def block(steps: int) -> None:
        for _ in range(steps):
            strategy.step(closure)

    return block


def _handwritten_side(
    model: torch.nn.Module, batches: _Batches, world_size: int
) -> Callable[[int], None]:
    """Steps of the hand-written loop: torch's AdamW after an all-reduce of the gradients."""
    optim = AdamWConfig()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
        weight_decay=optim.weight_decay,
    )  # fmt: skip

    def block(steps: int) -> None:
        for index in range(steps):
            _handwritten_step(model, optimizer, batches[index % len(batches)], world_size)

    return block


def run_overhead(bench: OverheadBench) -> None:
    from lowcomm.launch import spawn_workers

    prepare_corpus(bench.data)
    results = spawn_workers(overhead_worker, bench.workers, (bench,))
    times = results[0]
    lowcomm_step = statistics.median(times["lowcomm"])
    handwritten_step = statistics.median(times["handwritten"])
    ratio = lowcomm_step / handwritten_step
    print(
        f"lowcomm bench overhead: {bench.workers} Gloo workers, {bench.repeats} interleaved blocks "
        f"of {bench.steps_per_block} steps, no emulation"
    )
    print(f"  hand-written DDP loop  {handwritten_step * 1e3:8.1f} ms/step (median)")
    print(f"  lowcomm ddp            {lowcomm_step * 1e3:8.1f} ms/step (median)")
    print(f"  ratio lowcomm/hand-written = {ratio:.3f}  (goal <= 1.03)")
