"""Sharded workers (``--worker-sharding fsdp``): a worker's model ``fully_shard``-ed (FSDP2) over
its R ranks, the method running between workers on each rank's local shards (the HSDP shape).

The world is a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`, ``workers x ranks``:
global rank ``g`` is rank ``g % R`` of worker ``g // R`` (the layout of
``lowcomm.launch.groups``). Inside a worker the step is FSDP's: parameters are all-gathered
before each block's forward and backward, and gradients reduce-scattered (averaged over the R
ranks) after it. Between workers, rank ``r`` of every worker holds the same slice of every
parameter, so the method's outer communicator is the group of rank ``r`` of every worker and
its collectives move only local shards. A worker that is a torchft replica group
(``--membership torchft``) has a world of its own R ranks: its mesh is 1-D, those ranks alone,
and rank ``r``'s outer communicator is its own torchft Manager's, to rank ``r`` of the other
workers (:func:`shard_worker`'s ``levels``). With declared faults (``--faults``, a process per
rank) the world holds every worker's processes, those standing by for joins too: a worker's
mesh is then its own ranks' group (:class:`WorkerGroup`), and rank ``r``'s outer communicator
follows each step's quorum (:mod:`lowcomm.faults.processes`).

A strategy sees its parameters through :class:`ShardedFlatBuffers`: one flat buffer holding
the (padded) local shards of every parameter, in ``model.parameters()`` order, which FSDP's own
sharded storage is made to *alias*, so an optimizer step on the buffer is what the next
all-gather sends and nothing is copied back. Gradients are FSDP's (a fresh local shard per
step), copied into the flat gradient buffer once per step. Clipping sums the squared norm over
the worker's ranks, so the clipped gradient is the replicated run's.

FSDP's own all-gathers and reduce-scatters are charged to the inner link's
:class:`~lowcomm.comm.emulated.NetworkComm` (:func:`charge_fsdp_collectives`), which the
strategy's communicator reports as the inner level (:class:`ShardedWorkerComm`).

The model starts on ``meta`` (:func:`initial_model`, :mod:`lowcomm.models.deferred`) and
each rank makes only its own shards (:func:`materialise`), bit for bit the CPU build's values.

With --init-from each rank reads only its own rows of the weights
(:func:`~lowcomm.models.init_from.sliced_start`).

A checkpoint records each rank's slices and the shapes they are cut from
(:func:`fsdp_layout`), so an elastic resume re-cuts them for another --ranks-per-worker
(``lowcomm.train.reshard``).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from lowcomm.comm.base import Charge, CollectiveKind, Comm, Role
from lowcomm.comm.emulated import NetworkComm
from lowcomm.models.blocks import retie, tied_names, transformer_blocks
from lowcomm.strategies.flat import FlatBuffers
from lowcomm.strategies.sharded_flat import (
    FLAT_NUMEL_ATTRIBUTE,
    flat_buffers,
    flat_numel,
    norm_summer,
    register_flat_buffers,
)
from lowcomm.strategies.worker_sharding import SHARDINGS, sharded_methods, sharding_refusal

if TYPE_CHECKING:
    from lowcomm.comm.clock import Clock
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.config import TrainConfig


def worker_mesh(
    workers: int, ranks_per_worker: int, device: str = "cpu", *, timeout_s: float | None = None
) -> Any:
    """The ``workers x ranks`` DeviceMesh of the whole world (a collective: every rank calls
    it). ``mesh["ranks"]`` is this rank's worker, ``mesh["workers"]`` rank r of every worker.

    ``timeout_s`` (--collective-timeout-s): the groups' own timeout is the one the run's
    other groups get (:func:`~lowcomm.comm.torch_comm.process_group_timeout`); a mesh's groups
    otherwise take torch's default, whatever the run asked for (None: that default)."""
    from torch.distributed.device_mesh import init_device_mesh

    override: dict[int | str, Any] | None = None
    if timeout_s is not None:
        options = _group_options(device, timeout_s)
        override = {"workers": options, "ranks": options}
    return init_device_mesh(
        device,
        (workers, ranks_per_worker),
        mesh_dim_names=("workers", "ranks"),
        backend_override=override,
    )


