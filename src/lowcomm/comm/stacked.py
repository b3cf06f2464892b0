"""``Comm`` of M = P x K workers: K worker threads in each of P processes.

A :class:`StackedGroup` is the shared state of the K members of one group that live in this
process; each member talks through its own :class:`StackedComm`, which presents the worker's
global rank ``w = p K + k`` (``p``: this process's rank among the P, ``k``: the member) and the
world size M, and implements the whole ``Comm`` protocol with asynchronous handles: to
everything above it (the network emulation, the runtime, the bookkeeping) it looks like a
``TorchComm`` of M ranks. The emulation prices and counts each collective from its payload,
the rank and M, never from what moves here, so the two-level data path below changes no
number the run reports.

A collective has two levels:

1. **In the process** (as :mod:`lowcomm.comm.inprocess`): the n-th collective every member
   issues meets in slot n; posting never blocks.
2. **Between the processes**: once all K members posted slot n, the slot goes to the
   group's *courier*, one thread per group and process, which combines the members' tensors
   (a sum, a max, a concatenation), runs the collective of the P processes on ``inter`` (a
   ``TorchComm`` over one process group) and writes every member's result.

Why this cannot deadlock: slots reach the courier in sequence order (a slot is queued, under
the group's lock, by the member whose post completes it, and every member posts in program
order, so slot n is complete before slot n + 1 can be), and the courier runs them one at a
time, so every process issues the inter-process collectives of a group in the same order,
whatever threads (workers, their communication threads) posted them. Each group has its own
courier and its own process group, as each flat group is its own Gloo group.

Results equal a flat ``TorchComm`` of M ranks up to the order of a sum's terms (the K members'
part is summed here first): float rounding only.

A member that fails aborts the group (:meth:`StackedGroup.abort`): every waiting and later
collective of every member of this process raises :class:`GroupAborted`; the process then
exits non-zero, and the other processes' collectives fail on the closed connection (or the
launcher stops them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

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
from lowcomm.comm.turns import wait_for

#: What a slot does once every member of this process posted: combine the members' tensors,
#: run the inter-process collective on the group's ``inter`` comm, write every member's result.
Plan = Callable[[list["_Post"], Comm, int], None]


@dataclass
class _Post:
    """One member's part of a collective: what it hands in and where its result goes."""

    signature: tuple[object, ...]
    tensors: tuple[torch.Tensor, ...]


@dataclass
class _Slot:
    """The n-th collective of every member of this process."""

    sequence: int
    what: str
    plan: Plan
    posts: list[_Post | None]
    remaining: int
    event: SignalingEvent = field(default_factory=SignalingEvent)
    complete: bool = False
    error: BaseException | None = None
    completed_at: float | None = None


