"""Hierarchical workers: a worker is R ranks on a fast inner link; the method runs between
workers over the slow outer link.

Global rank ``g`` is rank ``r = g % R`` of worker ``m = g // R``. The *inner* group holds the R
ranks of one worker; the *outer* group holds the M ranks with the same local index ``r``, one
per worker. All R ranks of a worker are replicas: they hold the same parameters and optimizer
state and run the same strategy code (their gradients are averaged over the inner group once
per step, on the strategy's flat gradient buffer: ``strategies.gradient_step.accumulate``).

:class:`HierarchicalComm` is the ``Comm`` a strategy sees: ``rank = m``, ``world_size = M``.
Because a collective's input is the same on every rank of a worker, each rank only moves its
1/R slice across the outer link (R outer transfers in parallel, rank ``r`` exchanging slice
``r`` with rank ``r`` of every other worker), and an all-gather over the inner group then
reassembles the whole result on every rank. Handles stay asynchronous: the outer part is in
flight until ``wait()``, which then runs the inner all-gather.

Should inputs differ inside a worker (a per-rank measurement), element ``i`` of the result is
the reduction over workers of the value held by the rank owning slice ``i``; every rank of a
worker still receives the same result, so decisions taken from collective results agree.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lowcomm.comm.base import (
    Charge,
    CollectiveKind,
    Comm,
    CompletedHandle,
    Handle,
    ReduceOp,
    Role,
    Segments,
    Settled,
    check_scatter_shapes,
    check_segments,
)
from lowcomm.comm.clock import Clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.runtime import ClockReader, Runtime


def slice_length(numel: int, ranks: int) -> int:
    """Elements of each rank's slice of a ``numel``-element payload (padded; at least 1)."""
    return max(1, -(-numel // ranks))


def slice_segments(
    segments: Segments, begin: int, end: int, numel: int, pad_role: Role
) -> list[tuple[Role, int]]:
    """The fused ``segments`` that fall in ``[begin, end)`` of a payload of ``numel`` elements;
    padding beyond ``numel`` is charged to ``pad_role``."""
    sliced: list[tuple[Role, int]] = []
    offset = 0
    for role, count in segments:
        overlap = min(end, offset + count) - max(begin, offset)
        if overlap > 0:
            sliced.append((role, overlap))
        offset += count
    padding = end - max(begin, numel)
    if padding > 0:
        sliced.append((pad_role, min(padding, end - begin)))
    return sliced


def _gather_charge(output: torch.Tensor, role: Role) -> Charge:
    """What the inner all-gather into ``output`` costs (its full payload, as NetworkComm
    prices an all-gather)."""
    return Charge(CollectiveKind.ALL_GATHER, role, output.numel() * output.element_size())


class _TwoStageHandle:
    """The outer collective, then (at ``wait()``) the inner all-gather and a copy-out.

    ``settle()`` (a checkpoint with the collective in flight) finishes both stages' data
    movement without charging the clock: the outer transfer is settled, the all-gather runs on
    the un-emulated inner group. What the handle still owes is the outer completion and the
    all-gather's charge on the inner link, whose modeled start is the moment the outer one
    has completed *and* the worker waits: so ``wait()`` charges it then, exactly as the
    unsettled path would have (and ``HierarchicalComm.restore`` rebuilds the same after a
    resume)."""

    def __init__(
        self,
        owner: HierarchicalComm,
        outer: Handle,
        gather: Callable[[Comm], Handle],
        charge: Charge,
        finish: Callable[[], None],
    ) -> None:
        self._owner = owner
        self._outer = outer
        self._gather = gather
        self._charge = charge
        self._finish = finish
        self._settled: Settled | None = None
        self._finished = False

    def wait(self) -> None:
        if self._finished:
            return
        self._outer.wait()
        if self._settled is None:
            self._gather(self._owner.replica_comm).wait()
            self._finish()
        else:  # the data has moved: charge the all-gather only
            self._owner.charge_inner(self._charge).wait()
        self._finished = True

    def done(self) -> bool:
        # The slow part is the outer transfer; the inner all-gather runs inside wait().
        return self._finished or self._outer.done()

    def settle(self) -> Settled:
        if self._finished:
            return Settled()
        if self._settled is None:
            outer = self._outer.settle()
            with self._owner.blocked():  # time waiting on a transfer is never compute
                self._gather(self._owner.uncharged_inner).wait()
            self._finish()
            self._settled = Settled(outer.finish_time, (*outer.then, self._charge))
        return self._settled


class _RestoredTwoStage:
    """A two-level collective settled before a checkpoint, after the resume: its data is in
    place; ``wait()`` waits for the outer completion, then charges the inner stages."""

    def __init__(self, owner: HierarchicalComm, outer: Handle, settled: Settled) -> None:
        self._owner = owner
        self._outer = outer
        self._settled = settled
        self._finished = False

    def wait(self) -> None:
        if self._finished:
            return
        self._outer.wait()
        for charge in self._settled.then:
            self._owner.charge_inner(charge).wait()
        self._finished = True

    def done(self) -> bool:
        return self._finished or self._outer.done()

    def settle(self) -> Settled:
        return Settled() if self._finished else self._settled


class HierarchicalComm:
    """The ``Comm`` over workers made of R replica ranks each.

    Args:
        replica: the communicator over this worker's R ranks (fast link).
        outer: the communicator over the ranks of the same local index in the M workers
            (slow link).
        clock: the worker's clock shared by both levels (None without emulation).
    """

    def __init__(self, replica: Comm, outer: Comm, clock: Clock | None = None) -> None:
        self.replica_comm = replica
        self.outer_comm = outer
        self.clock = clock

    @property
    def rank(self) -> int:
        """This worker's index m."""
        return self.outer_comm.rank

    @property
    def world_size(self) -> int:
        """The number of workers M."""
        return self.outer_comm.world_size

    @property
    def ranks_per_worker(self) -> int:
        return self.replica_comm.world_size

    @property
    def slot(self) -> int:
        """This worker's slot in the run: its outer group's (which, with declared faults,
        follows the quorum while the slot stays), else its index m."""
        return int(getattr(self.outer_comm, "slot", self.rank))

    @property
    def local_rank(self) -> int:
        """This rank's index r inside its worker."""
        return self.replica_comm.rank

    def uncharged(self) -> HierarchicalComm:
        """The same collectives on the un-emulated communicators (for evaluation only)."""
        return HierarchicalComm(uncharged(self.replica_comm), uncharged(self.outer_comm))

    # --- helpers -----------------------------------------------------------------------------

    def _work_buffer(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        """A flat buffer of R slices holding ``tensor`` (the tensor itself when it fits)."""
        n = tensor.numel()
        c = slice_length(n, self.ranks_per_worker)
        if tensor.is_contiguous() and n == c * self.ranks_per_worker:
            return tensor.view(-1), c, False
        work = torch.zeros(c * self.ranks_per_worker, dtype=tensor.dtype, device=tensor.device)
        work[:n].copy_(tensor.reshape(-1))
        return work, c, True

    def _gather_into(
        self,
        work: torch.Tensor,
        piece: torch.Tensor,
        role: Role,
        tensor: torch.Tensor,
        copied: bool,
    ) -> tuple[Callable[[Comm], Handle], Charge, Callable[[], None]]:
        def gather(level: Comm) -> Handle:
            return level.all_gather(work, piece.clone(), role=role)

        def finish() -> None:
            if copied:
                tensor.copy_(work[: tensor.numel()].view_as(tensor))

        return gather, _gather_charge(work, role), finish

    def _two_stage(
        self,
        outer: Handle,
        gather: Callable[[Comm], Handle],
        charge: Charge,
        finish: Callable[[], None],
    ) -> Handle:
        return _TwoStageHandle(self, outer, gather, charge, finish)

    # --- Comm --------------------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        work, c, copied = self._work_buffer(tensor)
        r = self.local_rank
        piece = work[r * c : (r + 1) * c]
        outer_segments = (
            None
            if segments is None
            else slice_segments(segments, r * c, (r + 1) * c, tensor.numel(), role)
        )
        handle = self.outer_comm.all_reduce(piece, op=op, role=role, segments=outer_segments)
        return self._two_stage(handle, *self._gather_into(work, piece, role, tensor, copied))

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        if not 0 <= src < self.world_size:
            raise ValueError(
                f"broadcast: src {src} is not a worker of a group of {self.world_size}"
            )
        work, c, copied = self._work_buffer(tensor)
        r = self.local_rank
        piece = work[r * c : (r + 1) * c]
        handle = self.outer_comm.broadcast(piece, src=src, role=role)
        return self._two_stage(handle, *self._gather_into(work, piece, role, tensor, copied))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        m_count = self.world_size
        check_scatter_shapes(output, input, m_count, "reduce_scatter")
        n = output.numel()
        ranks, r = self.ranks_per_worker, self.local_rank
        c = slice_length(n, ranks)
        begin, end = min(r * c, n), min((r + 1) * c, n)
        send = torch.zeros(m_count, c, dtype=input.dtype, device=input.device)
        send[:, : end - begin] = input.reshape(m_count, n)[:, begin:end]
        received = torch.empty(c, dtype=input.dtype, device=input.device)
        handle = self.outer_comm.reduce_scatter(received, send.view(-1), op=op, role=role)
        full = torch.empty(ranks * c, dtype=input.dtype, device=input.device)

        def gather(level: Comm) -> Handle:
            return level.all_gather(full, received, role=role)

        def finish() -> None:
            output.copy_(full[:n].view_as(output))

        return self._two_stage(handle, gather, _gather_charge(full, role), finish)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        m_count = self.world_size
        check_scatter_shapes(output, input, m_count, "all_gather")
        n = input.numel()
        ranks, r = self.ranks_per_worker, self.local_rank
        c = slice_length(n, ranks)
        begin, end = min(r * c, n), min((r + 1) * c, n)
        send = torch.zeros(c, dtype=input.dtype, device=input.device)
        send[: end - begin] = input.reshape(-1)[begin:end]
        received = torch.empty(m_count * c, dtype=input.dtype, device=input.device)
        handle = self.outer_comm.all_gather(received, send, role=role)
        full = torch.empty(ranks * m_count * c, dtype=input.dtype, device=input.device)

        def gather(level: Comm) -> Handle:
            return level.all_gather(full, received, role=role)

        def finish() -> None:
            # full[r', m', :] is slice r' of worker m''s input.
            by_worker = full.view(ranks, m_count, c).permute(1, 0, 2).reshape(m_count, ranks * c)
            output.view(m_count, n).copy_(by_worker[:, :n])

        return self._two_stage(handle, gather, _gather_charge(full, role), finish)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Each rank moves slice ``r`` of every chunk over the outer link (the chunks are the
        same on every rank of a worker), then the inner all-gather reassembles the chunks
        this worker received."""
        m_count = self.world_size
        check_scatter_shapes(output, input, 1, "all_to_all")
        n = input.numel() // m_count
        ranks, r = self.ranks_per_worker, self.local_rank
        c = slice_length(n, ranks)
        begin, end = min(r * c, n), min((r + 1) * c, n)
        send = torch.zeros(m_count, c, dtype=input.dtype, device=input.device)
        send[:, : end - begin] = input.reshape(m_count, n)[:, begin:end]
        received = torch.empty(m_count * c, dtype=input.dtype, device=input.device)
        handle = self.outer_comm.all_to_all(received, send.view(-1), role=role)
        full = torch.empty(ranks * m_count * c, dtype=input.dtype, device=input.device)

        def gather(level: Comm) -> Handle:
            return level.all_gather(full, received, role=role)

        def finish() -> None:
            # full[r', i, :] is slice r' of what worker i sent this worker.
            by_worker = full.view(ranks, m_count, c).permute(1, 0, 2).reshape(m_count, ranks * c)
            output.view(m_count, n).copy_(by_worker[:, :n])

        return self._two_stage(handle, gather, _gather_charge(full, role), finish)

    def barrier(self) -> Handle:
        def gather(level: Comm) -> Handle:
            return level.barrier()

        return self._two_stage(
            self.outer_comm.barrier(),
            gather,
            Charge(CollectiveKind.BARRIER, None, 0),
            lambda: None,
        )

    # --- settling and restoring ----------------------------------------------------------------

    def blocked(self) -> AbstractContextManager[None]:
        """The clock's blocked-on-communication region (nothing without a clock)."""
        return self.clock.blocked() if self.clock is not None else nullcontext()

    @property
    def uncharged_inner(self) -> Comm:
        """The inner group without emulation (where a settled handle's all-gather runs)."""
        return uncharged(self.replica_comm)

    def charge_inner(self, charge: Charge) -> Handle:
        """Charge, on the inner link, an inner collective whose data has already moved."""
        if isinstance(self.replica_comm, NetworkComm):
            return self.replica_comm.charge(
                charge.kind, role=charge.role, payload_bytes=charge.payload_bytes
            )
        return CompletedHandle()

    def restore(self, settled: Settled) -> Handle:
        """The handle of a collective settled on this communicator before a checkpoint: the
        outer transfer completes at its settled time on the outer link's clock; the inner
        stages are charged when it is waited for, as the original handle's would have been."""
        outer: Handle = (
            self.outer_comm.restore(Settled(settled.finish_time))
            if isinstance(self.outer_comm, NetworkComm)
            else CompletedHandle()
        )
        if not settled.then:
            return outer
        return _RestoredTwoStage(self, outer, settled)

    def runtime(self) -> Runtime:
        """What a strategy on this communicator may use besides it: the run's clock
        (read-only), this worker's replica group when R > 1, the un-emulated levels, and
        ``message`` on this rank's outer link (a message of the worker travels as one slice
        per rank, as its collectives do: the strategy charges its rank's slice). No
        offloading: a communication thread's collectives would reach the inner group from two
        threads (the methods that need one refuse hierarchical workers)."""
        return Runtime(
            uncharged=self.uncharged(),
            clock=None if self.clock is None else ClockReader(self.clock),
            replica_group=replica_group(self),
            restorer=self.restore,
            message=getattr(self.outer_comm, "charge_message", None),
        )

    # --- accounting (when the levels are NetworkComms) ----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Both levels' counters and link schedules (for a checkpoint)."""
        return {
            name: level.state_dict()
            for name, level in (("inner", self.replica_comm), ("outer", self.outer_comm))
            if isinstance(level, NetworkComm)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, level in (("inner", self.replica_comm), ("outer", self.outer_comm)):
            if isinstance(level, NetworkComm):
                level.load_state_dict(state[name])

    def level_counters(self) -> dict[str, dict[str, float]]:
        """Per level (inner, outer): bytes this rank sent and exposed seconds, when emulated."""
        levels: dict[str, dict[str, float]] = {}
        for name, level in (("inner", self.replica_comm), ("outer", self.outer_comm)):
            levels[name] = {
                "bytes_sent": float(getattr(level, "bytes_sent", 0.0)),
                "exposed_comm_s": float(getattr(level, "exposed_comm_s", 0.0)),
                "modeled_comm_s": float(getattr(level, "modeled_comm_s", 0.0)),
            }
        return levels

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent on both levels (0 for a level that does not count)."""
        return sum(level["bytes_sent"] for level in self.level_counters().values())

    def counters(self) -> dict[str, float]:
        """Bytes this rank sent, by role, both levels together."""
        total: dict[str, float] = {role.value: 0.0 for role in Role}
        for level in (self.replica_comm, self.outer_comm):
            counters = getattr(level, "counters", None)
            if callable(counters):
                for role, value in counters().items():
                    total[role] = total.get(role, 0.0) + float(value)
        return total


def replica_group(comm: Comm) -> Comm | None:
    """The communicator over this worker's replica ranks when ``comm`` is hierarchical with
    R > 1 (for sharding optimizer states inside a worker), else None."""
    if isinstance(comm, HierarchicalComm) and comm.ranks_per_worker > 1:
        return comm.replica_comm
    return None


def uncharged(comm: Comm) -> Comm:
    """``comm`` without emulation: a NetworkComm's raw communicator, a HierarchicalComm over
    un-emulated levels, else ``comm`` itself. For evaluation-only collectives, which must
    neither occupy the modeled link nor count as training traffic."""

    if isinstance(comm, NetworkComm):
        return comm.raw
    if isinstance(comm, HierarchicalComm):
        return comm.uncharged()
    return comm
