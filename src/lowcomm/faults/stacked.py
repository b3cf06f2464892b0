"""Declared faults with several workers in each of several processes (``1 <
--workers-per-process K < --workers``).

**A crash stops a worker, not its process.** The K workers of a process are threads of it
(:mod:`lowcomm.launch.stacked`), and a declared crash ends the worker's part in the run at
its event, as in one process (:mod:`lowcomm.faults.engine`): its thread issues no strategy
collective from then on and only takes its turn in the run's bookkeeping, whose rows leave it
out, while the other workers of its process go on. No process is killed: a SIGKILL would take
the process's other, live, workers with it. Under torchrun the crashed worker's thread also
zeroes its state at the crash, as a process of one worker does there
(:mod:`lowcomm.faults.processes`). A join is the slot's thread taking part again, healed from
a live member over the link.

**The strategy's group follows the quorum across processes**
(:class:`QuorumStackedGroup`). A round's collectives run over its members: those of each
process meet in the process (as :class:`~lowcomm.comm.stacked.StackedGroup`'s do), and the
processes that hold at least one member exchange on a ``torch.distributed`` group of just
those processes, so a process none of whose workers is in the quorum takes no part and its
peers never wait for it. A member's ``rank`` and ``world_size`` are its index in the quorum and
the quorum's size (a mean divides by it). The members of a process may differ in number from
process to process: a gather or an all-to-all pads each process's part to the largest and
drops the padding, and a reduce-scatter reduces the whole buffer and keeps each member's
chunk. The emulation prices each collective from its payload, rank and size, never from what
moves here, so a run gives the numbers of the same run with every worker in one process (up
to the order of a sum's terms: float rounding).

A worker of several ranks (``--ranks-per-worker R``) takes part in its quorum on each rank's
outer group (R of them, one per local rank, each a :class:`QuorumStackedGroup` whose members
are the workers): a crash takes its R ranks, and a join heals each of them from the same rank
of a live member. The R groups make their process groups together, in one order
(:class:`ProcessSets`).

Each set of processes gets its process group the first time a quorum needs it, made by every
process at the same point: the first of its workers to resolve a step (every worker resolves
every step, in order, :class:`StackedFaults`) prepares the step's set, and the others of the
process find it made. A run meets at most ``2^P - 1`` sets of its P processes; each is kept
(unlike one process per worker's groups, :class:`~lowcomm.comm.torch_comm.QuorumTorchComm`,
none is destroyed: a run of many processes that meets many sets holds a group for each).

Every process's courier issues a quorum's exchanges in one order: within a quorum in sequence
order (every member posts in program order, as with ``StackedGroup``), and a new quorum's
after the old one's, because where the quorum changes the process's worker threads meet
before any of them plans the step (:meth:`ProcessSets.meet`), by when each has posted its
collectives of the steps before.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm.base import (
    CollectiveTimeout,
    Comm,
    Handle,
    ReduceOp,
    Role,
    Segments,
    check_scatter_shapes,
    check_segments,
)
from lowcomm.comm.gathered import mark_gathered
from lowcomm.comm.inprocess import GroupAborted, SignalingEvent, SlotHandle
from lowcomm.comm.overlap import ChainScheduler
from lowcomm.comm.torch_comm import TorchComm, process_group_timeout
from lowcomm.comm.turns import blocking, holding, wait_for
from lowcomm.faults.engine import StepPlan, WorkerFaults

__all__ = ["ProcessSets", "QuorumStackedComm", "QuorumStackedGroup", "StackedFaults"]


@dataclass(frozen=True)
class _Layout:
    """Where a quorum's members live: the processes holding any (in order), how many each
    holds, and the quorum's size."""

    processes: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(self.counts)

    def offset(self, index: int) -> int:
        """The quorum rank of the first member of the ``index``-th process."""
        return sum(self.counts[:index])


#: What a slot does once this process's members posted: combine their tensors, run the
#: exchange of the quorum's processes on ``inter`` (their group), write each member's result.
Plan = Callable[[list["_Post"], Comm, _Layout, int], None]


@dataclass
class _Post:
    signature: tuple[object, ...]
    tensors: tuple[torch.Tensor, ...]


@dataclass
class _Slot:
    """The n-th collective of a quorum, for this process's members of it."""

    key: tuple[int, int]
    what: str
    plan: Plan
    members: tuple[int, ...]
    posts: list[_Post | None]
    remaining: int
    event: SignalingEvent = field(default_factory=SignalingEvent)
    complete: bool = False
    error: BaseException | None = None
    completed_at: float | None = None


