"""Whether K workers fit in one process's memory (``--workers-per-process K``): on
``--device cuda`` the GPU's, on the CPU the host's.

The K workers of a process share its device: each holds its own model, gradients, optimizer and
method state, and its micro-batch's activations while it computes. Before any worker starts,
one worker's memory is estimated and K times it is compared with what the device has free;
a K that does not fit is refused in one line with the estimate, the free memory and the
largest K that fits, rather than failing later with an out-of-memory error in one thread (on
a GPU) or the kernel killing the process, after swapping the machine to a crawl (on a laptop).

The estimate follows ``lowcomm plan``'s memory model (``plan._memory_per_worker``): the
method's own declaration (:class:`~lowcomm.strategies.declaration.CostModel`: its model-sized
extra copies, whether its optimizer state is sharded over the workers or over a worker's
ranks) and the plan's optimizer bytes per parameter, with two differences: everything a
worker keeps is float32 here (training keeps float32 parameters, gradients and copies, also
under ``--precision bf16-mixed``; the plan prices ACCO's bf16 convention), and the activations
of a micro-batch are measured by one forward and backward of the initial model: on a GPU, the
peak allocated above what the model and its gradients hold; on the CPU, which keeps no such
peak, what the forward saves for the backward (parameters left out), with :data:`HOST_SLACK`
per worker for what a thread of Python keeps beside its tensors. A run with
``--activation-checkpointing`` keeps less than that measurement: the estimate errs high.

On the CPU, the free memory is the kernel's ``MemAvailable``, or less where this process's
cgroup (a container's limit) leaves less; where neither can be read (not Linux) the check is
skipped. The processes of one machine (the local spawner's P, torchrun's local world) share
it: each checks for all of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowcomm.config import ConfigError, TrainConfig

#: Bytes per parameter of the optimizer's state: ``lowcomm plan``'s default
#: (``PlanConfig.optimizer_bytes``: a float32 master copy and two moments).
OPTIMIZER_BYTES = 12.0

#: Bytes per element of everything a worker keeps (float32).
ELEMENT_BYTES = 4.0

GIB = 1024**3
MIB = 1024**2

#: Host memory a CPU worker keeps beside the tensors the estimate counts (its thread, its
#: strategy's and data shard's Python objects, the allocator's slack). For a 2-layer GPT 64
#: wide, the peak resident memory of 256 workers in one process less that of 4, per worker,
#: less the estimate's tensors, is 0.2 (ddp) to 3.1 MiB (diloco) (docs/results/inprocess.md).
#: Rounded up, so that the estimate errs high.
HOST_SLACK = 4 * MIB

#: Host memory a worker *process* keeps beside its tensors (``--workers-per-process 1``): what
#: a process forked from the launcher's fork server, which imported torch before forking,
#: writes of its own: the unique set size (private pages) of a worker process of a ddp run of
#: a 2-layer GPT 64 wide is about 30 MiB, more for rank 0 (it also evaluates and writes the
#: run's files; docs/results/inprocess.md). The lower of them, so that the check below refuses
#: only runs that cannot fit.
PROCESS_SLACK = 30 * MIB


def amount(value: float) -> str:
    """``value`` bytes in GiB, or in MiB under one GiB."""
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.1f} MiB"


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's (one rank's) estimated device memory, in bytes."""

    parameters: float
    gradients: float
    optimizer: float
    method_state: float
    activations: float
    slack: float = 0.0
    """On the CPU, :data:`HOST_SLACK` (0 on a GPU)."""

    @property
    def total(self) -> float:
        return (
            self.parameters + self.gradients + self.optimizer + self.method_state
            + self.activations + self.slack
        )  # fmt: skip

    def describe(self, unit: str = "worker") -> str:
        """The parts, for the refusal (``unit``: what the slack is the rest of)."""
        parts = [
            ("parameters", self.parameters), ("gradients", self.gradients),
            ("optimizer", self.optimizer),
        ]  # fmt: skip
        if self.method_state:
            parts.append(("method state", self.method_state))
        if self.activations:  # (0: not measured, see check_worker_processes)
            parts.append(("a micro-batch's activations", self.activations))
        if self.slack:
            parts.append((f"the rest of a {unit}", self.slack))
        return ", ".join(f"{name} {amount(value)}" for name, value in parts)


def estimate_worker_memory(
    config: TrainConfig, parameters: float, activation_bytes: float, *, slack: float = 0.0
) -> WorkerMemory:
    """One worker's (one rank's) device memory for ``config``'s method on a model of
    ``parameters`` elements, with ``activation_bytes`` measured for its micro-batch and
    ``slack`` beside its tensors (see the module)."""
    from lowcomm.strategies import strategy_class

    cost = strategy_class(config.method).cost
    optimizer_bytes = OPTIMIZER_BYTES / (
        config.placement.workers if cost.shards_over_workers else 1
    )
    ranks = config.placement.ranks_per_worker
    if ranks > 1 and config.placement.worker_sharding == "fsdp":
        # Each of the worker's R ranks holds 1/R of the model, and of all priced by it.
        parameters = parameters / ranks
    elif ranks > 1 and cost.shards_over_replicas:
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
        slack=slack,
    )


