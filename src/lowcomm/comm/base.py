"""The one communication interface every strategy uses.

A :class:`Comm` is bound to one process group (not to the world), so that a strategy can later
be handed an inner and an outer communicator. Every collective is asynchronous: it returns a
:class:`Handle`, and the tensor handed to it holds garbage until ``wait()`` returns.

Every collective takes a :class:`Role` saying what the bytes are (gradient, parameter, moment,
pseudo-gradient), so that byte accounting can be broken down by what moved.

A checkpoint taken with collectives in flight *settles* each handle (:meth:`Handle.settle`):
the data moves now, without charging the clock, and the handle returns a :class:`Settled`
record of what it still owes the clock. The runtime of the strategy's communicator
(:mod:`lowcomm.comm.runtime`) turns that record back into a handle after a resume, so every
handle, emulated or two-level, is checkpointed the same way and the resumed run's modeled
time equals the straight run's.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

ReduceOp = Literal["sum", "mean", "max"]


class Role(str, enum.Enum):
    """What a collective's payload is, for byte accounting."""

    GRADIENT = "gradient"
    PARAMETER = "parameter"
    FIRST_MOMENT = "first_moment"
    SECOND_MOMENT = "second_moment"
    PSEUDO_GRADIENT = "pseudo_gradient"
    OTHER = "other"