class ProcessSets:
    """What the quorum groups of one process share: where they make their process groups,
    and the meeting of the process's worker threads where the quorum changes.

    The process groups are made for each step, in step order, once per process (the first
    of its workers to resolve the step makes them, the others find them made), one group per
    registered quorum group in the order they registered, so that every process calls
    ``new_group`` in the same order.

    Args:
        threads: the worker threads of this process (K, or K R with workers of R ranks),
            each of which meets the others at every step where the quorum changes
            (:meth:`meet`).
        timeout_s: how long a meeting waits (None: no limit).
    """

    def __init__(self, threads: int = 1, *, timeout_s: float | None = None) -> None:
        self._lock = threading.Lock()
        self._prepared = 0
        self._groups: list[QuorumStackedGroup] = []
        self._threads = threads
        self._timeout_s = timeout_s
        self._arrived = 0
        self._met = threading.Event()
        self._abort_reason: str | None = None

    def register(self, group: QuorumStackedGroup) -> None:
        self._groups.append(group)

    def prepare(self, step: int, processes: tuple[int, ...]) -> None:
        """Make the process groups of the set ``processes`` (the processes holding ``step``'s
        quorum) unless made. Collective over the P processes: each calls it for every step
        in order."""
        with holding(self._lock):
            if step < self._prepared:
                return
            if step != self._prepared:
                raise RuntimeError(f"quorum groups: step {step} prepared before {self._prepared}")
            self._prepared += 1
            for group in self._groups:
                if not group.has_set(processes):
                    with blocking():  # (the other processes' workers may need this turn)
                        group.add_set(processes)

    def meet(self, step: int) -> None:
        """Wait until every worker thread of this process has begun ``step``, where the
        quorum changes: then each has posted every collective of the quorums before, and a
        process's courier receives no collective of the new quorum before the old one's last
        (every process issues them in the same order: a worker that crashed at the step may
        still be posting its last exchange of the step before, which its peers wait for)."""
        with self._lock:
            if self._abort_reason is not None:
                raise GroupAborted(f"quorum groups aborted: {self._abort_reason}")
            met = self._met
            self._arrived += 1
            if self._arrived == self._threads:
                self._arrived = 0
                self._met = threading.Event()
                met.set()
                return
        if not wait_for(met, self._timeout_s):
            raise CollectiveTimeout(
                f"step {step}: the workers of this process did not all begin the step within "
                f"{self._timeout_s} s (--collective-timeout-s {self._timeout_s}); a worker "
                "stopped, hung or is far slower"
            )
        if self._abort_reason is not None:
            raise GroupAborted(f"quorum groups aborted: {self._abort_reason}")

    def abort(self, reason: str) -> None:
        """End every meeting: a waiting and a later one raise :class:`GroupAborted`."""
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = reason
            met = self._met
        met.set()


