"""A recording fake ``Comm`` for unit tests.

It plays one rank of a group of ``world_size`` in which every rank holds the same tensors as
this one (the situation of data-parallel replicas fed identical data), so results are exact:
a mean is the identity, a sum multiplies by ``world_size``, an all-gather tiles. Every call is
recorded so tests can assert call counts, roles, sizes and order.

Caveat for sharded methods: the all-gather tiles *this* rank's shard into every slot (the
other ranks' shards are not known here), so with ``world_size > 1`` a ZeRO-style parameter
all-gather yields wrong values. Check values of sharded methods on a group of one or on Gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowcomm.comm.base import (
    CollectiveKind,
    CompletedHandle,
    Handle,
    ReduceOp,
    Role,
    Segments,
    check_device,
    check_scatter_shapes,
    check_segments,
    payload_bytes,
)
from lowcomm.comm.runtime import Runtime


@dataclass(frozen=True)
class CommCall:
    """One recorded collective. ``payload_bytes`` is the full (unsharded) payload."""

    kind: CollectiveKind
    role: Role | None
    numel: int
    dtype: torch.dtype
    payload_bytes: int
    op: str | None = None
    segments: tuple[tuple[Role, int], ...] | None = None


class RecordingComm:
    """Records every collective and computes the identical-replica result.

    ``device``: the group's declared device; a collective refuses a tensor on another one, as
    an NCCL group does a host tensor (None: any device)."""

    def __init__(
        self, *, rank: int = 0, world_size: int = 1, device: torch.device | None = None
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.device = device
        self._rank = rank
        self._world_size = world_size
        self.calls: list[CommCall] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _record(
        self,
        kind: CollectiveKind,
        role: Role | None,
        full: torch.Tensor,
        op: str | None = None,
        segments: Segments | None = None,
    ) -> None:
        check_device(full.device, self.device, kind.value)
        fused = tuple(segments) if segments is not None else None
        self.calls.append(
            CommCall(kind, role, full.numel(), full.dtype, payload_bytes(full), op, fused)
        )

    def charge_message(
        self, kind: CollectiveKind, role: Role, payload_bytes: int, start: float
    ) -> Handle:
        """Record a message of this rank alone (to or from a process outside the group) as a
        ``kind`` of ``payload_bytes`` float32 bytes; it completes at once."""
        self.calls.append(
            CommCall(kind, role, payload_bytes // 4, torch.float32, payload_bytes, None, None)
        )
        return CompletedHandle()

    def runtime(self) -> Runtime:
        """A plain communicator's runtime (no clock, itself uncharged) whose messages are
        recorded like its collectives."""
        return Runtime(uncharged=self, message=self.charge_message)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        self._record(CollectiveKind.ALL_REDUCE, role, tensor, op, segments)
        if op == "sum":
            tensor.mul_(self._world_size)
        return CompletedHandle()

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        check_scatter_shapes(output, input, self._world_size, "reduce_scatter")
        self._record(CollectiveKind.REDUCE_SCATTER, role, input, op)
        n = output.numel()
        mine = input.reshape(-1)[self._rank * n : (self._rank + 1) * n]
        output.copy_(mine.view_as(output))
        if op == "sum":
            output.mul_(self._world_size)
        return CompletedHandle()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, self._world_size, "all_gather")
        self._record(CollectiveKind.ALL_GATHER, role, output)
        output.view(self._world_size, -1).copy_(input.reshape(1, -1))
        return CompletedHandle()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Every rank holds this rank's input, so each sends this rank the chunk ``rank``:
        recorded as the reduce-scatter it implements."""
        check_scatter_shapes(output, input, 1, "all_to_all")
        self._record(CollectiveKind.REDUCE_SCATTER, role, input)
        chunks = input.reshape(self._world_size, -1)
        output.view(self._world_size, -1).copy_(chunks[self._rank].reshape(1, -1))
        return CompletedHandle()

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        self._record(CollectiveKind.BROADCAST, role, tensor)
        return CompletedHandle()

    def barrier(self) -> Handle:
        self._record(CollectiveKind.BARRIER, None, torch.empty(0, device=self.device))
        return CompletedHandle()

    def count(self, kind: CollectiveKind, role: Role | None = None) -> int:
        """How many calls of ``kind`` (and ``role``, if given) were made."""
        return sum(1 for c in self.calls if c.kind is kind and (role is None or c.role is role))
