"""ZeRO-1: AdamW with optimizer states sharded across workers (docs/ALGORITHMS.md §1.2).

Each worker keeps the full working parameters and gradients, but the fp32 master copy and the
AdamW moments only for its own slice S_i of the flat (padded) parameter vector. One step:

1. flatten the gradients, padded to a multiple of M;
2. reduce-scatter (sum): worker i receives sum_j g_j restricted to S_i; divide by the
   number of contributions;
3. AdamW on the fp32 master shard (after clipping to the global gradient norm, if enabled:
   one scalar all-reduce of the shards' squared norms);
4. all-gather the updated shards into the full parameter vector.

The result equals DDP (§1.1) up to floating-point reduction order; only memory and the shape
of communication differ (RS + AG moves the same bytes as one all-reduce).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.adamw import FlatAdamW
from lowcomm.optim.flat import tensor_bytes
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, every_step
from lowcomm.strategies.gradient_step import accumulate, average_and_clip
from lowcomm.strategies.sharded_flat import flat_buffers, norm_summer


class ZeRO1(Strategy):
    """Sharded AdamW: reduce-scatter gradients, step the own shard, all-gather parameters.

    Memory per worker: parameters + gradients + (fp32 master + two moments) / M, i.e.
    (2 + 2 + K/M) Psi in ACCO's bf16 convention.

    Elastic resume (``--resume DIR --workers M2``): the optimizer shards are gathered and re-
    sharded exactly for M2 workers; parameters are replicated and kept.
    """

    name: ClassVar[str] = "zero1"
    cost: ClassVar[CostModel] = CostModel(
        description="reduce-scatter + all-gather every step",
        traffic=every_step(),  # RS + AG of the model: one all-reduce's bytes and time
        shards_over_workers=True,
    )
    sharding_refusal: ClassVar[str | None] = None  # it shards the rank's FSDP shard again
    muon_refusal: ClassVar[str | None] = (
        "ZeRO-1 shards the optimizer over the workers in flat slices cut across the weight "
        "matrices Muon orthogonalises whole"
    )

    def __init__(self, model: nn.Module, comm: Comm, context: StrategyContext) -> None:
        super().__init__(model, comm, context)
        world_size = comm.world_size
        # On a sharded worker: the rank's FSDP shards, sharded again over the workers.
        self.flat = flat_buffers(model, pad_to=world_size)
        self.shard_numel = self.flat.padded_numel // world_size
        begin = comm.rank * self.shard_numel
        self.shard = slice(begin, begin + self.shard_numel)
        # clone(): on CPU, .float() of a float32 tensor returns the same storage, and the
        # master must not alias the working parameters the all-gather overwrites.
        master = self.flat.params[self.shard].float().clone()
        self.optimizer = FlatAdamW(master, context.optim)
        self.shard_grad = torch.zeros(
            self.shard_numel, dtype=self.flat.dtype, device=self.flat.device
        )

    def step(self, closure: Closure) -> StepStats:
        loss, samples, tokens = accumulate(
            self.flat, closure, self.context.microbatches_per_step, self.runtime.replica_group
        )
        self.comm.reduce_scatter(
            self.shard_grad, self.flat.grads, op="sum", role=Role.GRADIENT
        ).wait()
        contributions = self.comm.world_size * self.context.microbatches_per_step
        lr = self.lr_at(self.step_index)
        with torch.no_grad():
            # The global norm needs every shard's share: one scalar all-reduce.
            grad = average_and_clip(
                self.shard_grad,
                count=contributions,
                max_grad_norm=self.context.max_grad_norm,
                sum_squared_norm=self._sum_squared_norm,
            )
            self.optimizer.step(grad, lr=lr)
            update = self.optimizer.master.to(self.flat.dtype)
        self.comm.all_gather(self.flat.params, update, role=Role.PARAMETER).wait()
        self.step_index += 1
        return StepStats(
            loss=loss,
            microbatches=self.context.microbatches_per_step,
            samples=samples,
            tokens=tokens,
            lr=lr,
        )

    def _sum_squared_norm(self, squared: torch.Tensor) -> None:
        """Sum a shard's squared norm over the workers (and, on a sharded worker, over the
        worker's ranks, whose FSDP shards the workers' shards are cut from)."""
        self.comm.all_reduce(squared, op="sum", role=Role.OTHER).wait()
        over_ranks = norm_summer(self.flat)
        if over_ranks is not None:
            over_ranks(squared)

    def state_bytes(self) -> int:
        shard = tensor_bytes(self.shard_grad, self.optimizer.master)
        return self.flat.bytes + self.optimizer.state_bytes() + shard

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])


METHODS = (ZeRO1,)
