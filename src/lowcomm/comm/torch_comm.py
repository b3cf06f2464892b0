"""``Comm`` over ``torch.distributed`` (Gloo on CPU, NCCL on GPU).

This module and ``lowcomm.launch`` are the only places that import ``torch.distributed``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm.base import (
    CollectiveTimeout,
    CompletedHandle,
    Handle,
    ReduceOp,
    Role,
    Segments,
    Settled,
    check_device,
    check_scatter_shapes,
    check_segments,
    collective_arithmetic,
)
from lowcomm.comm.cuda_arrival import EventArrival, blocking_wait

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old
# names (which newer ones keep as deprecated aliases).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# How a backend words a timed-out collective: Gloo "Timed out waiting ...", NCCL "... ran for
# N milliseconds before timing out" (watchdog) or "... timed out in blocking wait".
_TIMEOUT_WORDS = ("timed out", "timing out", "timeout")


def is_timeout_error(error: BaseException) -> bool:
    """Whether a ``torch.distributed`` error reports a timed-out collective (Gloo or NCCL)."""
    text = str(error).lower()
    return any(word in text for word in _TIMEOUT_WORDS)


class _WorkHandle:
    """Wraps a ``torch.distributed`` work object; runs a finishing step once after it.

    ``wait()`` gives up after ``timeout_s`` with a :class:`CollectiveTimeout` naming the rank,
    the collective and the time waited (None: waits without a deadline; on NCCL a wait with a
    deadline polls the work on the host, so there the process group's watchdog, set beyond
    the collective timeout, ends a hung collective instead).

    ``keep``: the collective's input and output tensors, referenced until ``wait()`` (the
    method's wait; nothing else waits on the work): a send buffer or cast copy that only the
    collective uses would otherwise return to the caching allocator while NCCL still reads
    or writes it (see :mod:`lowcomm.comm.cuda_arrival`)."""

    def __init__(
        self,
        work: Any,
        finish: Callable[[], None] | None = None,
        *,
        what: str = "collective",
        rank: int = 0,
        timeout_s: float | None = None,
        stamp: bool = False,
        arrival: EventArrival | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._work = work
        self._keep = keep
        self._finish = finish
        self._finished = False
        self._what = what
        self._rank = rank
        self._timeout_s = timeout_s
        self._completed_at: float | None = None
        self._arrival = arrival  # an NCCL collective's (see lowcomm.comm.cuda_arrival)
        if stamp and work is not None:
            # Gloo's future completes on its thread when the data has arrived (also on an
            # error): the stamp is the arrival.
            try:
                future = work.get_future()
            except RuntimeError:  # "Work::getFuture not implemented" (Gloo's reduce-scatter)
                future = None
            if future is not None:
                future.add_done_callback(self._stamp)

    def _stamp(self, _future: Any) -> None:
        self._completed_at = time.perf_counter()

    def completed_at(self) -> float | None:
        """When the collective's data arrived (``time.perf_counter``; None: not stamped, the
        work has no completion future, or a Gloo collective not yet in). An NCCL collective's
        arrival is waited for: ask after ``wait()``."""
        if self._arrival is not None:
            return self._arrival.completed_at()
        return self._completed_at

    def wait(self) -> None:
        if self._finished:
            return
        if self._work is not None:
            begin = time.monotonic()
            try:
                if self._timeout_s is None:
                    self._work.wait()
                else:
                    self._work.wait(timeout=timedelta(seconds=self._timeout_s))
            except RuntimeError as error:
                waited = time.monotonic() - begin
                if not is_timeout_error(error):
                    raise
                raise CollectiveTimeout(
                    f"rank {self._rank}: {self._what} did not complete within "
                    f"{waited:.1f} s (--collective-timeout-s {self._timeout_s}); a peer died, "
                    f"hung or is far slower (raise the timeout for a slow link)"
                ) from None
        if self._finish is not None:
            with collective_arithmetic():  # (the collective's, not the worker's compute)
                self._finish()
        self._finished = True
        self._keep = ()  # the caller's wait ordered its stream after the collective

    def done(self) -> bool:
        return self._finished or self._work is None or bool(self._work.is_completed())

    def settle(self) -> Settled:
        self.wait()
        return Settled()


def _torch_op(op: ReduceOp) -> Any:
    # Gloo has no AVG: "mean" is a sum followed by a division after wait().
    return {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]


class TorchComm:
    """Collectives on one ``torch.distributed`` process group.

    Args:
        group: the process group (``None`` = the default group). Bind a communicator to a
            group rather than to the world so a strategy can be handed an inner and an outer one.
        device: the device of the group's tensors; a collective refuses a tensor on another
            (None: ``cuda`` on NCCL, which moves GPU tensors only; unchecked on Gloo).
    """

    def __init__(
        self, group: Any = None, *, timeout_s: float | None = None,
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchComm needs an initialised process group: call "
                "torch.distributed.init_process_group first, or use lowcomm.launch"
            )
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._timeout_s = timeout_s
        # Arrival stamps (``_WorkHandle.completed_at``): Gloo's completion future fires when
        # the data is in; NCCL's fires when the collective is queued, so there a CUDA event
        # on a side stream times it (unless NCCL waits block the host).
        backend = dist.get_backend(group)
        self._device = device or (torch.device("cuda") if backend == "nccl" else None)
        self._stamp = backend == "gloo"
        self._scatter_by_exchange = backend == "gloo"
        self._event_arrival = backend == "nccl" and not blocking_wait()
        # No deadline on an NCCL wait (a deadline makes the host poll the work); the process
        # group's watchdog ends a hung collective after process_group_timeout(timeout_s).
        self._wait_timeout_s = None if backend == "nccl" else timeout_s

    def _handle(
        self,
        work: Any,
        what: str,
        tensor: torch.Tensor | None,
        finish: Callable[[], None] | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> _WorkHandle:
        """``tensor``: the payload (named in errors, and its device times the arrival);
        ``keep``: every tensor the collective reads or writes, held until the wait."""
        size = "" if tensor is None else f" of {tensor.numel() * tensor.element_size()} bytes"
        arrival = None
        if self._event_arrival and work is not None and tensor is not None and tensor.is_cuda:
            arrival = EventArrival(work, tensor.device)
        return _WorkHandle(
            work, finish, what=f"{what}{size}", rank=self._rank, timeout_s=self._wait_timeout_s,
            stamp=self._stamp, arrival=arrival, keep=keep,
        )  # fmt: skip

    def _check(self, what: str, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            check_device(tensor.device, self._device, what)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _mean_after(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], None] | None:
        if op != "mean":
            return None
        world_size = self._world_size

        def divide() -> None:
            tensor.div_(world_size)

        return divide

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        self._check(what := f"all_reduce ({role.value})", tensor)
        work = dist.all_reduce(tensor, op=_torch_op(op), group=self._group, async_op=True)
        return self._handle(work, what, tensor, self._mean_after(tensor, op), (tensor,))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        check_scatter_shapes(output, input, self._world_size, "reduce_scatter")
        what = f"reduce_scatter ({role.value})"
        self._check(what, output, input)
        if self._scatter_by_exchange and op != "max" and self._world_size > 1:
            return self._reduce_scatter_by_exchange(output, input, op, what)
        work = _reduce_scatter(output, input, op=_torch_op(op), group=self._group, async_op=True)
        return self._handle(work, what, input, self._mean_after(output, op), (output, input))

    def _reduce_scatter_by_exchange(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, what: str
    ) -> Handle:
        """A sum (or mean) reduce-scatter on Gloo as an exchange and a local sum.

        Gloo's own reduce-scatter moves an all-reduce's bytes, twice the ring's: on 2 ranks a
        16.8 MB ``reduce_scatter_tensor`` put 33.6 MB through loopback, as ``all_reduce``
        did. ``all_to_all_single`` hands every rank the chunk of every other rank's input it
        owns, (n-1)/n of the payload as in the ring (16.8 MB there, in 10.8-14.4 ms against
        19.0-22.3 ms), and the rank sums the n chunks when the exchange is waited for. The
        result is the same (bit for bit on 2 ranks; on more, the sum's order may round
        differently), with the same transient buffer of the input's size that Gloo's own
        reduce-scatter allocates."""
        world_size = self._world_size
        with collective_arithmetic():
            received = torch.empty_like(input).reshape(-1)
            send = input.contiguous().reshape(-1)
        work = dist.all_to_all_single(received, send, group=self._group, async_op=True)

        def reduce() -> None:
            summed = received.view(world_size, -1).sum(dim=0)
            if op == "mean":
                summed.div_(world_size)
            output.copy_(summed.view_as(output))

        return self._handle(work, what, input, reduce, (received, send))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, self._world_size, "all_gather")
        self._check(f"all_gather ({role.value})", output, input)
        work = _all_gather(output, input, group=self._group, async_op=True)
        return self._handle(work, f"all_gather ({role.value})", output, keep=(output, input))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, 1, "all_to_all")
        self._check(f"all_to_all ({role.value})", output, input)
        work = dist.all_to_all_single(output, input, group=self._group, async_op=True)
        return self._handle(work, f"all_to_all ({role.value})", input, keep=(output, input))

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        self._check(f"broadcast ({role.value})", tensor)
        global_src = dist.get_global_rank(self._group, src) if self._group is not None else src
        work = dist.broadcast(tensor, src=global_src, group=self._group, async_op=True)
        return self._handle(work, f"broadcast ({role.value}) from {src}", tensor, keep=(tensor,))

    def barrier(self) -> Handle:
        # On NCCL the barrier runs on the device bound at init (``device_id``), not a guess.
        work = dist.barrier(group=self._group, async_op=True)
        return self._handle(work, "barrier", None)

    def cpu_side_group(self) -> TorchComm:
        """A communicator over a new Gloo group of the same ranks, for host-side bookkeeping
        (metrics, evaluation sums, checkpoint barriers) that must not queue behind this group's
        collectives (on NCCL one communicator is one stream).

        Every rank of the world must call it at the same point (``new_group`` is collective)."""
        ranks = None if self._group is None else dist.get_process_group_ranks(self._group)
        timeout = None if self._timeout_s is None else process_group_timeout(self._timeout_s)
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        return TorchComm(group, timeout_s=self._timeout_s)


def process_group_timeout(collective_timeout_s: float) -> timedelta:
    """The process group's own timeout for a run whose waits give up after
    ``collective_timeout_s``: longer, so that the wait's :class:`CollectiveTimeout` (with its
    rank, collective and fix) fires before NCCL's watchdog tears the process down."""
    return timedelta(seconds=collective_timeout_s + max(60.0, 0.25 * collective_timeout_s))