def check_workers_fit(
    config: TrainConfig,
    per_worker: WorkerMemory,
    free_bytes: float,
    device: str,
    *,
    processes: int = 1,
) -> None:
    """Refuse (one line) when the workers' estimate exceeds ``free_bytes``: this process's, or
    those of the ``processes`` of this machine that share ``device``'s memory (the host's).

    Raises:
        ConfigError: naming the estimate, the free memory and the largest count that fits.
    """
    ranks = config.placement.ranks_per_worker
    workers = config.placement.workers_per_process
    need = processes * workers * ranks * per_worker.total
    if need <= free_bytes:
        return
    fits = largest_fit(per_worker, ranks, free_bytes / processes)
    each = "each" if ranks == 1 else f"per rank, {ranks} ranks per worker"
    if fits < 1:
        fix = "not one worker fits: a smaller model or --micro-batch-size"
    elif processes == 1:
        fix = (
            f"at most {fits} workers fit: pass --workers {fits} --workers-per-process {fits}, "
            f"a smaller model or --micro-batch-size"
        )
    else:
        fix = (
            f"at most {fits} workers per process fit: pass --workers-per-process {fits} "
            f"(and --workers {processes} x {fits}), a smaller model or --micro-batch-size"
        )
    whose = "" if processes == 1 else f" in {processes} processes of this machine"
    raise ConfigError(
        f"--workers-per-process: {processes * workers} workers on {device}{whose} need about "
        f"{amount(need)} ({amount(per_worker.total)} {each}: {per_worker.describe()}) but "
        f"{amount(free_bytes)} are free; {fix}"
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
    per_worker = measured_estimate(config, model, loss, device, measure)
    check_workers_fit(config, per_worker, free_bytes(device), str(device))
    return per_worker


def measured_estimate(
    config: TrainConfig,
    model: nn.Module,
    loss: Callable[[nn.Module], torch.Tensor],
    device: torch.device,
    measure: Measure,
    *,
    slack: float = 0.0,
) -> WorkerMemory:
    """One worker's estimate for ``model``, its activations measured by ``measure`` on
    ``device`` (see :func:`estimate_worker_memory`)."""
    activations = measure(model, loss, device, config.numerics.precision == "bf16-mixed")
    parameters = sum(parameter.numel() for parameter in model.parameters())
    return estimate_worker_memory(config, parameters, activations, slack=slack)


def largest_fit(per_worker: WorkerMemory, ranks: int, free_bytes: float) -> int:
    """How many workers of ``ranks`` ranks fit in ``free_bytes``."""
    return math.floor(free_bytes / (ranks * per_worker.total))


# --- the host's memory (CPU workers) ----------------------------------------------------------


def measure_saved_bytes(
    model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], device: torch.device, bf16: bool
) -> int:
    """What one forward of ``loss`` on ``model`` saves for its backward, in bytes (each
    storage once, ``model``'s parameters left out): a micro-batch's activations where no
    allocator keeps a peak (the CPU). The backward then runs and the gradients are dropped;
    the process's generator is left as it was (the model is the workers' initial one)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.random.fork_rng(devices=[]):
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
        ):
            value = loss(model)
        value.backward()  # type: ignore[no-untyped-call]
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def available_host_bytes(root: Path = Path("/")) -> float | None:
    """What this process can still allocate in host memory: the kernel's ``MemAvailable``, or
    less where this process's cgroup has a memory limit (its limit less its usage, its
    inactive file cache counted as free, as the kernel counts it); None where neither can be
    read. ``root``: where ``/proc`` and ``/sys`` are (tests pass a tree of their own)."""
    found: list[float] = []
    meminfo = _read(root / "proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append(float(line.split()[1]) * 1024)
    limit = _cgroup_room(root)
    if limit is not None:
        found.append(limit)
    return min(found) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_room(root: Path) -> float | None:
    """The room left under this process's cgroup memory limit (v2, else v1), or None."""
    membership = _read(root / "proc/self/cgroup") or ""
    for line in membership.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            folder = root / "sys/fs/cgroup" / path.lstrip("/")
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            folder = root / "sys/fs/cgroup/memory" / path.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        limit, usage = _read(folder / files[0]), _read(folder / files[1])
        if limit is None or usage is None or not limit.strip().isdigit():
            continue  # (no such files, or "max": no limit)
        if int(limit) >= 2**60:  # (v1's "no limit")
            continue
        inactive = 0
        for stat in (_read(folder / "memory.stat") or "").splitlines():
            key, _, value = stat.partition(" ")
            if key == files[2] and value.strip().isdigit():
                inactive = int(value)
        return float(int(limit) - int(usage) + inactive)
    return None