def host_groups(mesh: Any, timeout_s: float) -> tuple[Comm, Comm]:
    """Gloo groups of the mesh's ``ranks`` and ``workers`` groups (this rank's of each; a
    collective: every rank calls it): on a GPU, where the virtual clock agrees on launch
    times as host floats (:class:`~lowcomm.comm.emulated.NetworkComm`'s bookkeeping)."""
    import torch.distributed as dist

    from lowcomm.comm.torch_comm import TorchComm, process_group_timeout

    layout = mesh.mesh  # global ranks, workers x ranks
    timeout = process_group_timeout(timeout_s)
    mine = [
        dist.new_subgroups_by_enumeration(groups, timeout=timeout, backend="gloo")[0]  # type: ignore[no-untyped-call]
        for groups in (layout.tolist(), layout.t().tolist())
    ]
    return TorchComm(mine[0], timeout_s=timeout_s), TorchComm(mine[1], timeout_s=timeout_s)


def _group_options(device: str, timeout_s: float) -> Any:
    """The backend options of a mesh group whose collectives time out after the run's."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    from lowcomm.comm.torch_comm import process_group_timeout

    timeout = process_group_timeout(timeout_s)
    if device == "cuda":  # (NCCL takes its own options class only)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return Backend.Options("gloo", timeout)


def shard_model(model: nn.Module, ranks: Any, *, bf16: bool = False) -> nn.Module:
    """``fully_shard`` every transformer block of ``model`` (the built-in GPT's ``blocks``, a
    ``transformers`` model's decoder layers: :func:`~lowcomm.models.blocks.transformer_blocks`),
    then the rest (embeddings, final norm, output layer) as the root unit, over the 1-D mesh ``ranks`` (one worker's ranks); returns ``model``.

    ``bf16`` (``--precision bf16-mixed``): FSDP2's mixed-precision policy, bfloat16 compute
    parameters (all-gathered in bfloat16: half the bytes) with float32 gradient reduction and
    float32 sharded parameters (the master the strategy steps); the training loop's autocast
    stays on, as on a replicated worker, for the activations."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    blocks = transformer_blocks(model)
    for block in [] if blocks is None else blocks:
        fully_shard(block, mesh=ranks, mp_policy=policy)
    fully_shard(model, mesh=ranks, mp_policy=policy)
    # FSDP keeps the root unit's parameters gathered after a forward, for the backward; after a
    # forward without one (an evaluation), its next forward would reuse that copy, whatever was
    # written into the shards since (the training parameters restored after evaluating the
    # deployed ones, a heal's): reshard at once.
    model.register_forward_hook(_reshard_without_backward)
    _mark_flat_numel(model)
    return model


def _reshard_without_backward(module: nn.Module, _inputs: Any, _output: Any) -> None:
    """After a forward with no gradient (no backward to reshard): free the root's gathered
    parameters, so that the next forward gathers the shards as they are then."""
    if not torch.is_grad_enabled():
        module.reshard()  # type: ignore[operator]


def _mark_flat_numel(model: nn.Module) -> None:
    """Record on each sharded parameter the elements of its padded local storage (what
    :func:`flat_numel` reads)."""
    for fsdp_param in fsdp_params(model):
        setattr(
            fsdp_param.sharded_param, FLAT_NUMEL_ATTRIBUTE, fsdp_param._sharded_param_data.numel()
        )


def fsdp_params(model: nn.Module) -> list[Any]:
    """The FSDP2 parameter records of every unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    found: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                found.extend(group.fsdp_params)
    return found


def is_sharded(model: nn.Module) -> bool:
    # A model can only be sharded once FSDP is imported: a run that never imported it (in-process
    # workers, which use no torch.distributed) does not pay its import to learn so, and its
    # threads do not queue on the import lock.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


class ShardedFlatBuffers(FlatBuffers):
    """The local shards of an FSDP-sharded ``model`` as one flat buffer that FSDP's sharded
    storage aliases (see the module docstring); ``inner`` is the worker's ranks, over which
    :meth:`sum_squared_norm` sums a norm."""

    def __init__(self, model: nn.Module, inner: Comm, pad_to: int = 1) -> None:
        records = {id(fp.sharded_param): fp for fp in fsdp_params(model)}
        params = [p for p in model.parameters() if p.requires_grad]
        missing = [i for i, p in enumerate(params) if id(p) not in records]
        if missing or not params:
            raise ValueError("a sharded worker's model must be fully_shard-ed (shard_model)")
        if {p.dtype for p in params} != {torch.float32}:
            raise ValueError("--worker-sharding fsdp trains in float32 only for now")
        self.inner = inner
        self._model = model
        self.parameters = params
        self.dtype = torch.float32
        self.device = params[0].device
        sizes = [flat_numel(p) for p in params]
        self.numel = sum(sizes)
        self.padded_numel = -(-self.numel // pad_to) * pad_to
        self.params = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.grads = torch.zeros_like(self.params)
        self._offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.whole_ranges = _whole_ranges([records[id(p)] for p in params], self._offsets)
        with torch.no_grad():
            for p, offset, size in zip(params, self._offsets, sizes, strict=True):
                self._alias(records[id(p)], self.params[offset : offset + size])

    @staticmethod
    def _alias(fsdp_param: Any, view: torch.Tensor) -> None:
        """Make ``fsdp_param``'s padded local storage (and its DTensor's local tensor) a view
        of ``view``, keeping its values."""
        padded = fsdp_param._sharded_param_data
        view.copy_(padded)
        local = fsdp_param.sharded_param._local_tensor
        fsdp_param._sharded_param_data = view
        shape = fsdp_param.padded_sharded_param_size
        fsdp_param.sharded_param._local_tensor = view.view(shape).narrow(0, 0, local.size(0))

    def zero_grads(self) -> None:
        self.grads.zero_()
        for p in self.parameters:
            p.grad = None  # FSDP accumulates the micro-batches into a fresh local shard

    def sync_grads(self) -> None:
        """Copy FSDP's reduce-scattered local gradient shards into the flat buffer (charging
        the last micro-batch's FSDP collectives first)."""
        charges = fsdp_charges(self._model)
        if charges is not None:
            charges.flush()
        for p, offset in zip(self.parameters, self._offsets, strict=True):
            grad = p.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            self.grads[offset : offset + local.numel()].copy_(local.reshape(-1))

    def check_params(self) -> None:
        """Nothing to rebind: FSDP's storage is the flat buffer."""

    def sum_squared_norm(self, squared: torch.Tensor) -> None:
        """Sum a one-element squared norm of this rank's shards over the worker's ranks."""
        self.inner.all_reduce(squared, op="sum", role=Role.OTHER).wait()

    def average_over_ranks(self, tensor: torch.Tensor) -> None:
        """Average a small tensor (timings a schedule follows) over the worker's ranks."""
        self.inner.all_reduce(tensor, op="mean", role=Role.OTHER).wait()


def _whole_ranges(records: list[Any], offsets: list[int]) -> list[tuple[int, int, int]]:
    """(whole start, whole stop, local start) of each parameter's local shard: FSDP cuts dim 0
    into chunks of ``ceil(rows / R)`` rows (``torch.chunk``), chunk r on rank r, so a shard is
    one run of elements of the whole parameter."""
    ranges, whole = [], 0
    for record, offset in zip(records, offsets, strict=True):
        shape = record.sharded_param.shape  # the DTensor's global shape
        row = math.prod(shape[1:])
        local = record.sharded_param._local_tensor
        rank = record.mesh_info.shard_mesh_rank
        start = whole + rank * record.padded_sharded_param_size[0] * row
        ranges.append((start, start + local.numel(), offset))
        whole += math.prod(shape)
    return ranges


def attach_inner(model: nn.Module, inner: Comm) -> None:
    """Record ``inner`` (the worker's ranks) as the communicator of sharded ``model``: the
    strategy's :func:`flat_buffers` are then its aliased local shards."""
    register_flat_buffers(model, lambda sharded, pad_to: ShardedFlatBuffers(sharded, inner, pad_to))


def full_flat(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model`` gathered whole and concatenated (a collective over the
    worker's ranks when sharded)."""
    parts = []
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(whole.detach().reshape(-1))
    return torch.cat(parts)


# --- FSDP's collectives on the inner link ----------------------------------------------------


class FsdpCharges:
    """FSDP's collectives of one worker's model, noted as FSDP issues them and charged to the
    worker's link from the main thread once per micro-batch (:meth:`flush`).

    FSDP issues its collectives inside its all-gather and reduce-scatter stream blocks, and
    in the backward on the autograd thread. Charging each there would put a launch-time
    exchange and a host read of it (virtual clock), or a sleep (real clock), inside FSDP's
    prefetch and its overlap of reduce-scatters with the backward, and the real clock's
    timeline would record its events on FSDP's side stream. Noting costs nothing; the flush
    charges what was noted in issue order behind one launch agreement, each waited for in
    turn, so the link's schedule and the clock's totals are those of charging each on the
    spot (FSDP's prefetch is not modeled as overlap)."""

    def __init__(self, inner: NetworkComm) -> None:
        self.inner = inner
        self._noted: list[tuple[CollectiveKind, Role, int]] = []
        self._lock = threading.Lock()  # (noted on the autograd thread, flushed on the main)

    def note(self, kind: CollectiveKind, role: Role, payload_bytes: int) -> None:
        """Note one collective FSDP issued (any thread)."""
        with self._lock:
            self._noted.append((kind, role, payload_bytes))

    def flush(self) -> None:
        """Charge what was noted since the last flush (the main thread; every rank of the
        worker at the same point, as FSDP issues the same collectives on every rank)."""
        with self._lock:
            noted, self._noted = self._noted, []
        if not noted:
            return
        handles = self.inner.charge_many([Charge(*entry) for entry in noted])
        for handle in handles:
            handle.wait()


#: Set on a charged model: its :class:`FsdpCharges`.
_CHARGES = "_lowcomm_fsdp_charges"


def fsdp_charges(model: nn.Module) -> FsdpCharges | None:
    """The :class:`FsdpCharges` of a model :func:`charge_fsdp_collectives` charges (else None)."""
    charges = getattr(model, _CHARGES, None)
    return charges if isinstance(charges, FsdpCharges) else None


def charge_fsdp_collectives(model: nn.Module, inner: NetworkComm) -> FsdpCharges:
    """Have every FSDP unit of ``model`` charge its all-gathers (the unsharded parameters, as
    :class:`~lowcomm.comm.emulated.NetworkComm` prices an all-gather's output) and its
    reduce-scatters (the unsharded gradients) to ``inner``, the worker's link: counted by
    role and kind and placed on the link's schedule, the clock waiting for each (FSDP's
    prefetch is not modeled as overlap). They are charged from the main thread once per
    micro-batch (:class:`FsdpCharges`): before each forward of ``model`` and when its
    gradients are taken (:meth:`ShardedFlatBuffers.sync_grads`). The data moves as FSDP moves
    it (its own collectives, wrapped), never twice. Off while ``model`` evaluates
    (``model.eval()``), as an evaluation is off the clock."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    charges = FsdpCharges(inner)
    setattr(model, _CHARGES, charges)
    model.register_forward_pre_hook(lambda _module, _args: charges.flush(), prepend=True)

    def charge(kind: CollectiveKind, role: Role, full: torch.Tensor) -> None:
        if model.training:
            charges.note(kind, role, full.numel() * full.element_size())

    class ChargedAllGather(DefaultAllGather):  # type: ignore[misc]
        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
            async_op: bool = False,
        ) -> Any:  # fmt: skip
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            charge(CollectiveKind.ALL_GATHER, Role.PARAMETER, output_tensor)
            return work

    class ChargedReduceScatter(DefaultReduceScatter):  # type: ignore[misc]
        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
            async_op: bool = False,
        ) -> Any:  # fmt: skip
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            charge(CollectiveKind.REDUCE_SCATTER, Role.GRADIENT, input_tensor)
            return work

    gather, scatter = ChargedAllGather(), ChargedReduceScatter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    return charges


class ShardedWorkerComm(NetworkComm):
    """A sharded worker's strategy communicator: rank r of every worker over --network (this
    :class:`NetworkComm`), with ``inner``, the worker's ranks over --inner-network, which
    carries FSDP's collectives and the norm sums: reported as the inner level, as a
    hierarchical worker's replica link is, and checkpointed with it."""

    def __init__(
        self, raw: Comm, profile: NetworkProfile, clock: Clock, *, inner: NetworkComm,
        device: torch.device, wire_dtype: torch.dtype, bookkeeping: Comm | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            raw, profile, clock, device=device, wire_dtype=wire_dtype, bookkeeping=bookkeeping
        )
        self.inner = inner

    def level_counters(self) -> dict[str, dict[str, float]]:
        """Per level (inner, outer): bytes this rank sent, exposed and modeled seconds."""
        return {
            name: {
                "bytes_sent": sum(level.bytes_by_role.values()),
                "exposed_comm_s": level.exposed_comm_s,
                "modeled_comm_s": level.modeled_comm_s,
            }
            for name, level in (("inner", self.inner), ("outer", self))
        }

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent on both links."""
        return sum(level["bytes_sent"] for level in self.level_counters().values())

    def counters(self) -> dict[str, float]:
        """Bytes this rank sent on both links, by role."""
        inner = self.inner.counters()
        return {role: value + inner[role] for role, value in super().counters().items()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "inner" in state:  # (a checkpoint from before the inner link was counted: afresh)
            self.inner.load_state_dict(state["inner"])


# --- the training loop's worker --------------------------------------------------------------


def shard_worker(
    config: TrainConfig,
    model: nn.Module,
    clock: Clock,
    device: torch.device,
    links: tuple[NetworkProfile, NetworkProfile],
    deferred: Rows | None = None,
    levels: tuple[Comm, Comm] | None = None,
) -> ShardedWorkerComm:
    """Shard ``model`` over this rank's worker (every rank calls it: the mesh's groups are
    made collectively) and return the strategy's communicator: rank r of every worker, over
    --network. The worker's own communicator (over --inner-network) sums clipping norms.
    ``links``: the (outer, inner) network profiles, built by the caller from the config.
    ``deferred``: ``model`` is on ``meta`` (:func:`initial_model`), and each rank makes only
    its own shards of it; either way every rank r then takes worker 0's rank r's shards
    (uncharged), so the workers provably start from one point. ``levels``: the raw (inner,
    outer) communicators of a worker whose process group is its own R ranks (a torchft
    replica group, :mod:`lowcomm.membership.worker`), or whose inner one is a group of the
    world's (a :class:`WorkerGroup`, declared faults): the mesh is then those ranks alone,
    and rank r's collectives between workers go through ``levels[1]``."""
    from lowcomm.comm.cast import wire_dtype
    from lowcomm.comm.torch_comm import TorchComm

    wire, timeout = wire_dtype(config.comm.comm_dtype), config.comm.collective_timeout_s
    ranks = config.placement.ranks_per_worker
    books: tuple[Comm | None, Comm | None] = (None, None)
    if levels is None:
        mesh = worker_mesh(config.placement.workers, ranks, device.type, timeout_s=timeout)
        if device.type == "cuda":
            books = host_groups(mesh, timeout)
        ranks_mesh = mesh["ranks"]
        inner_raw: Comm = TorchComm(mesh.get_group("ranks"), timeout_s=timeout)
        across: Comm = TorchComm(mesh.get_group("workers"), timeout_s=timeout)
    else:
        inner_raw, across = levels
        group = inner_raw.process_group if isinstance(inner_raw, WorkerGroup) else None
        ranks_mesh = group_mesh(ranks, device.type, timeout_s=timeout, group=group)
    inner = NetworkComm(
        inner_raw, links[1], clock, device=device, wire_dtype=wire, bookkeeping=books[0]
    )
    outer = ShardedWorkerComm(
        across, links[0], clock, inner=inner, device=device, wire_dtype=wire,
        bookkeeping=books[1],
    )  # fmt: skip
    shard_model(model, ranks_mesh, bf16=config.numerics.precision == "bf16-mixed")
    if deferred is not None:
        materialise(model, deferred, device)
    for record in fsdp_params(model):
        if isinstance(across, StartsFromFirstWorker):
            across.from_first_worker(record._sharded_param_data)
        else:
            across.broadcast(record._sharded_param_data, src=0, role=Role.PARAMETER).wait()
    attach_inner(model, inner)
    charge_fsdp_collectives(model, inner)
    return outer


@runtime_checkable
class WorkerGroup(Protocol):
    """A worker's R ranks as a process group of a world that holds other workers' ranks too
    (declared faults with a process per rank, :func:`~lowcomm.faults.processes.quorum_levels`):
    its FSDP mesh is made of that group (:func:`group_mesh`)."""

    @property
    def process_group(self) -> Any: ...


@runtime_checkable
class StartsFromFirstWorker(Protocol):
    """An outer communicator with no group between workers at set-up (its groups follow the
    quorum of each step, made as the steps are resolved): rank r takes worker 0's rank r's
    tensor some other way (:class:`~lowcomm.faults.processes.QuorumOuterComm`)."""

    def from_first_worker(self, tensor: torch.Tensor) -> None: ...


def group_mesh(
    ranks: int, device: str = "cpu", *, timeout_s: float | None = None, group: Any = None
) -> Any:
    """The 1-D ``ranks`` DeviceMesh of one worker's R ranks: the world, where it is those ranks
    alone (a torchft replica group's own process group; a collective: every rank calls it),
    or ``group``, a group of the world made already (its timeout is the group's own)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is not None:
        return DeviceMesh.from_group(group, device, mesh_dim_names=("ranks",))
    override: dict[int | str, Any] | None = None
    if timeout_s is not None:
        override = {"ranks": _group_options(device, timeout_s)}
    return init_device_mesh(device, (ranks,), mesh_dim_names=("ranks",), backend_override=override)


# --- the start: a model on meta, each rank making its own shards --------------------------


class Rows(Protocol):
    """Where a model built on ``meta`` gets the values of its tensors, rows at a time."""

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


def initial_model(
    config: TrainConfig, build: Callable[[], nn.Module], rank: int
) -> tuple[nn.Module, Rows | None]:
    """A sharded worker's initial model: ``build()`` run on the ``meta`` device, with what
    makes each tensor's values as a CPU build would (:func:`~lowcomm.models.deferred.
    build_deferred`; the default generator left where a CPU build leaves it), so no rank
    ever holds the whole model; with --init-from, the model of its config.json on ``meta``,
    each rank reading only its own rows of the weights
    (:func:`~lowcomm.models.init_from.sliced_start`). A model whose initialisation cannot be
    deferred is built whole on the CPU instead (None: rank 0 says why)."""
    from lowcomm.models.deferred import build_deferred

    if config.placement.device == "cpu":
        return_freed_memory()
    if config.run.init_from is not None:
        from lowcomm.models.init_from import preflight_init_from, sliced_start

        return sliced_start(preflight_init_from(config.run.init_from, config.model))
    state = torch.default_generator.get_state()
    try:
        return build_deferred(build)
    except Exception as error:  # (a real problem of the model raises again below)
        torch.default_generator.set_state(state)
        if rank == 0:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            print(
                f"lowcomm: note: --worker-sharding fsdp: the model is built whole on every "
                f"rank before it is sharded (its initialisation cannot be made shard by "
                f"shard: {reason})",
                flush=True,
            )
        return build(), None


#: glibc's mallopt parameter of the mmap threshold, and the value a sharded CPU worker sets.
_M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process (False where the
    C library has no ``mallopt``): blocks of a megabyte or more are then mapped for themselves
    and returned to the system when freed. By default glibc raises the threshold to the size
    of each such block freed (up to 32 MB), after which they come from its heap, which keeps
    freed memory: FSDP gathers and frees every block's parameters and gradients in every pass,
    and the heap grew by several times the rank's state (on a 12M-parameter Llama, 2 x 2
    ranks: peak RSS 784 MB per rank, 566 MB with the threshold fixed)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def materialise(model: nn.Module, deferred: Rows, device: torch.device) -> None:
    """Give a ``fully_shard``-ed model built on ``meta`` real storage on ``device``, each
    rank only its own (padded) shards, and fill them with the rows a CPU build gives (one
    whole tensor made at a time, then freed); buffers whole (FSDP does not shard them)."""
    records = {id(record.sharded_param): record for record in fsdp_params(model)}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # (keeps tied parameters one)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            record = records[id(parameter)]
            record._sharded_param_data.zero_()  # (the padding)
            local = parameter._local_tensor  # type: ignore[attr-defined]
            if local.numel() == 0:
                continue
            start = record.mesh_info.shard_mesh_rank * record.padded_sharded_param_size[0]
            local.copy_(deferred.rows(name, start, start + local.size(0)))
        for name, buffer in model.named_buffers():
            buffer.copy_(deferred.rows(name))
    _mark_flat_numel(model)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state with every sharded tensor as this rank's local shard (what its own
    checkpoint file holds)."""
    return {
        name: value.to_local() if hasattr(value, "to_local") else value
        for name, value in model.state_dict().items()
    }


def fsdp_layout(model: nn.Module) -> dict[str, Any] | None:
    """What re-cuts a sharded ``model``'s checkpoint for another number of ranks per worker
    (``lowcomm.train.reshard``), or None for a whole model: the global shape of every sharded
    tensor of its state dict by name (``sharded``), and of every trained parameter in its flat
    buffer's order (``flat``, :class:`ShardedFlatBuffers`). FSDP cuts dim 0 of each into
    ``ceil(rows / R)``-row chunks, so the shapes and R give every rank's slice."""
    if not is_sharded(model):
        return None
    return {
        "sharded": {
            name: list(value.shape)
            for name, value in model.state_dict().items()
            if hasattr(value, "to_local")
        },
        "flat": [list(p.shape) for p in model.parameters() if p.requires_grad],
    }


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Undo :func:`model_state`: copy each saved (local) tensor into ``model``'s in place, so
    a sharded model's storage stays its flat buffer's."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    current = model.state_dict()
    if set(current) != set(state):
        raise ValueError(f"the checkpoint's model keys differ: {sorted(set(current) ^ set(state))}")
    with torch.no_grad():
        for name, value in current.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            local.copy_(state[name])


def exportable(model: nn.Module, rank: int, ranks_per_worker: int) -> nn.Module | None:
    """The whole model to export from global rank ``rank``: ``model`` itself, or for a sharded
    model the full state gathered tensor by tensor (a collective over the worker's ranks, made
    by worker 0's ranks only) into a fresh unsharded model on worker 0's rank 0 (None on every
    other rank, which keeps no gathered tensor)."""
    if not is_sharded(model):
        return model
    if rank >= ranks_per_worker:
        return None
    full: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value
        if rank == 0:
            full[name] = whole.detach().cpu()
    if rank != 0:
        return None
    plain = unsharded_like(model)
    groups = tied_names(plain)
    plain.load_state_dict(full, assign=True)
    retie(plain, groups)
    for name, buffer in model.named_buffers():  # (FSDP does not shard buffers)
        owner, _, attribute = name.rpartition(".")
        setattr(plain.get_submodule(owner), attribute, buffer.detach().clone())
    return plain


def unsharded_like(model: nn.Module) -> nn.Module:
    """A model of ``model``'s architecture on the ``meta`` device, without FSDP (for the
    built-in GPT and ``transformers`` models: the export's).

    Raises:
        TypeError: naming a model of another class, which cannot be rebuilt from its config.
    """
    from lowcomm.models.gpt import GPT
    from lowcomm.models.hf import HFCausalLM

    with torch.device("meta"):
        if isinstance(model, HFCausalLM):
            return HFCausalLM(model.hf_config)
        if isinstance(model, GPT):
            return GPT(model.config)
    raise TypeError(
        f"--worker-sharding fsdp: cannot export a sharded {type(model).__name__} (only the "
        f"built-in GPT and transformers models are rebuilt whole); use --worker-sharding "
        f"replicate"
    )


__all__ = [
    "SHARDINGS",
    "FsdpCharges",
    "Rows",
    "ShardedFlatBuffers",
    "ShardedWorkerComm",
    "StartsFromFirstWorker",
    "WorkerGroup",
    "attach_inner",
    "charge_fsdp_collectives",
    "exportable",
    "flat_buffers",
    "flat_numel",
    "fsdp_charges",
    "fsdp_layout",
    "full_flat",
    "group_mesh",
    "host_groups",
    "initial_model",
    "is_sharded",
    "load_model_state",
    "materialise",
    "model_state",
    "norm_summer",
    "return_freed_memory",
    "shard_model",
    "shard_worker",
    "sharded_methods",
    "sharding_refusal",
    "unsharded_like",
    "worker_mesh",
]
