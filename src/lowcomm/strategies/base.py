"""The strategy interface every method implements.

A strategy owns the model's parameters, its optimizer state and all communication. One call to
:meth:`Strategy.step` is one optimizer step of the method; it takes a *closure* that runs
forward and backward on the next micro-batch at the model's current parameters (like the
closure of ``torch.optim.Optimizer.step``), so a method decides how many micro-batches to take
and at which parameters.

Strategies never import ``torch.distributed``; they talk to other workers through the
:class:`~lowcomm.comm.base.Comm` they are given and its handles, and use nothing else of the
layer below but the :class:`~lowcomm.comm.runtime.Runtime` handed in with their context (the
read-only clock, the replica group, the uncharged channel, a communication thread's
accounting, the restoring of settled handles). They import nothing of the emulation, the
two-level communicator or the launcher (``tests/test_strategies.py`` checks it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.comm.runtime import Runtime, runtime_for
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.muon import muon_refusal
from lowcomm.optim.schedule import ScheduleConfig, learning_rate
from lowcomm.strategies.declaration import (
    COMM_DTYPES,
    CostModel,
    MembershipRule,
    QuantizedExchange,
)

#: A micro-batch's or a step's loss: a host float or a 0-dim (device) tensor.
Loss = float | torch.Tensor


def add_loss(total: Loss, loss: Loss) -> Loss:
    """``total + loss`` in float64 without a host read (a tensor stays on its device): the
    same number, bit for bit, as summing the losses as Python floats in the same order."""
    if isinstance(loss, torch.Tensor):
        loss = loss.detach().to(torch.float64)
    return total + loss


@dataclass(frozen=True)
class MicroBatchResult:
    """What a closure reports about the micro-batch it ran (``loss``: a float, or a 0-dim
    tensor left on the device so that the step reads nothing back to the host; the training
    loop reads it every ``--log-every`` steps)."""

    loss: Loss
    samples: int
    tokens: int


Closure = Callable[[], MicroBatchResult]


@dataclass
class StepStats:
    """What one strategy step did on this worker."""

    loss: Loss
    """Mean loss of the step's micro-batches: a float, or a float64 device tensor when the
    closure reported tensors (see :func:`add_loss`)."""
    microbatches: int
    samples: int
    tokens: int
    lr: float
    committed_steps: int = 1
    extras: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StrategyContext:
    """Settings every strategy receives from the training loop.

    Attributes:
        optim: the (inner) optimizer's hyperparameters (AdamW, or Muon + AdamW).
        schedule: learning-rate schedule.
        total_steps: optimizer steps the run will take (for the schedule).
        microbatches_per_step: micro-batches each worker accumulates per step.
        max_grad_norm: clip the averaged gradient to this global L2 norm before the optimizer
            step (None = no clipping, the plain update rule of docs/ALGORITHMS.md).
        microbatch_budget: with a token budget, the micro-batches (summed over workers) a
            method with a variable number per step lays its schedule out over (None: none).
        microbatch_shares: with a token budget, each worker's share of it (summing to it),
            in proportion to the worker's speed (:func:`budget_shares`); None: equal shares.
        runtime: what the strategy may use of the layer below besides its ``Comm`` (the
            training loop hands in ``comm.runtime()``); None: the communicator's own, found
            by :func:`lowcomm.comm.runtime.runtime_for`.
        seed: the run's seed (``--seed``), the same on every worker: a method that needs the
            same random draw on every worker (SPARTA's indices) seeds its own
            ``torch.Generator`` from it, never the process-global RNG.
    """

    optim: AdamWConfig = field(default_factory=AdamWConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    total_steps: int = 100
    microbatches_per_step: int = 1
    max_grad_norm: float | None = 1.0
    microbatch_budget: int | None = None
    microbatch_shares: tuple[int, ...] | None = None
    runtime: Runtime | None = field(default=None, compare=False, repr=False)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"--max-grad-norm: {self.max_grad_norm} must be positive, or None to disable"
            )
        if self.total_steps < 1:
            raise ValueError(f"total_steps: {self.total_steps} must be >= 1")
        if self.microbatches_per_step < 1:
            raise ValueError(f"--microbatches-per-step: {self.microbatches_per_step} must be >= 1")


def budget_shares(budget: int, speed_factors: Sequence[float]) -> tuple[int, ...]:
    """Split ``budget`` micro-batches over workers in proportion to their speed (1 / speed
    factor): a worker twice as slow gets half the share, so all finish their shares at about
    the same time. Largest remainders (ties: the lower rank) make the shares sum to
    ``budget``; while the budget allows, every worker gets at least one."""
    weights = [1.0 / factor for factor in speed_factors]
    exact = [budget * weight / sum(weights) for weight in weights]
    shares = [int(value) for value in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - shares[i]), i))
    for index in by_remainder[: budget - sum(shares)]:
        shares[index] += 1
    for index in range(len(shares)):
        if shares[index] == 0 and budget >= len(shares):
            shares[shares.index(max(shares))] -= 1
            shares[index] = 1
    return tuple(shares)


class Strategy(ABC):
    """Base class of every method.

    Args:
        model: the single-device model; the strategy rebinds its parameters.
        comm: the communicator over the data-parallel workers.
        context: optimizer, schedule and step settings.
    """

    #: Name used by ``lowcomm train --method``.
    name: ClassVar[str]
    #: Field of :class:`lowcomm.config.TrainConfig` holding this method's options (None: the
    #: method has none). The loop passes it to the constructor as ``options=``.
    options_field: ClassVar[str | None] = None
    #: Why the method cannot run with hierarchical workers (--ranks-per-worker > 1), or None
    #: when it can. A method runs hierarchically for free when every rank of a worker, fed the
    #: same collective results, takes the same decisions (no per-rank clock-driven control
    #: flow, no collectives from a second thread).
    hierarchical_refusal: ClassVar[str | None] = None
    #: Why the method cannot run unless every worker is a thread of one process
    #: (``--workers-per-process`` = ``--workers``), or None when any placement will do: its
    #: workers share an object in memory, not only collectives.
    one_process_refusal: ClassVar[str | None] = None
    #: Why the method cannot run on sharded workers (``--worker-sharding fsdp``: each rank
    #: holds 1/R of every parameter, FSDP2 over the worker's ranks), or None when it can: it
    #: takes its buffers from ``sharded_flat.flat_buffers``, sums every norm it reads over the
    #: worker's ranks and computes nothing per whole tensor (``tests/test_sharding.py`` checks
    #: each such method equals its replicated ``--ranks-per-worker`` form).
    sharding_refusal: ClassVar[str | None] = (
        "its buffers and exchanges are written for a whole replica"
    )
    #: Why the method cannot take ``--optim.name muon`` (Muon on the hidden matrices in place
    #: of its AdamW), or None when it can: a method that builds its (inner) optimizer with
    #: ``gradient_step.make_inner_optimizer`` sets None (and refuses an SGD inner itself).
    muon_refusal: ClassVar[str | None] = "its optimizer is not an AdamW that Muon can replace"
    #: State keys (of ``state_dict()``) holding per-worker sums that a later reduction
    #: normalises by their summed counts: an elastic resume pools them onto the new worker 0
    #: (``lowcomm.train.reshard``); other per-worker state is averaged.
    reshard_pooled: ClassVar[tuple[str, ...]] = ()
    #: Whether an elastic resume on another number of workers hands every new worker the old
    #: worker 0's strategy state as it is, for the strategy's ``load_state_dict`` to remap
    #: (the state names the old count), instead of combining the old workers' states by the
    #: re-sharding rules (``lowcomm.train.reshard``).
    reshard_remaps: ClassVar[bool] = False
    #: The planner's closed-form model of this method (``lowcomm plan``): its traffic from its
    #: options, what hides behind compute, extra model-sized copies, state sharding.
    cost: ClassVar[CostModel]
    #: The options that quantize the method's outer exchange (the planner prices the encoded
    #: all-gather from them), or None when it has none.
    quantized_exchange: ClassVar[QuantizedExchange | None] = None
    #: The dtypes (``--comm-dtype``) its gradient and pseudo-gradient collectives can travel
    #: in: they must be issued through the strategy's ``Comm``, which casts them.
    comm_dtypes: ClassVar[tuple[str, ...]] = COMM_DTYPES
    #: Why a dtype missing from ``comm_dtypes`` is refused (one clause, quoted in the error);
    #: required when ``comm_dtypes`` leaves one out.
    comm_dtype_refusal: ClassVar[str | None] = None
    #: Option values (fields of its options class, the rest at their defaults) under which a
    #: few steps run the method's whole cycle: ``lowcomm selftest`` runs it so.
    quick_options: ClassVar[Mapping[str, object]] = {}
    #: How the method lives with workers that come and go (None: not with --faults yet).
    membership: ClassVar[MembershipRule | None] = None

    @classmethod
    def takes_variable_microbatches(cls, options: Any) -> bool:
        """Whether, built with ``options``, the method takes a variable number of
        micro-batches per step (its compute keeps going while it communicates): an
        equal-token comparison gives such a run a token budget instead of a step count."""
        return False

    def __init__(self, model: nn.Module, comm: Comm, context: StrategyContext) -> None:
        self.model = model
        self.comm = comm
        self.context = context
        #: The read-only clock, replica group, uncharged channel and restoring of settled
        #: handles of ``comm`` (see :class:`~lowcomm.comm.runtime.Runtime`).
        self.runtime: Runtime = (
            context.runtime if context.runtime is not None else runtime_for(comm)
        )
        self.step_index = 0
        if context.optim.name == "muon" and self.muon_refusal is not None:
            raise muon_refusal(self.name, self.muon_refusal)

    def lr_at(self, step: int) -> float:
        """Learning rate at 0-based optimizer step ``step``."""
        return learning_rate(
            self.context.schedule, self.context.optim.lr, step, self.context.total_steps
        )

    def broadcast_parameters(self, src: int = 0) -> None:
        """Make every worker start from rank ``src``'s parameters."""
        with torch.no_grad():
            for p in self.model.parameters():
                self.comm.broadcast(p.data, src=src, role=Role.PARAMETER).wait()

    @abstractmethod
    def step(self, closure: Closure) -> StepStats:
        """Take one optimizer step of the method."""

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The model with the parameters this method would deploy (for validation)."""
        yield self.model

    def finish(self) -> None:
        """Drain any communication still in flight at the end of training."""
        return None

    def unsynchronized_tail(self, steps: int) -> str | None:
        """Why the model deployed after ``steps`` steps leaves out the last of them (one line
        the launcher prints before the run starts), or None when it holds every step."""
        return None

    # --- membership (declared faults; methods with a ``membership`` rule) ---------------

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        """What the method declares global: the tensors a joining worker receives from a
        live member (with the role their bytes count under) and the counters."""
        raise NotImplementedError(f"{self.name} declares no membership rule")

    def rank_state(self) -> list[tuple[Role, torch.Tensor]]:
        """What the method declares global but each rank of a worker holds its own slice of
        (a worker of several ranks): healed rank to rank over the outer link, where
        :meth:`global_state`'s tensors are whole on every rank. None by default."""
        return []

    def set_global_counters(self, counters: dict[str, int]) -> None:
        """Take a live member's counters (:meth:`global_state`'s)."""
        raise NotImplementedError(f"{self.name} declares no membership rule")

    def healing_payload(self) -> tuple[list[torch.Tensor], dict[str, int]]:
        """What a live member sends a joiner in one transfer, where an engine heals at a
        round's quorum (torchft): :meth:`global_state`'s tensors and counters, and for a
        method with exchanges in flight at that quorum, their settled results."""
        tensors, counters = self.global_state()
        return [tensor for _, tensor in tensors], dict(counters)

    def take_healing_payload(self, tensors: list[torch.Tensor], counters: dict[str, int]) -> None:
        """A joiner takes a live member's :meth:`healing_payload` (its own state then starts
        by :meth:`start_worker_state`)."""
        mine, _ = self.global_state()
        with torch.no_grad():
            for (_, tensor), theirs in zip(mine, tensors, strict=True):
                tensor.copy_(theirs)
        self.set_global_counters(counters)

    def start_worker_state(self, *, kept: bool) -> None:
        """After healing: start this worker's own state by the method's rule (``kept``: a
        rejoining worker that kept its state; else a new worker with fresh state)."""
        raise NotImplementedError(f"{self.name} declares no membership rule")

    def lose_state(self) -> None:
        """A crash emulated in a process that goes on (under torchrun): every tensor of this
        worker's method state (what its checkpoint holds) becomes zeros, so that its join
        finds nothing of it. A method holding state that is not the worker's own (a
        synchronizer it shares) keeps that."""
        self.load_state_dict(zeroed_tensors(self.state_dict()))

    def round_committed(self, stats: StepStats) -> bool:
        """Whether the step that returned ``stats`` ended a round whose result every member
        applied (its tokens, and a sync round's earlier ones, are then committed)."""
        return True

    def settled_syncs(self) -> list[tuple[int, bool]] | None:
        """For a method whose sync's result is applied rounds after its launch (eager,
        diloco_delayed, co2): the syncs settled since the last call, oldest first, each as
        (its launch step, whether every member applied it), and then ``round_committed``
        says whether the step launched one. None (the default): a round's tokens commit at
        ``round_committed``."""
        return None

    def heal(self, source: int, *, joining: bool, kept: bool = False) -> None:
        """Every member of the round calls this together: the member of rank ``source`` (in
        the round) sends what the method declares global, over the method's link (charged
        like any transfer); a ``joining`` worker takes it and starts its own state by the
        method's rule. The counters (a few integers) travel uncharged."""
        tensors, counters = self.global_state()
        with torch.no_grad():
            for role, tensor in tensors:
                if tensor.numel() == 0:  # (an unused buffer: nothing to send)
                    continue
                # (Only a joiner takes the values: a member keeps its own, which a method may
                # hold per worker, such as a local model it shares with a joiner.)
                into = tensor if joining else tensor.clone()
                self.comm.broadcast(into, src=source, role=role).wait()
            # (Rank r of the joiner takes rank r's slice of the member, on their outer link.)
            outer = getattr(self.comm, "outer_comm", self.comm)
            for role, tensor in self.rank_state():
                into = tensor if joining else tensor.clone()
                outer.broadcast(into, src=source, role=role).wait()
        names = sorted(counters)
        values = torch.tensor([counters[name] for name in names], dtype=torch.float64)
        self.runtime.uncharged.broadcast(values, src=source, role=Role.OTHER).wait()
        if joining:
            received = values.tolist()
            self.set_global_counters({n: int(v) for n, v in zip(names, received, strict=True)})
            self.start_worker_state(kept=kept)

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of the persistent tensors this worker holds: parameters, gradients,
        optimizer states and extra buffers."""

    def state_dict(self) -> dict[str, Any]:
        return {"step_index": self.step_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = int(state["step_index"])


def clip_coefficient(squared_norm: float, max_norm: float | None) -> float:
    """The factor that scales a gradient of squared L2 norm ``squared_norm`` to ``max_norm``."""
    if max_norm is None:
        return 1.0
    norm = math.sqrt(squared_norm)
    return min(1.0, max_norm / (norm + 1e-6))


def clip_(grads: torch.Tensor, squared_norm: torch.Tensor, max_norm: float | None) -> None:
    """Scale ``grads`` in place to L2 norm at most ``max_norm``, given its squared norm.

    The factor is computed on the gradients' device (no host read, which on a GPU would wait
    for every queued kernel), in float64 like :func:`clip_coefficient`, so the result is the
    same bit for bit: ``min(1, max_norm / (sqrt(squared_norm) + 1e-6))``."""
    if max_norm is None:
        return
    norm = squared_norm.detach().double().reshape(()).sqrt()
    grads.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))


def run_microbatches(closure: Closure, count: int) -> tuple[Loss, int, int]:
    """Run ``count`` micro-batches; return (mean loss, samples, tokens)."""
    total_loss: Loss = 0.0
    samples = 0
    tokens = 0
    for _ in range(count):
        result = closure()
        total_loss = add_loss(total_loss, result.loss)
        samples += result.samples
        tokens += result.tokens
    return total_loss / count, samples, tokens


def zeroed_tensors(value: Any) -> Any:
    """``value`` (a state dict) with every tensor in it zeros of its shape and type; every
    other value as it is."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {key: zeroed_tensors(item) for key, item in value.items()}
    if isinstance(value, list):
        return [zeroed_tensors(item) for item in value]
    if isinstance(value, tuple):
        return tuple(zeroed_tensors(item) for item in value)
    return value
