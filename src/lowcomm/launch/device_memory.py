"""Whether K workers fit on one GPU (``--device cuda --workers-per-process K``, issue 30).

The K workers of a process share its GPU: each holds its own model, gradients, optimizer and
method state, and its micro-batch's activations while it computes. Before any worker starts,
one worker's device memory is estimated and K times it is compared with the GPU's free memory;
a K that does not fit is refused in one line with the estimate, the free memory and the
largest K that fits, rather than failing later with an out-of-memory error in one thread.

The estimate follows ``lowcomm plan``'s memory model (``plan._memory_per_worker``): the
method's own declaration (:class:`~lowcomm.strategies.declaration.CostModel`: its model-sized
extra copies, whether its optimizer state is sharded over the workers or over a worker's
ranks) and the plan's optimizer bytes per parameter, with two differences: everything a
worker keeps is float32 here (training keeps float32 parameters, gradients and copies, also
under ``--precision bf16-mixed``; the plan prices ACCO's bf16 convention), and the activations
of a micro-batch are measured, by one forward and backward of the initial model on the GPU
(the peak allocated above what the model and its gradients hold), not modelled. A run with
``--activation-checkpointing`` keeps less than that measurement: the estimate errs high.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lowcomm.config import ConfigError, TrainConfig

#: Bytes per parameter of the optimizer's state: ``lowcomm plan``'s default
#: (``PlanConfig.optimizer_bytes``: a float32 master copy and two moments).
OPTIMIZER_BYTES = 12.0

#: Bytes per element of everything a worker keeps (float32).
ELEMENT_BYTES = 4.0

GIB = 1024**3


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's (one rank's) estimated device memory, in bytes."""

    parameters: float
    gradients: float
    optimizer: float
    method_state: float
    activations: float

    @property
    def total(self) -> float:
        return (
            self.parameters + self.gradients + self.optimizer + self.method_state
            + self.activations
        )  # fmt: skip

    def describe(self) -> str:
        """The parts, in GiB, for the refusal."""
        parts = (
            ("parameters", self.parameters), ("gradients", self.gradients),
            ("optimizer", self.optimizer), ("method state", self.method_state),
            ("a micro-batch's activations", self.activations),
        )  # fmt: skip
        return ", ".join(f"{name} {value / GIB:.2f}" for name, value in parts)


def estimate_worker_memory(
    config: TrainConfig, parameters: int, activation_bytes: float
) -> WorkerMemory:
    """One worker's device memory for ``config``'s method on a model of ``parameters``
    elements, with ``activation_bytes`` measured for its micro-batch (see the module)."""
    from lowcomm.strategies import strategy_class

    cost = strategy_class(config.method).cost
    optimizer_bytes = OPTIMIZER_BYTES / (config.workers if cost.shards_over_workers else 1)
    ranks = config.ranks_per_worker
    if ranks > 1 and cost.shards_over_replicas:
        # The two moments (2/3 of the state) are split over the worker's R ranks.
        optimizer_bytes = OPTIMIZER_BYTES * (1 / 3 + 2 / 3 / ranks)
    # (--optim.name muon keeps one momentum where AdamW keeps two, on its share of the
    # parameters: priced as AdamW, an upper bound.)
    return WorkerMemory(
        parameters=ELEMENT_BYTES * parameters,
        gradients=ELEMENT_BYTES * parameters,
        optimizer=optimizer_bytes * parameters,
        method_state=ELEMENT_BYTES * cost.extra_copies * parameters,
        activations=float(activation_bytes),
    )


def check_workers_fit(
    config: TrainConfig, per_worker: WorkerMemory, free_bytes: float, device: str
) -> None:
    """Refuse (one line) when this process's workers' estimate exceeds ``free_bytes``.

    Raises:
        ConfigError: naming the estimate, the free memory and the largest count that fits.
    """
    ranks = config.ranks_per_worker
    workers = config.workers_per_process
    need = workers * ranks * per_worker.total
    if need <= free_bytes:
        return
    fits = largest_fit(per_worker, ranks, free_bytes)
    each = "each" if ranks == 1 else f"per rank, {ranks} ranks per worker"
    fix = (
        f"at most {fits} workers fit: pass --workers {fits} --workers-per-process {fits}, a "
        f"smaller model or --data.micro-batch-size"
        if fits >= 1
        else "not one worker fits: a smaller model or --data.micro-batch-size"
    )
    raise ConfigError(
        f"--workers-per-process: {workers} workers on {device} need about {need / GIB:.2f} GiB "
        f"({per_worker.total / GIB:.2f} GiB {each}: {per_worker.describe()}) but "
        f"{free_bytes / GIB:.2f} GiB are free; {fix}"
    )


def free_device_bytes(device: torch.device) -> float:
    """What this process can still allocate on ``device``: the driver's free memory plus what
    torch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return float(free + cached)


def measure_activation_bytes(
    model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], device: torch.device, bf16: bool
) -> int:
    """The device memory one forward and backward of ``loss`` on ``model`` allocates above
    what the model and its gradients hold (its peak), on a GPU; the gradients are dropped
    afterwards (the model is the workers' initial one)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        value = loss(model)
    value.backward()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    gradients = sum(
        parameter.grad.numel() * parameter.grad.element_size()
        for parameter in model.parameters()
        if parameter.grad is not None
    )
    model.zero_grad(set_to_none=True)
    del value
    return max(0, peak - before - gradients)


#: Measures a micro-batch's activations (:func:`measure_activation_bytes`'s signature).
Measure = Callable[[nn.Module, Callable[[nn.Module], torch.Tensor], torch.device, bool], int]


def check_device_memory(
    config: TrainConfig,
    model: nn.Module,
    loss: Callable[[nn.Module], torch.Tensor],
    device: torch.device,
    *,
    free_bytes: Callable[[torch.device], float] = free_device_bytes,
    measure: Measure = measure_activation_bytes,
) -> WorkerMemory:
    """Estimate one worker's memory on ``device`` (the activations measured there) and refuse
    a ``--workers-per-process`` whose workers do not fit; return the estimate. ``free_bytes``
    and ``measure`` query the device (tests pass stand-ins).

    Raises:
        ConfigError: the workers do not fit (see :func:`check_workers_fit`).
    """
    activations = measure(model, loss, device, config.precision == "bf16-mixed")
    parameters = sum(parameter.numel() for parameter in model.parameters())
    per_worker = estimate_worker_memory(config, parameters, activations)
    check_workers_fit(config, per_worker, free_bytes(device), str(device))
    return per_worker


def largest_fit(per_worker: WorkerMemory, ranks: int, free_bytes: float) -> int:
    """How many workers of ``ranks`` ranks fit in ``free_bytes``."""
    return math.floor(free_bytes / (ranks * per_worker.total))