def processes_on_this_machine(world_size: int) -> int:
    """How many of the run's processes share this machine's memory: torchrun's local world,
    else every process (the local spawner starts them all here)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and local.isdigit() else world_size


def check_host_memory(
    config: TrainConfig,
    model: nn.Module,
    loss: Callable[[nn.Module], torch.Tensor],
    *,
    processes: int = 1,
    free_bytes: Callable[[], float | None] | None = None,
    measure: Measure | None = None,
) -> tuple[WorkerMemory, float] | None:
    """Estimate one CPU worker's host memory and refuse a ``--workers-per-process`` whose
    workers (in ``processes`` processes of this machine) do not fit; return the estimate and
    the free memory, or None where the free memory cannot be read (nothing is measured
    then). ``free_bytes`` and ``measure`` query the machine (default
    :func:`available_host_bytes` and :func:`measure_saved_bytes`; tests pass stand-ins).

    Raises:
        ConfigError: the workers do not fit (see :func:`check_workers_fit`).
    """
    free = (available_host_bytes if free_bytes is None else free_bytes)()
    if free is None:
        return None
    measure = measure_saved_bytes if measure is None else measure
    per_worker = measured_estimate(
        config, model, loss, torch.device("cpu"), measure, slack=HOST_SLACK
    )
    check_workers_fit(config, per_worker, free, "cpu", processes=processes)
    return per_worker, free


# --- worker processes (--workers-per-process 1) -----------------------------------------------


def check_worker_processes(
    config: TrainConfig,
    parameters: int,
    *,
    standbys: int = 0,
    free_bytes: Callable[[], float | None] | None = None,
) -> WorkerMemory | None:
    """Before the local spawner starts ``config.world_size`` CPU worker processes (one rank
    each) and ``standbys`` more (a run with declared faults starts one for each join that
    follows a crash, :func:`lowcomm.faults.processes.process_layout`; each builds its model
    and method state at the start, as a worker does), refuse a run whose processes cannot
    fit this machine's free host memory, in one line with the estimate and the largest
    worker count that fits; return the estimate per process (None: not checked: a GPU run,
    workers sharing processes, which their processes check themselves, or a free memory
    that cannot be read).

    The estimate is a floor: the model's ``parameters`` priced as :func:`estimate_worker_memory`
    prices them (1/R of everything per rank under ``--worker-sharding fsdp``) and
    :data:`PROCESS_SLACK` per process, without a micro-batch's activations (measuring them
    would take a forward and backward here, before the workers exist). So a refused run could
    not have fitted, and a run near the limit is let through, as before.

    Raises:
        ConfigError: the processes do not fit.
    """
    if config.placement.device != "cpu" or config.placement.workers_per_process != 1:
        return None
    free = (available_host_bytes if free_bytes is None else free_bytes)()
    if free is None:
        return None
    each = estimate_worker_memory(config, parameters, 0.0, slack=PROCESS_SLACK)
    processes = config.placement.world_size + standbys
    need = processes * each.total
    if need > free:
        raise ConfigError(_processes_refusal(config, each, need, free, standbys))
    return each


def _processes_refusal(
    config: TrainConfig, each: WorkerMemory, need: float, free: float, standbys: int
) -> str:
    """The one line of :func:`check_worker_processes`'s refusal."""
    ranks = config.placement.ranks_per_worker
    fits = max(0, largest_fit(each, ranks, free) - standbys)
    one_process = config.placement.workers * ranks * (each.total - each.slack + HOST_SLACK)
    if not fits:
        fix = "not one worker fits: a smaller model"
    else:
        fix = (
            f"at most {fits} {'worker fits' if fits == 1 else 'workers fit'}: pass --workers {fits}"
        )
        if one_process <= free and config.placement.worker_sharding != "fsdp":
            fix += (
                f", --workers-per-process {config.placement.workers} (every worker in one process: "
                f"the interpreter once, about {amount(one_process)})"
            )
        fix += " or a smaller model"
    unit = "process" if ranks == 1 else f"process, {ranks} per worker"
    counted = f"{config.placement.world_size} worker processes"
    if standbys:
        counted = (
            f"{config.placement.world_size + standbys} worker processes ({config.placement.world_size} "
            f"and {standbys} standing by for the joins of the --faults trace)"
        )
    return (
        f"--workers {config.placement.workers}: {counted} on this machine need "
        f"at least {amount(need)} of host memory ({amount(each.total)} per {unit}: "
        f"{each.describe('process')}; a micro-batch's activations not counted) but "
        f"{amount(free)} are free; {fix}"
    )