class StackedGroup:
    """The members of one group that live in this process, and the group's courier.

    Args:
        local_size: K, the members in this process.
        inter: a communicator over the P processes (one rank per process, in process order;
            a ``TorchComm``); only the courier uses it.
        timeout_s: how long a member's wait may block before :class:`CollectiveTimeout`
            (None: no limit).
        name: what errors call the group.
    """

    def __init__(
        self, local_size: int, inter: Comm, *, timeout_s: float | None = None, name: str = "group"
    ) -> None:
        if local_size < 1:
            raise ValueError(f"StackedGroup: local_size {local_size} must be 1 or more")
        self.local_size = local_size
        self.inter = inter
        self.size = local_size * inter.world_size
        self.first_rank = inter.rank * local_size
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._queued: dict[int, _Slot] = {}
        self._issued = [0] * local_size
        self._abort_reason: str | None = None
        self._queue: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        self._members = [StackedComm(self, k) for k in range(local_size)]
        #: Runs the members' communication chains (ACCO's), one thread for all of them.
        self.chains = ChainScheduler(f"lowcomm-chains-{name}", timeout_s=timeout_s)
        self._courier = threading.Thread(
            target=self._deliver, name=f"lowcomm-{name}-courier", daemon=True
        )
        self._courier.start()

    def comm(self, member: int) -> StackedComm:
        """Member ``member``'s communicator (global rank ``first_rank + member``)."""
        return self._members[member]

    @property
    def aborted(self) -> str | None:
        """Why the group was aborted (None: it was not)."""
        return self._abort_reason

    def abort(self, reason: str) -> None:
        """End the group in this process: every pending and later collective of its members
        raises :class:`GroupAborted` with ``reason`` (the first reason given wins)."""
        with self._lock:
            if self._abort_reason is not None:
                return
            self._abort_reason = reason
            pending = [*self._slots.values(), *self._queued.values()]
            self._slots.clear()
        for slot in pending:
            slot.event.set()
        self._queue.put(None)

    def close(self) -> None:
        """Stop the courier once it has delivered what was queued (the run is over)."""
        self._queue.put(None)

    def _aborted_error(self) -> GroupAborted:
        return GroupAborted(f"{self.name} group aborted: {self._abort_reason}")

    def post(self, member: int, what: str, post: _Post, plan: Plan) -> _Slot:
        """Hand in ``member``'s part of its next collective; queue the slot if it is the last."""
        with self._lock:
            if self._abort_reason is not None:
                raise self._aborted_error()
            sequence = self._issued[member]
            self._issued[member] += 1
            slot = self._slots.get(sequence)
            if slot is None:
                slot = _Slot(sequence, what, plan, [None] * self.local_size, self.local_size)
                self._slots[sequence] = slot
            slot.posts[member] = post
            slot.remaining -= 1
            if slot.remaining == 0:
                # Queued under the lock: slots reach the courier in sequence order.
                del self._slots[sequence]
                self._queued[sequence] = slot
                self._queue.put(slot)
        return slot

    def _deliver(self) -> None:
        """The courier: run every complete slot, in sequence order, until closed or aborted."""
        expected = 0
        while True:
            slot = self._queue.get()
            if slot is None or self._abort_reason is not None:
                return
            try:
                if slot.sequence != expected:  # (cannot happen: slots are queued in order)
                    raise RuntimeError(
                        f"slot {slot.sequence} reached the courier before {expected}"
                    )
                expected += 1
                posts = [post for post in slot.posts if post is not None]
                self._check_signatures(slot, posts)
                with torch.no_grad():
                    slot.plan(posts, self.inter, self.size)
                slot.completed_at = time.perf_counter()
                slot.complete = True
            except BaseException as error:
                slot.error = error
                self.abort(f"{type(error).__name__}: {error}")
            finally:
                with self._lock:
                    self._queued.pop(slot.sequence, None)
                slot.event.set()

    def _check_signatures(self, slot: _Slot, posts: list[_Post]) -> None:
        first = posts[0].signature
        for member, post in enumerate(posts):
            if post.signature != first:
                raise RuntimeError(
                    f"{self.name} group: collective #{slot.sequence} is {first} on rank "
                    f"{self.first_rank} but {post.signature} on rank {self.first_rank + member}; "
                    f"every worker must issue the same collectives, of the same sizes, in the "
                    f"same order"
                )

    def wait(self, slot: _Slot, rank: int) -> None:
        """Block until ``slot`` completed; raise if it failed or the group was aborted."""
        if not wait_for(slot.event, self.timeout_s):
            raise CollectiveTimeout(
                f"rank {rank}: {slot.what} did not complete within {self.timeout_s:.1f} s "
                f"(--collective-timeout-s {self.timeout_s}); a worker stopped issuing "
                f"collectives, hung or is far slower"
            )
        if slot.complete:
            return
        if slot.error is not None:
            raise GroupAborted(f"{self.name} group: {slot.what} failed: {slot.error}") from None
        raise self._aborted_error()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def _combine(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The members' tensors reduced into a new one (a sum for ``sum`` and ``mean``)."""
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        if op == "max":
            torch.maximum(result, tensor, out=result)
        else:
            result.add_(tensor)
    return result


def _inter_op(op: ReduceOp) -> ReduceOp:
    return "max" if op == "max" else "sum"


def _all_reduce(op: ReduceOp, role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, size: int) -> None:
        tensors = [post.tensors[0] for post in posts]
        result = _combine(tensors, op)
        if inter.world_size > 1:
            inter.all_reduce(result, op=_inter_op(op), role=role).wait()
        if op == "mean":
            result.div_(size)
        for tensor in tensors:
            tensor.copy_(result)

    return plan


def _reduce_scatter(op: ReduceOp, role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, size: int) -> None:
        members = len(posts)
        inputs = torch.stack([_flat(post.tensors[1]) for post in posts])
        combined = inputs.amax(dim=0) if op == "max" else inputs.sum(dim=0)
        ours = combined
        if inter.world_size > 1:
            if op == "max":  # (on the whole buffer: Gloo has no max reduce-scatter by exchange)
                inter.all_reduce(combined, op="max", role=role).wait()
                ours = combined.view(inter.world_size, -1)[inter.rank]
            else:
                ours = torch.empty(combined.numel() // inter.world_size, dtype=combined.dtype)
                inter.reduce_scatter(ours, combined, op="sum", role=role).wait()
        if op == "mean":
            ours.div_(size)
        for post, chunk in zip(posts, ours.view(members, -1), strict=True):
            post.tensors[0].copy_(chunk.view_as(post.tensors[0]))

    return plan


def _all_gather(role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, size: int) -> None:
        ours = torch.cat([_flat(post.tensors[1]) for post in posts])
        gathered = ours
        if inter.world_size > 1:
            gathered = torch.empty(ours.numel() * inter.world_size, dtype=ours.dtype)
            inter.all_gather(gathered, ours, role=role).wait()
        for post in posts:
            post.tensors[0].copy_(gathered.view_as(post.tensors[0]))
        mark_gathered([post.tensors[0] for post in posts])  # (one decode may serve them all)

    return plan


def _all_to_all(role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, size: int) -> None:
        members, processes = len(posts), inter.world_size
        # [source member, destination process, destination member, chunk] ->
        # [destination process, source member, destination member, chunk]: what each process
        # sends every other one, in one exchange.
        inputs = torch.stack([_flat(post.tensors[1]) for post in posts])
        send = inputs.view(members, processes, members, -1).transpose(0, 1).contiguous()
        received = send
        if processes > 1:
            received = torch.empty_like(send)
            inter.all_to_all(received.view(-1), send.view(-1), role=role).wait()
        # received: [source process, source member, destination member, chunk]
        for member, post in enumerate(posts):
            post.tensors[0].copy_(received[:, :, member].reshape(post.tensors[0].shape))

    return plan


def _broadcast(src: int, role: Role) -> Plan:
    def plan(posts: list[_Post], inter: Comm, size: int) -> None:
        process, member = divmod(src, len(posts))
        if inter.rank == process:
            value = posts[member].tensors[0].clone()
        else:
            value = torch.empty_like(posts[0].tensors[0])
        if inter.world_size > 1:
            inter.broadcast(value, src=process, role=role).wait()
        for post in posts:
            post.tensors[0].copy_(value)

    return plan


def _barrier(posts: list[_Post], inter: Comm, size: int) -> None:
    if inter.world_size > 1:
        inter.barrier().wait()


def _describe(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.numel(), tensor.dtype, tensor.device.type)


class StackedComm:
    """One member's view of a :class:`StackedGroup` (built by the group): global rank
    ``first_rank + member`` of a world of ``local_size x processes``."""

    def __init__(self, group: StackedGroup, member: int) -> None:
        self._group = group
        self._member = member

    @property
    def rank(self) -> int:
        return self._group.first_rank + self._member

    @property
    def world_size(self) -> int:
        return self._group.size

    @property
    def group(self) -> StackedGroup:
        return self._group

    def chain_scheduler(self) -> ChainScheduler:
        """The group's scheduler of communication chains (one thread for this process's
        members)."""
        return self._group.chains

    def _issue(
        self,
        what: str,
        signature: tuple[object, ...],
        tensors: tuple[torch.Tensor, ...],
        plan: Plan,
    ) -> Handle:
        slot = self._group.post(self._member, what, _Post(signature, tensors), plan)
        rank = self.rank
        return SlotHandle(slot, lambda: self._group.wait(slot, rank))

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        what = f"all_reduce ({role.value}) of {tensor.numel() * tensor.element_size()} bytes"
        signature = ("all_reduce", op, *_describe(tensor))
        return self._issue(what, signature, (tensor,), _all_reduce(op, role))

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
        signature = ("all_gather", *_describe(input))
        return self._issue(
            f"all_gather ({role.value})", signature, (output, input), _all_gather(role)
        )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, 1, "all_to_all")
        if input.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: {input.numel()} elements do not split into {self.world_size} "
                f"equal chunks; pad the input to a multiple of world_size"
            )
        signature = ("all_to_all", *_describe(input))
        return self._issue(
            f"all_to_all ({role.value})", signature, (output, input), _all_to_all(role)
        )

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is not a rank of a group of {self.world_size}")
        signature = ("broadcast", src, *_describe(tensor))
        what = f"broadcast ({role.value}) from {src}"
        return self._issue(what, signature, (tensor,), _broadcast(src, role))

    def barrier(self) -> Handle:
        return self._issue("barrier", ("barrier",), (), _barrier)
