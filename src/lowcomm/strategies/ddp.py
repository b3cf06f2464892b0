"""DDP with AdamW: the synchronous baseline (docs/ALGORITHMS.md §1.1).

Each step, every worker accumulates gradients over ``microbatches_per_step`` micro-batches,
the gradients are averaged with one all-reduce, and every worker applies the same AdamW step.
Nothing overlaps the all-reduce: it is fully exposed, which is what the other methods improve
on.

Reductions: N workers of DDP equal one process taking the same AdamW step on the
concatenation of their batches, with one or several micro-batches per step
(tests/test_strategies.py::test_ddp_on_n_ranks_equals_one_process_on_the_global_batch).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.adamw import ReplicaShardedAdamW
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, every_step
from lowcomm.strategies.gradient_step import (
    accumulate,
    average_and_clip,
    make_inner_optimizer,
    step_and_publish,
)
from lowcomm.strategies.sharded_flat import flat_buffers, norm_summer


class DDP(Strategy):
    """Synchronous data parallel: all-reduce the gradient, then AdamW everywhere.

    Memory per worker: parameters + gradients + AdamW moments (the fp32 parameters double as
    AdamW's master copy), i.e. (2 + 2 + K) Psi in ACCO's bf16 convention.

    Elastic resume (``--resume DIR --workers M2``): parameters and AdamW state are replicated
    and kept exactly (with ``--ranks-per-worker`` the moments are re-split over the new ranks);
    the run continues as DDP on M2 workers.
    """

    name: ClassVar[str] = "ddp"
    cost: ClassVar[CostModel] = CostModel(
        description="all-reduce gradients every step",
        traffic=every_step(),
        shards_over_replicas=True,
    )
    muon_refusal: ClassVar[str | None] = None
    sharding_refusal: ClassVar[str | None] = None
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="step",
        global_state="parameters, AdamW moments and their step counts, the step counter",
        worker_state="none: every worker's state is the same, so all of it is healed",
    )

    def __init__(self, model: nn.Module, comm: Comm, context: StrategyContext) -> None:
        super().__init__(model, comm, context)
        self.flat = flat_buffers(model)  # the local shards on a sharded worker
        # In fp32 the parameters are their own master copy (updated in place, no copy).
        master = self.flat.params if self.flat.dtype == torch.float32 else self.flat.params.float()
        self.optimizer = make_inner_optimizer(
            model, self.flat, master, context.optim, self.runtime.replica_group, self.name
        )

    def step(self, closure: Closure) -> StepStats:
        count = self.context.microbatches_per_step
        loss, samples, tokens = accumulate(self.flat, closure, count, self.runtime.replica_group)
        grads = self.flat.grads
        # Average the micro-batches before the all-reduce, which then moves one mean gradient.
        if count > 1:
            grads.div_(count)
        self.comm.all_reduce(grads, op="mean", role=Role.GRADIENT).wait()
        lr = self.lr_at(self.step_index)
        with torch.no_grad():
            grad = average_and_clip(
                grads,
                count=1,
                max_grad_norm=self.context.max_grad_norm,
                sum_squared_norm=norm_summer(self.flat),
            )
            step_and_publish(self.optimizer, grad, lr=lr, flat=self.flat)
        self.step_index += 1
        return StepStats(
            loss=loss,
            microbatches=self.context.microbatches_per_step,
            samples=samples,
            tokens=tokens,
            lr=lr,
        )

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        tensors = [(Role.PARAMETER, self.flat.params)]
        if self.optimizer.master is not self.flat.params:
            tensors.append((Role.PARAMETER, self.optimizer.master))
        if not isinstance(self.optimizer, ReplicaShardedAdamW):  # (else: rank_state)
            tensors.extend((role, state) for role, state in self.optimizer.states().items())
        saved = self.optimizer.state_dict()
        counters = {"step_index": self.step_index}
        counters.update(
            {name: int(value) for name, value in saved.items() if name.endswith(("steps", "count"))}
        )
        return tensors, counters

    def rank_state(self) -> list[tuple[Role, torch.Tensor]]:
        """A worker of several ranks: each rank's slice of the AdamW moments."""
        if isinstance(self.optimizer, ReplicaShardedAdamW):
            return [(Role.FIRST_MOMENT, self.optimizer.exp_avg),
                    (Role.SECOND_MOMENT, self.optimizer.exp_avg_sq)]  # fmt: skip
        return []

    def set_global_counters(self, counters: dict[str, int]) -> None:
        self.step_index = counters["step_index"]
        saved = self.optimizer.state_dict()
        saved.update({name: counters[name] for name in saved if name in counters})
        self.optimizer.load_state_dict(saved)

    def start_worker_state(self, *, kept: bool) -> None:
        with torch.no_grad():
            self.flat.params.copy_(self.optimizer.master)

    def state_bytes(self) -> int:
        extra_master = (
            0 if self.optimizer.master is self.flat.params else self.optimizer.master.numel() * 4
        )
        return self.flat.bytes + self.optimizer.state_bytes() + extra_master

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            self.flat.params.copy_(self.optimizer.master)


METHODS = (DDP,)