class CollectiveKind(str, enum.Enum):
    """The collectives the network model knows how to price."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    BARRIER = "barrier"


@dataclass(frozen=True)
class Charge:
    """A collective whose data has already moved but whose cost is still to be charged: its
    kind, role (None for a barrier) and full payload in bytes, as the network model prices it."""

    kind: CollectiveKind
    role: Role | None
    payload_bytes: int


@dataclass(frozen=True)
class Settled:
    """What a settled collective still owes the clock (see :meth:`Handle.settle`).

    Attributes:
        finish_time: the completion of its transfer on the link, on the run's clock: the
            modeled one, or on the real clock the data's arrival when that came later (None:
            not emulated, or already waited for; nothing to wait for).
        then: collectives that follow the transfer on the worker's inner level (a two-level
            communicator's all-gather), whose data has moved too; they are charged, in order,
            once ``finish_time`` has passed, when the handle is waited for. Their modeled
            start depends on when that wait happens, so it cannot be known when settling.
    """

    finish_time: float | None = None
    then: tuple[Charge, ...] = ()

    @property
    def completion(self) -> float | None:
        """The modeled completion of the whole collective when settling knows it (None when
        it is known only once waited for, or when the collective is not emulated)."""
        return self.finish_time if not self.then else None

    def state_dict(self) -> dict[str, Any]:
        """Plain values, for a checkpoint."""
        return {
            "finish_time": self.finish_time,
            "then": [
                {
                    "kind": charge.kind.value,
                    "role": None if charge.role is None else charge.role.value,
                    "payload_bytes": charge.payload_bytes,
                }
                for charge in self.then
            ],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Settled:
        """The record :meth:`state_dict` saved."""
        finish = state["finish_time"]
        return cls(
            None if finish is None else float(finish),
            tuple(
                Charge(
                    CollectiveKind(item["kind"]),
                    None if item["role"] is None else Role(item["role"]),
                    int(item["payload_bytes"]),
                )
                for item in state.get("then", ())
            ),
        )


class CollectiveTimeout(TimeoutError):
    """A collective did not complete in time; the message names the rank, the collective and
    the time waited."""


@runtime_checkable
class Handle(Protocol):
    """An in-flight collective."""

    def wait(self) -> None:
        """Block until the collective has completed; its output tensor is then valid."""
        ...

    def done(self) -> bool:
        """Whether ``wait()`` would return without blocking (never blocks on the wire)."""
        ...

    def settle(self) -> Settled:
        """Finish the data movement now without charging the clock (for a checkpoint taken
        with the collective in flight); return what it still owes the clock. A later
        ``wait()`` still charges the clock exactly as if ``settle()`` had not been called,
        and ``Runtime.restore`` of the record gives a handle whose ``wait()`` does the same
        after a resume. A handle that is not emulated simply waits and returns ``Settled()``."""
        ...


@runtime_checkable
class Comm(Protocol):
    """Asynchronous collectives over one group of workers.

    All ranks of the group must issue the same collectives in the same order. Shapes follow
    ``torch.distributed``: ``reduce_scatter`` takes an input of ``world_size * n`` elements and
    writes ``n`` into ``output``; ``all_gather`` takes ``n`` elements and writes
    ``world_size * n`` into ``output``.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        """Reduce ``tensor`` in place across the group.

        ``segments``: when ``tensor`` concatenates payloads of several roles (a fused sync),
        their ``(role, number of elements)`` in order; bytes are then counted per segment's
        role instead of all under ``role``. The counts must add up to ``tensor.numel()``.
        """
        ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        """Reduce ``input`` across the group; this rank's slice lands in ``output``."""
        ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Concatenate every rank's ``input`` (in rank order) into ``output``."""
        ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Send chunk ``j`` of ``input`` (``world_size`` equal chunks) to rank ``j``; chunk
        ``i`` of ``output`` receives rank ``i``'s chunk for this rank.

        The first step of a reduce-scatter whose reduction cannot run on the wire (quantized
        payloads: each shard's owner decodes and sums what it received): it moves and is
        counted and priced as a reduce-scatter of ``input``."""
        ...

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""
        ...

    def barrier(self) -> Handle:
        """Complete once every rank has reached it."""
        ...


#: ``(role, number of elements)`` of each payload fused into one collective, in order.
Segments = Sequence[tuple["Role", int]]


def check_segments(tensor: torch.Tensor, segments: Segments | None) -> None:
    """Raise a clear error when fused segments do not tile the tensor."""
    if segments is not None and sum(count for _, count in segments) != tensor.numel():
        raise ValueError(
            f"all_reduce: segments cover {sum(count for _, count in segments)} elements but the "
            f"tensor has {tensor.numel()}; list every fused payload's (role, numel) in order"
        )


class CompletedHandle:
    """A handle for work that finished when it was issued."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def settle(self) -> Settled:
        return Settled()


def arrival_stamp(handle: object) -> float | None:
    """When ``handle``'s data arrived (``time.perf_counter``), for handles that stamp it
    (a Gloo or NCCL collective, or a wrapper of one); None otherwise or not yet. Ask after
    the handle's wait: an NCCL collective's arrival is waited for."""
    completed_at = getattr(handle, "completed_at", None)
    return None if completed_at is None else completed_at()


@contextmanager
def collective_arithmetic() -> Iterator[None]:
    """The arithmetic a collective does to deliver its result (the reduction of the members'
    tensors in one process, the local sum after an exchange) runs in here: outside the calling
    thread's dispatch modes, so the calibrated clock's element counter
    (:class:`lowcomm.comm.calibration.ElementCounter`) does not charge it to the worker that
    happens to run it. It is the collective's, priced by the network model: a worker process
    waiting for Gloo does none of it on its own thread, and in one process the member that
    completes a collective reduces every member's tensors."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    modes = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_mode(mode)


def same_device(tensor_device: torch.device, group_device: torch.device) -> bool:
    """Whether a tensor on ``tensor_device`` can go through a group on ``group_device``: the
    same type of device. (Not the same index: a process may hold tensors on another GPU of
    its node than the one it bound, which the backend handles.)"""
    return tensor_device.type == group_device.type


def check_device(tensor_device: torch.device, group_device: torch.device | None, op: str) -> None:
    """Refuse a tensor that is not on the group's device (None: the group declared none).

    NCCL moves GPU tensors only, and a host tensor reaching it fails deep inside the backend
    on a GPU cluster; a group that declares its device turns that into this error wherever the
    tensor is made, on any machine."""
    if group_device is not None and not same_device(tensor_device, group_device):
        raise ValueError(
            f"{op}: the tensor is on {tensor_device} but the group's device is {group_device}; "
            f"make every tensor a collective touches on the group's device (comm.device)"
        )


def values_on(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``values`` made on ``device`` by fill kernels, which take each
    value as an argument: ``torch.tensor(values, device=...)`` is a blocking copy from
    pageable host memory on a GPU."""
    out = torch.empty(len(values), dtype=torch.float32, device=device)
    for index, value in enumerate(values):
        out[index].fill_(value)
    return out


def payload_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor occupies on the wire, at its own dtype."""
    return tensor.numel() * tensor.element_size()


def check_scatter_shapes(
    output: torch.Tensor, input: torch.Tensor, world_size: int, op: str
) -> None:
    """Raise a clear error when a reduce-scatter or all-gather is handed mismatched buffers."""
    big, small = (input, output) if op == "reduce_scatter" else (output, input)
    if big.numel() != small.numel() * world_size:
        raise ValueError(
            f"{op}: the full buffer has {big.numel()} elements but the per-rank buffer has "
            f"{small.numel()} and world_size is {world_size}; the full buffer must hold exactly "
            f"world_size x per-rank elements (pad the flat tensor to a multiple of world_size)"
        )
    if big.dtype != small.dtype:
        raise ValueError(f"{op}: dtypes differ ({big.dtype} vs {small.dtype}); use one dtype")
