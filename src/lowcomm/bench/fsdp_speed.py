"""``lowcomm bench fsdp``, its speed part: lowcomm's sharded ddp (``--worker-sharding fsdp``,
2 workers x 2 ranks) against a plain PyTorch FSDP2 HSDP training loop, side by side.

Both sides run in the same 4 Gloo processes on the same Llama-shaped model (one initial model,
copied), the same pre-loaded micro-batches and AdamW's settings, with no network emulation
(lowcomm's links are preset ``none`` on the real clock). The plain loop is what one writes by
hand: ``fully_shard`` of every decoder layer and the root over a 2-D ``DeviceMesh``
(replicate x shard: FSDP2's HSDP, gradients reduce-scattered over a worker's ranks and
all-reduced across the workers), then ``torch.optim.AdamW`` over the sharded parameters.
lowcomm's side is the training loop's step: ``train.sharding.shard_worker`` (the sharded model,
its flat buffers aliasing FSDP's storage, the FSDP collectives charged to the inner link) and
the ddp strategy. Timed blocks of steps alternate (ABAB..., flipped every repeat), so drift on a
shared machine hits both alike; tokens per second are each side's median block.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig

_Batches = list[tuple[torch.Tensor, torch.Tensor]]

#: The world: 2 workers x 2 ranks.
WORKERS, RANKS = 2, 2


@dataclass(frozen=True)
class SpeedSetting:
    """What both sides train."""

    n_layer: int
    n_embd: int
    block_size: int
    micro_batch_size: int
    precision: str = "fp32"
    steps_per_block: int = 3
    repeats: int = 4
    warmup_steps: int = 2


def speed_worker(setting: SpeedSetting) -> dict[str, list[float]]:
    """Run inside each of the 4 processes; returns each side's seconds per step, per block."""
    import torch.distributed as dist

    from lowcomm.train.task import CorpusTask

    config = speed_config(setting)
    task = CorpusTask()
    shard = task.data(config, dist.get_rank()).shard  # (this rank's, as lowcomm train's)
    batches = [shard.next_batch() for _ in range(setting.steps_per_block)]
    torch.manual_seed(0)
    base = task.model(config)
    sides = {
        "lowcomm": _lowcomm_side(config, copy.deepcopy(base), batches),
        "fsdp2": _plain_side(config, copy.deepcopy(base), batches),
    }
    del base
    for run in sides.values():
        run(setting.warmup_steps)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(setting.repeats):
        for name in list(sides) if repeat % 2 == 0 else list(reversed(sides)):
            dist.barrier()
            begin = time.perf_counter()
            sides[name](setting.steps_per_block)
            dist.barrier()
            times[name].append((time.perf_counter() - begin) / setting.steps_per_block)
    return times


def speed_config(setting: SpeedSetting) -> TrainConfig:
    """The ``lowcomm train`` configuration of lowcomm's side."""
    from lowcomm.config import CommConfig, NumericsConfig, PlacementConfig, TrainConfig

    config = TrainConfig(
        method="ddp",
        placement=PlacementConfig(workers=WORKERS, ranks_per_worker=RANKS, worker_sharding="fsdp"),
        comm=CommConfig(network="none", inner_network="none", clock="real"),
        numerics=NumericsConfig(precision=setting.precision),  # type: ignore[arg-type]
    )
    heads = max(1, setting.n_embd // 64)
    config.model.family = "hf-llama"
    config.model.n_layer, config.model.n_embd, config.model.n_head = (
        setting.n_layer, setting.n_embd, heads,
    )  # fmt: skip
    config.model.n_kv_head = heads // 4 if heads % 4 == 0 else heads
    config.model.block_size = setting.block_size
    config.data.micro_batch_size = setting.micro_batch_size
    return config


def _lowcomm_side(
    config: TrainConfig, model: torch.nn.Module, batches: _Batches
) -> Callable[[int], None]:
    """Steps of lowcomm's ddp on a sharded worker, as the training loop takes them."""
    from lowcomm.comm.clock import RealClock
    from lowcomm.strategies import MicroBatchResult, build_strategy
    from lowcomm.train import sharding
    from lowcomm.train.context import network_profile, replica_network_profile, strategy_context

    clock = RealClock()
    links = (network_profile(config.comm), replica_network_profile(config.comm))
    comm = sharding.shard_worker(config, model, clock, torch.device("cpu"), links)
    from dataclasses import replace

    context = replace(strategy_context(config), runtime=comm.runtime())
    strategy = build_strategy("ddp", model, comm, context, config)
    bf16 = config.numerics.precision == "bf16-mixed"
    cursor = [0]

    def closure() -> MicroBatchResult:
        inputs, targets = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(inputs, targets)
        assert loss is not None
        loss.backward()  # type: ignore[no-untyped-call]
        return MicroBatchResult(loss.detach(), inputs.shape[0], inputs.numel())

    def block(steps: int) -> None:
        for _ in range(steps):
            strategy.step(closure)

    return block


def _plain_side(
    config: TrainConfig, model: torch.nn.Module, batches: _Batches
) -> Callable[[int], None]:
    """Steps of the plain FSDP2 HSDP loop one writes by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lowcomm.models.blocks import transformer_blocks

    mesh = init_device_mesh("cpu", (WORKERS, RANKS), mesh_dim_names=("replicate", "shard"))
    bf16 = config.numerics.precision == "bf16-mixed"
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    for layer in transformer_blocks(model) or []:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optim = config.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
        weight_decay=optim.weight_decay,
    )  # fmt: skip
    cursor = [0]

    def block(steps: int) -> None:
        for _ in range(steps):
            inputs, targets = batches[cursor[0] % len(batches)]
            cursor[0] += 1
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(inputs, targets)
            assert loss is not None
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()

    return block


def speed_ratio(times: dict[str, list[float]], tokens_per_step: int) -> dict[str, float]:
    """Each side's tokens per second (median block) and lowcomm's overhead (its step time
    over the plain loop's)."""
    mine, plain = statistics.median(times["lowcomm"]), statistics.median(times["fsdp2"])
    return {
        "lowcomm_tokens_per_s": tokens_per_step / mine,
        "fsdp2_tokens_per_s": tokens_per_step / plain,
        "overhead": mine / plain,
    }


__all__ = ["SpeedSetting", "speed_config", "speed_ratio", "speed_worker"]
