"""The core every local-update method stands on: local_sgd, local_adamw, overlap_local_sgd,
slowmo and co2 (``co2.py``), the DiLoCo family (``diloco.py``, ``streaming.py``, ``eager.py``,
``cocodc.py``), sparseloco and sparta / sparta_diloco (``sparta.py``).

Each of them takes inner optimizer steps on a worker's own parameters, with inner state that is
never averaged, and every so often combines the workers. :class:`LocalUpdate` owns what they
share: the flat parameter and gradient buffers, the fp32 master the inner optimizer updates,
the inner optimizer itself (with the refusals that depend on it), the inner step, the round
counters and the state they all checkpoint. A method writes its own ``step()`` in the order of
its paper, from named phases: ``inner_step`` (here), and its own ``launch_sync``,
``finish_sync`` and ``outer_step``; where a sync overlaps inner steps, the distance between
its launch and its finish is visible in that one function.

:class:`RoundOptions` holds the concepts the families share, each with one meaning and one
rule: the period, the inner optimizer, the outer learning rate, the outer momentum and its
Nesterov form. A family's options class (``--local.*``, ``--diloco.*``, ``--sparta.*``,
``--sparseloco.*``) subclasses it to set its own defaults and add its own options.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.flat import FlatOptimizer, tensor_bytes
from lowcomm.optim.muon import muon_refusal
from lowcomm.optim.sgd import FlatSGD
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.gradient_step import (
    accumulate,
    average_and_clip,
    make_inner_optimizer,
    step_and_publish,
)
from lowcomm.strategies.sharded_flat import flat_buffers, norm_summer

InnerOptimizerKind = Literal["adamw", "sgd"]


@dataclass(kw_only=True)
class RoundOptions:
    """The options every local-update family shares; a family's subclass sets the defaults.

    The flags are ``--<group>.<option>``; ``group`` names the family's option group so that a
    refusal names the flag the user typed.
    """

    group: ClassVar[str] = ""
    #: Whether an outer learning rate of exactly 0 is accepted.
    zero_outer_lr: ClassVar[bool] = True

    sync_every: int = 1
    """The period: inner steps per round (H, or tau in the local family's papers)."""

    inner_optimizer: InnerOptimizerKind = "adamw"
    """Inner optimizer: adamw (--optim.*; Muon with --optim.name muon) or sgd
    (theta <- theta (1 - lr lambda) - lr b, b <- mu b + g, with --optim.lr, --optim.weight-decay
    and the sgd momentum mu)."""

    sgd_momentum: float = 0.0
    """mu: momentum of the inner SGD (PyTorch semantics, no dampening), local and persistent."""

    outer_lr: float | None = 1.0
    """The outer learning rate: how far the outer step moves the shared parameters."""

    outer_momentum: float | None = 0.0
    """The outer momentum factor, in [0, 1) (0: no momentum)."""

    outer_nesterov: bool = False
    """Nesterov form of the outer momentum (False: heavy ball)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.sync_every, bool)
            or not isinstance(self.sync_every, int)
            or self.sync_every < 1
        ):
            raise ValueError(
                f"{self.flag('sync_every')}: {self.sync_every} must be an integer >= 1; pass "
                f"the number of inner steps per round, e.g. {self.default('sync_every')}"
            )
        if self.inner_optimizer not in ("adamw", "sgd"):
            raise ValueError(
                f"{self.flag('inner_optimizer')}: unknown {self.inner_optimizer!r}; choose "
                f"adamw or sgd"
            )
        if not 0.0 <= self.sgd_momentum < 1.0:
            raise ValueError(
                f"{self.flag('sgd_momentum')}: {self.sgd_momentum} must lie in [0, 1); try 0.9 or 0"
            )
        unset = " or None for the default" if self.default("outer_lr") is None else ""
        lr = self.outer_lr
        if lr is not None and not (
            math.isfinite(lr) and (lr > 0 or (lr == 0 and self.zero_outer_lr))
        ):
            rule = "a finite number >= 0" if self.zero_outer_lr else "a finite positive number"
            raise ValueError(
                f"{self.flag('outer_lr')}: {lr} must be {rule}; try "
                f"{self.hint('outer_lr', 0.7)}{unset}"
            )
        momentum = self.outer_momentum
        if momentum is not None and not 0.0 <= momentum < 1.0:
            raise ValueError(
                f"{self.flag('outer_momentum')}: {momentum} must lie in [0, 1); try "
                f"{self.hint('outer_momentum', 0.9)}{unset}"
            )

    def flag(self, name: str) -> str:
        """The command-line flag of option ``name``."""
        return f"--{self.group}.{name.replace('_', '-')}"

    def default(self, name: str) -> Any:
        """The family's default of option ``name``."""
        return next(f.default for f in dataclasses.fields(self) if f.name == name)

    def hint(self, name: str, otherwise: float) -> Any:
        """A value to suggest for option ``name``: the family's default, else ``otherwise``."""
        default = self.default(name)
        return otherwise if default is None else default

    def outer(self) -> tuple[float, float]:
        """(outer learning rate, outer momentum) of the outer step."""
        assert self.outer_lr is not None and self.outer_momentum is not None
        return self.outer_lr, self.outer_momentum


OptionsT = TypeVar("OptionsT", bound=RoundOptions)


class LocalUpdate(Strategy, Generic[OptionsT]):
    """Inner steps on a worker's own parameters, combined every so often.

    Holds the flat parameters and gradients (``self.flat``; the local shards on a sharded
    worker), the fp32 ``master`` the inner optimizer updates (the parameters themselves in
    fp32), the ``inner`` optimizer (local and persistent, never averaged), and the counters
    ``local_steps`` (inner steps since the last ``end_round()``) and ``rounds`` (rounds
    ended). The local family's rounds depend on its history (a trailing partial round) and it
    checkpoints both counters; the DiLoCo family's rounds are multiples of H in
    ``step_index`` and it reads neither.
    """

    sharding_refusal: ClassVar[str | None] = None
    muon_refusal: ClassVar[str | None] = None
    #: Inner optimizer fixed by the method (None: ``options.inner_optimizer``).
    fixed_inner: ClassVar[InnerOptimizerKind | None] = None

    def __init__(
        self, model: nn.Module, comm: Comm, context: StrategyContext, options: OptionsT
    ) -> None:
        super().__init__(model, comm, context)
        self.options: OptionsT = options
        self.flat = flat_buffers(model)
        # In fp32 the parameters are their own master copy; otherwise a separate fp32 master
        # (cloned: it must never alias the working parameters).
        self.master = (
            self.flat.params
            if self.flat.dtype == torch.float32
            else self.flat.params.float().clone()
        )
        self.inner_kind: InnerOptimizerKind = self.fixed_inner or options.inner_optimizer
        if context.optim.name == "muon" and self.inner_kind == "sgd":
            raise muon_refusal(
                self.name, f"{options.flag('inner_optimizer')} sgd has no AdamW for Muon to replace"
            )
        # One inner SGD for every family: the same decoupled weight decay as AdamW, so that
        # switching the inner optimizer changes only the direction rule.
        self.inner: FlatOptimizer = (
            make_inner_optimizer(
                model, self.flat, self.master, context.optim, self.runtime.replica_group, self.name
            )
            if self.inner_kind == "adamw"
            else FlatSGD(
                self.master,
                weight_decay=context.optim.weight_decay,
                momentum=options.sgd_momentum,
            )
        )
        self.local_steps = 0
        self.rounds = 0
        #: The learning rate of the latest inner step (SlowMo's gamma).
        self.last_lr = 0.0

    # --- phases -------------------------------------------------------------------------

    def inner_step(self, closure: Closure) -> StepStats:
        """One inner optimizer step on this worker's own gradient (no communication)."""
        count = self.context.microbatches_per_step
        loss, samples, tokens = accumulate(self.flat, closure, count, self.runtime.replica_group)
        lr = self.lr_at(self.step_index)
        with torch.no_grad():
            # Clipping is local: the inner gradient is never communicated.
            grads = average_and_clip(
                self.flat.grads,
                count=count,
                max_grad_norm=self.context.max_grad_norm,
                sum_squared_norm=norm_summer(self.flat),
            )
            step_and_publish(self.inner, grads, lr=lr, flat=self.flat)
        self.step_index += 1
        self.local_steps += 1
        self.last_lr = lr
        return StepStats(loss=loss, microbatches=count, samples=samples, tokens=tokens, lr=lr)

    def end_round(self) -> None:
        """Count a round as ended."""
        self.local_steps = 0
        self.rounds += 1

    def round_counters(self) -> dict[str, int]:
        """The round counters every member of a quorum holds alike: healing sends them to a
        joiner (:meth:`global_state`)."""
        return {
            "step_index": self.step_index,
            "local_steps": self.local_steps,
            "rounds": self.rounds,
        }

    def set_global_counters(self, counters: dict[str, int]) -> None:
        self.step_index = counters["step_index"]
        self.local_steps = counters["local_steps"]
        self.rounds = counters["rounds"]

    # --- the master and the working parameters ------------------------------------------

    @property
    def separate_master(self) -> bool:
        return self.master is not self.flat.params

    def write_back(self) -> None:
        """The master changed: copy it into the working parameters."""
        if self.separate_master:
            self.flat.params.copy_(self.master)

    def params_written(self) -> None:
        """The working parameters were overwritten (an average, an anchor): refresh the
        master from them."""
        if self.separate_master:
            self.master.copy_(self.flat.params)

    # --- deploying ----------------------------------------------------------------------

    @contextmanager
    def swapped_in(self, values: torch.Tensor) -> Iterator[nn.Module]:
        """Temporarily load ``values`` into the working parameters (for evaluation)."""
        saved = self.flat.params.clone()
        with torch.no_grad():
            self.flat.params.copy_(values)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.flat.params.copy_(saved)

    @contextmanager
    def worker_average(self) -> Iterator[nn.Module]:
        """The mean of the workers' current local models (every rank calls it together)."""
        average = self.flat.params.clone()
        # On the uncharged channel: averaging a model for evaluation neither occupies the
        # modeled link nor counts as training traffic (evaluation is off the clock).
        self.runtime.uncharged.all_reduce(average, op="mean", role=Role.PARAMETER).wait()
        with self.swapped_in(average) as model:
            yield model

    # --- state --------------------------------------------------------------------------

    def base_state_bytes(self) -> int:
        """Parameters, gradients, the separate master and the inner optimizer's state."""
        master = tensor_bytes(self.master) if self.separate_master else 0
        return self.flat.bytes + master + self.inner.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.inner.load_state_dict(state["inner"])