class QuorumStackedGroup:
    """This process's K members of the strategy's group of M = P x K workers, whose
    collectives run over each round's quorum (see the module docstring).

    Args:
        local_size: K, the workers of this process (global ranks ``p K .. p K + K - 1``).
        inter: a communicator over the P processes on the world's default group (rank p is
            process p); the courier uses it for a quorum with members in every process.
        timeout_s: how long a member's wait may block (None: no limit).
        name: what errors call the group.
        sets: where the process groups of this process's quorum groups are made, shared by
            the groups (one per rank of a worker) that must make theirs in one order.
    """

    def __init__(
        self, local_size: int, inter: TorchComm, *, timeout_s: float | None = None,
        name: str = "strategy", sets: ProcessSets | None = None,
    ) -> None:  # fmt: skip
        self.local_size = local_size
        self.inter = inter
        self.processes = inter.world_size
        self.process = inter.rank
        self.size = local_size * self.processes
        self.first_rank = self.process * local_size
        self.name = name
        self.timeout_s = timeout_s
        everyone = tuple(range(self.size))
        self._lock = threading.Lock()
        self._rounds: list[tuple[int, tuple[int, ...]]] = [(0, everyone)] * local_size
        self._issued = [0] * local_size
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._abort_reason: str | None = None
        self._groups: dict[tuple[int, ...], Comm] = {tuple(range(self.processes)): inter}
        self.sets = ProcessSets() if sets is None else sets
        self.sets.register(self)
        self._queue: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        self._members = [QuorumStackedComm(self, k) for k in range(local_size)]
        self.chains = ChainScheduler(f"lowcomm-chains-{name}", timeout_s=timeout_s)
        self._courier = threading.Thread(
            target=self._deliver, name=f"lowcomm-{name}-courier", daemon=True
        )
        self._courier.start()

    def comm(self, member: int) -> QuorumStackedComm:
        return self._members[member]

    def layout(self, members: tuple[int, ...]) -> _Layout:
        """Where ``members`` (global ranks) live."""
        counts: dict[int, int] = {}
        for member in members:
            process = member // self.local_size
            counts[process] = counts.get(process, 0) + 1
        processes = tuple(sorted(counts))
        return _Layout(processes, tuple(counts[p] for p in processes))

    def prepare(self, step: int, members: tuple[int, ...]) -> None:
        """Make the process groups of ``step``'s quorum of ``members`` (see
        :meth:`ProcessSets.prepare`)."""
        self.sets.prepare(step, self.layout(members).processes)

    def has_set(self, processes: tuple[int, ...]) -> bool:
        return processes in self._groups

    def add_set(self, processes: tuple[int, ...]) -> None:
        """Make the process group of ``processes`` (collective over every process)."""
        timeout = None if self.timeout_s is None else process_group_timeout(self.timeout_s)
        group = dist.new_group(list(processes), timeout=timeout)
        if self.process in processes:
            self._groups[processes] = TorchComm(group, timeout_s=self.timeout_s)
        else:  # (a non-member's handle: kept only so that the set is not made twice)
            self._groups[processes] = self.inter

    def enter(self, member: int, quorum_id: int, members: tuple[int, ...]) -> None:
        """Local member ``member`` takes part in quorum ``quorum_id`` of ``members`` (global
        ranks) from its next collective on (a new id restarts its count)."""
        rank = self.first_rank + member
        if rank not in members:
            raise ValueError(f"{self.name} group: worker {rank} is not in quorum {members}")
        if self.layout(members).processes not in self._groups:
            raise RuntimeError(
                f"{self.name} group: quorum {quorum_id} {members} has no process group; every "
                "process must prepare() each step's set before its members enter it"
            )
        with self._lock:
            if self._rounds[member][0] != quorum_id:
                self._rounds[member] = (quorum_id, tuple(sorted(members)))
                self._issued[member] = 0

    def round_of(self, member: int) -> tuple[int, ...]:
        return self._rounds[member][1]

    @property
    def aborted(self) -> str | None:
        return self._abort_reason

    def abort(self, reason: str) -> None:
        """End the group in this process: every pending and later collective raises."""
        with self._lock:
            if self._abort_reason is not None:
                return
            self._abort_reason = reason
            pending = list(self._slots.values())
            self._slots.clear()
        for slot in pending:
            slot.event.set()
        self._queue.put(None)
        self.sets.abort(reason)

    def close(self) -> None:
        self._queue.put(None)

    def _aborted_error(self) -> GroupAborted:
        return GroupAborted(f"{self.name} group aborted: {self._abort_reason}")

    def post(self, member: int, what: str, post: _Post, plan: Plan) -> _Slot:
        """Hand in ``member``'s part of its next collective; queue the slot if it is the
        last of this process's members of the quorum."""
        with self._lock:
            if self._abort_reason is not None:
                raise self._aborted_error()
            quorum_id, members = self._rounds[member]
            key = (quorum_id, self._issued[member])
            self._issued[member] += 1
            local = [m - self.first_rank for m in members if m // self.local_size == self.process]
            slot = self._slots.get(key)
            if slot is None:
                slot = _Slot(key, what, plan, members, [None] * len(local), len(local))
                self._slots[key] = slot
            if slot.members != members:
                error = RuntimeError(
                    f"{self.name} group: collective #{key[1]} of quorum {quorum_id} has members "
                    f"{slot.members} on one worker but {members} on worker "
                    f"{self.first_rank + member}; every member must agree on the round's quorum"
                )
                slot.error = error
                self._slots.pop(key, None)
                self._queue.put(None)
                self._abort_reason = f"RuntimeError: {error}"
                slot.event.set()
                raise error
            slot.posts[local.index(member)] = post
            slot.remaining -= 1
            if slot.remaining == 0:
                del self._slots[key]
                self._queue.put(slot)
        return slot

    def _deliver(self) -> None:
        while True:
            slot = self._queue.get()
            if slot is None or self._abort_reason is not None:
                return
            try:
                posts = [post for post in slot.posts if post is not None]
                first = posts[0].signature
                for post in posts:
                    if post.signature != first:
                        raise RuntimeError(
                            f"{self.name} group: collective #{slot.key[1]} is {first} on one "
                            f"worker but {post.signature} on another; every worker must issue "
                            "the same collectives, of the same sizes, in the same order"
                        )
                layout = self.layout(slot.members)
                inter = self._groups[layout.processes]
                with torch.no_grad():
                    slot.plan(posts, inter, layout, layout.processes.index(self.process))
                slot.completed_at = time.perf_counter()
                slot.complete = True
            except BaseException as error:
                slot.error = error
                self.abort(f"{type(error).__name__}: {error}")
            finally:
                slot.posts = []
                slot.event.set()

    def wait(self, slot: _Slot, rank: int) -> None:
        if not wait_for(slot.event, self.timeout_s):
            raise CollectiveTimeout(
                f"rank {rank}: {slot.what} did not complete within {self.timeout_s} s "
                f"(--collective-timeout-s {self.timeout_s}); a worker stopped issuing "
                "collectives, hung or is far slower"
            )
        if slot.complete:
            return
        if slot.error is not None:
            raise GroupAborted(f"{self.name} group: {slot.what} failed: {slot.error}") from None
        raise self._aborted_error()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def _gather_parts(parts: list[torch.Tensor], inter: Comm, layout: _Layout) -> torch.Tensor:
    """Every member's flat ``part`` (equal sizes), in quorum order: this process's
    ``parts`` with every other process's, each padded to the largest count and unpadded."""
    ours = torch.cat(parts)
    if len(layout.processes) == 1:
        return ours
    width = parts[0].numel()
    widest = max(layout.counts)
    padded = torch.zeros(widest * width, dtype=ours.dtype)
    padded[: ours.numel()] = ours
    gathered = torch.empty(widest * width * len(layout.processes), dtype=ours.dtype)
    inter.all_gather(gathered, padded, role=Role.OTHER).wait()
    rows = gathered.view(len(layout.processes), widest * width)
    return torch.cat([rows[i, : count * width] for i, count in enumerate(layout.counts)])


def _all_reduce(op: ReduceOp, role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, layout: _Layout, index: int) -> None:
        tensors = [post.tensors[0] for post in posts]
        result = tensors[0].clone()
        for tensor in tensors[1:]:
            if op == "max":
                torch.maximum(result, tensor, out=result)
            else:
                result.add_(tensor)
        if len(layout.processes) > 1:
            inter.all_reduce(result, op="max" if op == "max" else "sum", role=role).wait()
        if op == "mean":
            result.div_(layout.size)
        for tensor in tensors:
            tensor.copy_(result)

    return plan


def _reduce_scatter(op: ReduceOp, role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, layout: _Layout, index: int) -> None:
        inputs = torch.stack([_flat(post.tensors[1]) for post in posts])
        combined = inputs.amax(dim=0) if op == "max" else inputs.sum(dim=0)
        if len(layout.processes) > 1:
            inter.all_reduce(combined, op="max" if op == "max" else "sum", role=role).wait()
        if op == "mean":
            combined.div_(layout.size)
        chunks = combined.view(layout.size, -1)
        first = layout.offset(index)
        for member, post in enumerate(posts):
            post.tensors[0].copy_(chunks[first + member].view_as(post.tensors[0]))

    return plan


def _all_gather(role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, layout: _Layout, index: int) -> None:
        gathered = _gather_parts([_flat(post.tensors[1]) for post in posts], inter, layout)
        for post in posts:
            post.tensors[0].copy_(gathered.view_as(post.tensors[0]))
        mark_gathered([post.tensors[0] for post in posts])

    return plan


def _all_to_all(role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, layout: _Layout, index: int) -> None:
        everything = _gather_parts([_flat(post.tensors[1]) for post in posts], inter, layout)
        # [source rank, destination rank, chunk]
        rows = everything.view(layout.size, layout.size, -1)
        first = layout.offset(index)
        for member, post in enumerate(posts):
            post.tensors[0].copy_(rows[:, first + member].reshape(post.tensors[0].shape))

    return plan


def _broadcast(src: int, role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, layout: _Layout, index: int) -> None:
        owner = next(
            i for i in range(len(layout.counts)) if src < layout.offset(i) + layout.counts[i]
        )
        if owner == index:
            value = posts[src - layout.offset(index)].tensors[0].clone()
        else:
            value = torch.empty_like(posts[0].tensors[0])
        if len(layout.processes) > 1:
            inter.broadcast(value, src=owner, role=role).wait()
        for post in posts:
            post.tensors[0].copy_(value)

    return plan


def _barrier(posts: list[_Post], inter: Comm, layout: _Layout, index: int) -> None:
    if len(layout.processes) > 1:
        inter.barrier().wait()


def _describe(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.numel(), tensor.dtype, tensor.device.type)


class QuorumStackedComm:
    """One worker's view of a :class:`QuorumStackedGroup`: its rank and size in its
    current quorum (its global rank and M without faults)."""

    def __init__(self, group: QuorumStackedGroup, member: int) -> None:
        self._group = group
        self._member = member

    @property
    def slot(self) -> int:
        """This worker's global rank, whatever the quorum."""
        return self._group.first_rank + self._member

    @property
    def rank(self) -> int:
        return self._group.round_of(self._member).index(self.slot)

    @property
    def world_size(self) -> int:
        return len(self._group.round_of(self._member))

    @property
    def group(self) -> QuorumStackedGroup:
        return self._group

    def enter(self, quorum_id: int, members: tuple[int, ...]) -> None:
        self._group.enter(self._member, quorum_id, members)

    def chain_scheduler(self) -> ChainScheduler:
        return self._group.chains

    def _issue(
        self, what: str, signature: tuple[object, ...], tensors: tuple[torch.Tensor, ...],
        plan: Plan,
    ) -> Handle:  # fmt: skip
        slot = self._group.post(self._member, what, _Post(signature, tensors), plan)
        rank = self.slot
        return SlotHandle(slot, lambda: self._group.wait(slot, rank))

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp = "mean", role: Role,
        segments: Segments | None = None,
    ) -> Handle:  # fmt: skip
        check_segments(tensor, segments)
        what = f"all_reduce ({role.value}) of {tensor.numel() * tensor.element_size()} bytes"
        return self._issue(
            what, ("all_reduce", op, *_describe(tensor)), (tensor,), _all_reduce(op, role)
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        check_scatter_shapes(output, input, self.world_size, "reduce_scatter")
        signature = ("reduce_scatter", op, *_describe(input))
        return self._issue(
            f"reduce_scatter ({role.value})", signature, (output, input), _reduce_scatter(op, role)
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, self.world_size, "all_gather")
        return self._issue(
            f"all_gather ({role.value})", ("all_gather", *_describe(input)), (output, input),
            _all_gather(role),
        )  # fmt: skip

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, 1, "all_to_all")
        if input.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: {input.numel()} elements do not split into {self.world_size} "
                "equal chunks; pad the input to a multiple of world_size"
            )
        return self._issue(
            f"all_to_all ({role.value})", ("all_to_all", *_describe(input)), (output, input),
            _all_to_all(role),
        )  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is not a rank of a group of {self.world_size}")
        return self._issue(
            f"broadcast ({role.value}) from {src}", ("broadcast", src, *_describe(tensor)),
            (tensor,), _broadcast(src, role),
        )  # fmt: skip

    def barrier(self) -> Handle:
        return self._issue("barrier", ("barrier",), (), _barrier)