class QuorumTorchComm(TorchComm):
    """A :class:`TorchComm` over the world whose collectives run over the current round's
    quorum (declared faults with one process per worker): the in-process group's
    :meth:`~lowcomm.comm.inprocess.InProcessComm.enter`, on ``torch.distributed``.

    A quorum's members are world ranks (a worker's slot is its process's rank). Each distinct
    set of members has its own process group, made by :meth:`prepare` the first time the set
    appears and kept for when it recurs; the whole world is the default group. ``new_group``
    is called by every process, member or not, in the same order (the fault engine prepares
    each step's set as it resolves the step, which every worker does, in step order): a
    group made by its members alone (``use_local_synchronization``) hangs on Gloo once the
    processes have made different numbers of groups. A group never depends on a rank outside
    it: its collectives go on whatever happens to the others (a peer killed included).
    ``rank`` and ``world_size`` are the member's index in the current set and the set's
    size, so a mean divides by the quorum's size.

    Each group holds a connection to each of its members and threads of its own, and a long
    trace on many workers meets many sets (a generated trace on 16 workers, about 160 in 8
    mean times between failures): the ``keep_groups`` sets prepared most recently keep their
    groups, and an older one's is destroyed, by every process at the same :meth:`prepare`
    (the order is the same everywhere), and made again if its set comes back. The current
    quorum's set is prepared at every step, so it is never the oldest.

    A slot may have several processes in turn (a crash kills its process; a process started
    at launch takes the slot over at its join, :mod:`lowcomm.faults.processes`): ``layout``
    gives each world rank's slot, in slot order, and :meth:`hold` which process holds each
    slot from then on; :meth:`enter` takes a quorum's slots to the group of their holders.

    Args:
        timeout_s: as :class:`TorchComm`'s; the subgroups' own timeout follows it.
        keep_groups: how many sets besides the whole world keep their groups.
        layout: the slot of each process (None: one process per slot, rank = slot).
    """

    def __init__(
        self, *, timeout_s: float | None = None, keep_groups: int = 16,
        layout: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(None, timeout_s=timeout_s)
        if keep_groups < 1:
            raise ValueError(f"keep_groups: {keep_groups} must be 1 or more")
        self._everyone = tuple(range(self._world_size))
        self._layout = self._everyone if layout is None else layout
        if len(self._layout) != self._world_size or list(self._layout) != sorted(self._layout):
            raise ValueError(
                f"layout: {self._layout} must give the slot of each of the {self._world_size} "
                "processes, in slot order"
            )
        self._slot = self._layout[self._rank]
        #: Each slot's process (a world rank): the first of the slot's, until hold().
        self._holders: tuple[int | None, ...] = tuple(
            self._layout.index(slot) for slot in range(self._layout[-1] + 1)
        )
        self._members = tuple(range(len(self._holders)))
        self._rank, self._world_size = self._slot, len(self._holders)
        self._keep_groups = keep_groups
        #: The subgroups, least recently prepared first (the whole world is the default group).
        self._groups: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    @property
    def slot(self) -> int:
        """This worker's slot (its world rank), whatever the quorum."""
        return self._slot

    @property
    def members(self) -> tuple[int, ...]:
        """The current quorum's members."""
        return self._members

    @property
    def layout(self) -> tuple[int, ...]:
        """The slot of each process of the world, in rank order."""
        return self._layout

    def hold(self, holders: tuple[int | None, ...]) -> None:
        """Each slot's process from now on (None: a slot whose process was killed)."""
        self._holders = holders

    def ranks_of(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """The world ranks of the processes that hold ``members`` (slots)."""
        ranks = []
        for slot in members:
            rank = self._holders[slot]
            if rank is None:
                raise RuntimeError(f"worker {slot} has no process")
            ranks.append(rank)
        return tuple(sorted(ranks))

    @property
    def kept_sets(self) -> tuple[tuple[int, ...], ...]:
        """The sets whose groups are kept, least recently prepared first (the whole world,
        the default group, is not among them)."""
        return tuple(self._groups)

    def prepare(self, members: tuple[int, ...]) -> None:
        """Make the process group of ``members`` (world ranks) unless it exists. Collective:
        every live process of the world calls it, in the same order."""
        members = tuple(sorted(members))
        if members == self._everyone:
            return
        if members in self._groups:
            self._groups.move_to_end(members)
            return
        timeout = None if self._timeout_s is None else process_group_timeout(self._timeout_s)
        self._groups[members] = dist.new_group(list(members), timeout=timeout)
        while len(self._groups) > self._keep_groups:
            _, group = self._groups.popitem(last=False)
            dist.destroy_process_group(group)  # (a non-member's handle: nothing to destroy)

    def enter(self, quorum_id: int, members: tuple[int, ...]) -> None:
        """Take part in quorum ``quorum_id`` of ``members`` from the next collective on (the
        id is the engine's; the set alone picks the group, made by :meth:`prepare`)."""
        members = tuple(sorted(members))
        if self._slot not in members or self._holders[self._slot] != dist.get_rank():
            raise ValueError(f"worker {self._slot} is not in quorum {quorum_id} {members}")
        ranks = self.ranks_of(members)
        if ranks != self._everyone and ranks not in self._groups:
            raise RuntimeError(
                f"worker {self._slot}: quorum {quorum_id} {members} has no process group; "
                "every process must prepare() each set before its members enter it"
            )
        self._group = None if ranks == self._everyone else self._groups[ranks]
        self._members = members
        self._rank = members.index(self._slot)  # (ranks follow slots: the same index)
        self._world_size = len(members)

    def live_bookkeeping(self) -> LiveBookkeeping:
        """The bookkeeping group: a Gloo group of the live processes (every worker, member or
        not, takes its turn in the run's bookkeeping until its process is killed)."""
        return LiveBookkeeping(timeout_s=self._timeout_s, layout=self._layout)


class LiveBookkeeping:
    """The run's bookkeeping (metrics, evaluation sums, checkpoint digests and barriers, the
    summary's totals) over the worker processes still alive, addressed by slot.

    A Gloo group that holds a killed process fails its next collective, so each time
    processes are killed (a declared crash, :mod:`lowcomm.faults.processes`) every live
    process makes the group of those left, at the same point (:meth:`leave_out`). ``rank``
    and ``world_size`` stay the slot and the number of slots: a gather gives one row per slot,
    a killed slot's row zeros (its rows were written before it died, and its totals are
    handed on in the launch folder), and a sum or a max over the live processes is the same
    as over every slot where a killed slot would give nothing (zeros, ``-inf``), as a worker
    outside its quorum does. A mean would not be, and is refused.
    """

    def __init__(
        self, *, timeout_s: float | None = None, layout: tuple[int, ...] | None = None
    ) -> None:
        self._timeout_s = timeout_s
        self._process = dist.get_rank()
        everyone = tuple(range(dist.get_world_size()))
        self._layout = everyone if layout is None else layout
        self._slot = self._layout[self._process]
        self._slots = self._layout[-1] + 1
        #: The live processes (world ranks).
        self._live = everyone
        #: Each slot's process (None: killed), whose row a gather gives for the slot.
        self._holders: tuple[int | None, ...] = tuple(
            self._layout.index(slot) for slot in range(self._slots)
        )
        self._comm = TorchComm(self._new_group(None), timeout_s=timeout_s)

    def _new_group(self, ranks: list[int] | None) -> Any:
        timeout = None if self._timeout_s is None else process_group_timeout(self._timeout_s)
        return dist.new_group(ranks, backend="gloo", timeout=timeout)

    @property
    def rank(self) -> int:
        return self._slot

    @property
    def world_size(self) -> int:
        return self._slots

    @property
    def live(self) -> tuple[int, ...]:
        """The live processes (world ranks), in order."""
        return self._live

    @property
    def first(self) -> bool:
        """Whether this is the lowest live process that holds a slot."""
        held = [rank for rank in self._holders if rank is not None and rank in self._live]
        return min(held) == self._process

    def hold(self, holders: tuple[int | None, ...]) -> None:
        """Each slot's process from now on (None: none, its process was killed)."""
        self._holders = holders

    def leave_out(self, gone: tuple[int, ...]) -> None:
        """The processes of ``gone`` (world ranks) are killed: go on over the others' own
        group. Collective over the live processes that remain (each makes the group at the
        same point)."""
        live = tuple(rank for rank in self._live if rank not in gone)
        if live == self._live:
            return
        if self._process not in live:
            raise ValueError(f"process {self._process} is among the killed {gone}")
        self._live = live
        self._comm = TorchComm(self._new_group(list(live)), timeout_s=self._timeout_s)

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp = "mean", role: Role,
        segments: Segments | None = None,
    ) -> Handle:  # fmt: skip
        if op == "mean":
            raise ValueError("bookkeeping over the live processes sums or takes a max, no mean")
        return self._comm.all_reduce(tensor, op=op, role=role, segments=segments)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        raise NotImplementedError("the bookkeeping group does not reduce-scatter")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Every slot's ``input`` in slot order, from the process that holds it; a slot whose
        process was killed gives zeros (a process standing by for a slot gives nothing)."""
        count = input.numel()
        live = torch.zeros(len(self._live) * count, dtype=input.dtype)
        self._comm.all_gather(live, input, role=role).wait()
        output.zero_()
        for slot, rank in enumerate(self._holders):
            if rank is not None and rank in self._live:
                index = self._live.index(rank)
                output[slot * count : (slot + 1) * count] = live[
                    index * count : (index + 1) * count
                ]
        return CompletedHandle()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        raise NotImplementedError("the bookkeeping group does not exchange all-to-all")

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        holder = self._holders[src]
        if holder is None or holder not in self._live:
            raise ValueError(f"broadcast from worker {src}, whose process was killed")
        return self._comm.broadcast(tensor, src=self._live.index(holder), role=role)

    def barrier(self) -> Handle:
        return self._comm.barrier()