class StackedFaults(WorkerFaults):
    """A worker's view of the run's faults in a process of several workers: the engine's,
    and as each step is resolved the process group of its quorum's processes is made
    (:meth:`QuorumStackedGroup.prepare`, collective over the processes)."""

    def __init__(self, *args: Any, raw: QuorumStackedComm, **kwargs: Any) -> None:
        from lowcomm.prestart import under_torchrun

        self._stacked = raw.group
        self._groups_made = 0
        self._planned = 0
        super().__init__(*args, raw=raw, **kwargs)
        self.loses_state_in_place = under_torchrun()

    def resolve(self, step: int) -> None:
        super().resolve(step)
        while self._groups_made <= step and self._groups_made < len(self._resolved):
            resolved = self._groups_made
            self._groups_made += 1
            self._stacked.prepare(resolved, self._resolved[resolved][1])

    def plan(self, step: int) -> StepPlan:
        """The engine's; the first time a step is planned (its start: every worker plans
        every step, in order) where the quorum changes, the process's workers meet first
        (:meth:`ProcessSets.meet`)."""
        if step >= self._planned:
            self._planned = step + 1
            self.resolve(step)
            if step > 0 and self._resolved[step][2] != self._resolved[step - 1][2]:
                self._stacked.sets.meet(step)
        return super().plan(step)
