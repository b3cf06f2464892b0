"""``Comm`` between workers that live in one process (``--workers-per-process K``).

An :class:`InProcessGroup` is the shared state of the K members of one group; each member talks
through its own :class:`InProcessComm`, which looks to everything above it (the network
emulation, the hierarchical communicator, the runtime, the bookkeeping) exactly like a
``TorchComm`` of K ranks: same shapes, same reductions, asynchronous handles whose tensors are
valid after ``wait()``.

A collective is a rendezvous on shared memory: the n-th collective every member issues meets in
slot n. Posting never blocks; the last member to post computes every member's result, in member
order (so the result does not depend on which thread came last), writes it into each member's
tensors and completes the slot. A sum over two members is ``a + b`` as Gloo's, and a sum
reduce-scatter stacks and sums the chunks as ``TorchComm``'s exchange on Gloo does, so a run
with its workers in one process gives the numbers of the run with one process per worker. That
arithmetic is the collective's, not the completing member's compute: it runs outside the
thread's dispatch modes (:func:`~lowcomm.comm.base.collective_arithmetic`), so the calibrated
clock charges it to no worker, as a worker process charges nothing for Gloo's.

A round's quorum (:meth:`InProcessGroup.enter`, with declared faults) narrows the members: a
member that entered quorum ``q`` of members ``S`` posts its n-th collective of that quorum in
slot ``(q, n)``, which completes once every member of ``S`` has posted; a worker outside ``S``
posts nothing. A member's ``rank`` and ``world_size`` are then its index in ``S`` and ``|S|``,
so a mean divides by the quorum's size. Without faults every member is in quorum 0 of all.

A member that fails aborts the group (:meth:`InProcessGroup.abort`): every waiting and every
later collective of every member raises :class:`GroupAborted` at once, naming the cause.

On a GPU the members' tensors stay on the device and the result is computed there, on the
current stream of the thread that completes the slot. Members may queue their kernels on
other streams (a communication thread's side stream), so the streams are ordered by CUDA
events, never by a host synchronisation: each post records an event on the poster's stream
(its tensors are ready when it fires), the completing thread's stream waits for every post's
event before computing and records a completion event after, and a member's ``wait()`` makes
its current stream wait for that (:class:`DeviceMark`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lowcomm.comm.base import (
    CollectiveTimeout,
    Handle,
    ReduceOp,
    Role,
    Segments,
    Settled,
    check_scatter_shapes,
    check_segments,
    collective_arithmetic,
)
from lowcomm.comm.gathered import mark_gathered
from lowcomm.comm.overlap import ChainScheduler
from lowcomm.comm.turns import wait_for


class GroupAborted(RuntimeError):
    """A member of an in-process group failed (or the run was stopped): every collective of
    the group raises this, with the cause."""


@dataclass
class _Post:
    """One member's part of a collective: what it hands in and where its result goes."""

    signature: tuple[object, ...]
    tensors: tuple[torch.Tensor, ...]
    ready: DeviceMark | None = None
    """On a GPU, a CUDA event on the poster's stream after its tensors were written."""


class SignalingEvent(threading.Event):
    """A ``threading.Event`` that also calls listeners once set: how a slot wakes the
    :class:`~lowcomm.comm.overlap.ChainScheduler` waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self._listeners_lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def set(self) -> None:
        super().set()
        with self._listeners_lock:
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` once the event is set (now, if it is)."""
        with self._listeners_lock:
            if not self.is_set():
                self._listeners.append(listener)
                return
        listener()


@dataclass
class _Slot:
    """The rendezvous of one collective (the same sequence number on every member)."""

    kind: str
    compute: Callable[[list[_Post]], None]
    posts: list[_Post | None]
    remaining: int
    members: tuple[int, ...] = ()
    event: SignalingEvent = field(default_factory=SignalingEvent)
    complete: bool = False
    error: BaseException | None = None
    completed_at: float | None = None
    device_done: DeviceMark | None = None
    """On a GPU, a CUDA event on the completing thread's stream after the results."""


class InProcessGroup:
    """The shared state of the ``size`` members of one in-process group.

    Args:
        size: the members (the world size every member's comm reports).
        timeout_s: how long a wait may block before :class:`CollectiveTimeout` (None: no
            limit). Members never hang on a failed peer (it aborts the group); the limit
            catches a member that stopped issuing collectives.
        name: what errors call the group.
    """

    def __init__(self, size: int, *, timeout_s: float | None = None, name: str = "group") -> None:
        if size < 1:
            raise ValueError(f"InProcessGroup: size {size} must be 1 or more")
        self.size = size
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._issued = [0] * size
        everyone = tuple(range(size))
        self._rounds: list[tuple[int, tuple[int, ...]]] = [(0, everyone)] * size
        self._abort_reason: str | None = None
        self._members = [InProcessComm(self, rank) for rank in range(size)]
        #: Runs the members' communication chains (ACCO's), one thread for all of them.
        self.chains = ChainScheduler(f"lowcomm-chains-{name}", timeout_s=timeout_s)

    def enter(self, rank: int, quorum_id: int, members: tuple[int, ...]) -> None:
        """Member ``rank`` takes part in quorum ``quorum_id`` of ``members`` from its next
        collective on (a new id restarts its count of collectives)."""
        if rank not in members:
            raise ValueError(f"{self.name} group: member {rank} is not in quorum {members}")
        with self._lock:
            if self._rounds[rank][0] != quorum_id:
                self._rounds[rank] = (quorum_id, tuple(members))
                self._issued[rank] = 0

    def round_of(self, rank: int) -> tuple[int, ...]:
        """The members of member ``rank``'s current quorum."""
        return self._rounds[rank][1]

    def comm(self, rank: int) -> InProcessComm:
        """Member ``rank``'s communicator."""
        return self._members[rank]

    @property
    def aborted(self) -> str | None:
        """Why the group was aborted (None: it was not)."""
        return self._abort_reason

    def abort(self, reason: str) -> None:
        """End the group: every pending and later collective raises :class:`GroupAborted`
        with ``reason`` (the first reason given wins)."""
        with self._lock:
            pending = self._abort_locked(reason)
        for slot in pending:
            slot.event.set()

    def _abort_locked(self, reason: str) -> list[_Slot]:
        if self._abort_reason is not None:
            return []
        self._abort_reason = reason
        pending = list(self._slots.values())
        self._slots.clear()
        return pending

    def _aborted_error(self) -> GroupAborted:
        return GroupAborted(f"{self.name} group aborted: {self._abort_reason}")

    def post(
        self,
        rank: int,
        kind: str,
        post: _Post,
        compute: Callable[[list[_Post]], None],
    ) -> _Slot:
        """Hand in member ``rank``'s part of its next collective; complete it if last."""
        disagreement: RuntimeError | None = None
        pending: list[_Slot] = []
        last = False
        with self._lock:
            if self._abort_reason is not None:
                raise self._aborted_error()
            quorum_id, members = self._rounds[rank]
            sequence = self._issued[rank]
            self._issued[rank] += 1
            key = (quorum_id, sequence)
            slot = self._slots.get(key)
            if slot is None:
                slot = _Slot(kind, compute, [None] * len(members), len(members), members)
                self._slots[key] = slot
            if slot.members != members:
                disagreement = RuntimeError(
                    f"{self.name} group: collective #{sequence} of quorum {quorum_id} has "
                    f"members {slot.members} on one member but {members} on member {rank}; "
                    f"every member must agree on the round's quorum"
                )
                pending = self._abort_locked(f"RuntimeError: {disagreement}")
                for waiting in pending:
                    waiting.error = disagreement
            else:
                slot.posts[members.index(rank)] = post
                slot.remaining -= 1
                last = slot.remaining == 0
                if last:
                    del self._slots[key]
        if disagreement is not None:
            for waiting in pending:
                waiting.event.set()
            raise disagreement
        if last:
            self._complete(slot, sequence)
        return slot

    def _complete(self, slot: _Slot, sequence: int) -> None:
        posts = [post for post in slot.posts if post is not None]
        try:
            first = posts[0].signature
            for rank, post in enumerate(posts):
                if post.signature != first:
                    raise RuntimeError(
                        f"{self.name} group: collective #{sequence} is {first} on member 0 but "
                        f"{post.signature} on member {rank}; every member must issue the same "
                        f"collectives, of the same sizes, in the same order"
                    )
            for post in posts:  # (a GPU: compute after every member's tensors are written)
                if post.ready is not None:
                    post.ready.wait_here()
            with collective_arithmetic():  # (the collective's work, charged to no worker)
                slot.compute(posts)
            slot.device_done = DeviceMark.now(posts[0].tensors)
            slot.complete = True
            slot.completed_at = time.perf_counter()
        except BaseException as error:
            slot.error = error
            self.abort(f"{type(error).__name__}: {error}")
        finally:
            # The results are in the members' tensors: a handle kept by one member must not
            # keep every member's buffers alive.
            slot.posts = []
            slot.event.set()

    def wait(self, slot: _Slot, rank: int, what: str) -> None:
        """Block until ``slot`` completed; raise if it failed or the group was aborted."""
        if not wait_for(slot.event, self.timeout_s):
            raise CollectiveTimeout(
                f"rank {rank}: {what} did not complete within {self.timeout_s:.1f} s "
                f"(--collective-timeout-s {self.timeout_s}); a worker of this process stopped "
                f"issuing collectives or is far slower"
            )
        if slot.complete:
            return
        if slot.error is not None:
            raise GroupAborted(f"{self.name} group: {what} failed: {slot.error}") from slot.error
        raise self._aborted_error()


class SlotState(Protocol):
    """What a handle reads of a rendezvous slot (an in-process or a stacked one)."""

    event: SignalingEvent
    completed_at: float | None


class SlotHandle:
    """A member's handle on one rendezvous collective: ``wait`` is the group's wait for this
    member on this slot (it raises the group's errors)."""

    def __init__(self, slot: SlotState, wait: Callable[[], None]) -> None:
        self._slot = slot
        self._wait = wait

    def wait(self) -> None:
        self._wait()
        done = getattr(self._slot, "device_done", None)
        if done is not None:  # (a GPU: this thread's later kernels run after the results)
            done.wait_here()

    def done(self) -> bool:
        return self._slot.event.is_set()

    def notify_when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the slot completed or failed (now, if it has)."""
        self._slot.event.listen(callback)

    def settle(self) -> Settled:
        self.wait()
        return Settled()

    def completed_at(self) -> float | None:
        """When the data arrived (``time.perf_counter``), as a Gloo handle's stamp."""
        return self._slot.completed_at


@dataclass
class DeviceMark:
    """A CUDA event recorded on a thread's current stream of ``device``: it fires once every
    kernel queued there before it has run."""

    event: Any
    device: torch.device

    @classmethod
    def now(cls, tensors: tuple[torch.Tensor, ...]) -> DeviceMark | None:
        """A mark on this thread's current stream of the tensors' GPU (None: CPU tensors)."""
        device = next((tensor.device for tensor in tensors if tensor.is_cuda), None)
        if device is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return cls(event, device)

    def wait_here(self) -> None:
        """Make this thread's current stream of the device wait for the mark (the host does
        not wait)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def _reduce(stacked: torch.Tensor, op: ReduceOp, members: int) -> torch.Tensor:
    """The reduction over dimension 0 of the members' stacked chunks (as TorchComm's
    reduce-scatter by exchange: a stacked sum; a mean divides it)."""
    if op == "max":
        return stacked.amax(dim=0)
    summed = stacked.sum(dim=0)
    if op == "mean":
        summed.div_(members)
    return summed


def _all_reduce(op: ReduceOp) -> Callable[[list[_Post]], None]:
    def compute(posts: list[_Post]) -> None:
        tensors = [post.tensors[0] for post in posts]
        result = tensors[0].clone()
        for tensor in tensors[1:]:
            if op == "max":
                torch.maximum(result, tensor, out=result)
            else:
                result.add_(tensor)
        if op == "mean":
            result.div_(len(tensors))
        for tensor in tensors:
            tensor.copy_(result)

    return compute


def _reduce_scatter(op: ReduceOp) -> Callable[[list[_Post]], None]:
    def compute(posts: list[_Post]) -> None:
        members = len(posts)
        inputs = [_flat(post.tensors[1]).view(members, -1) for post in posts]
        # Every result first: an output may alias a member's input.
        results = [
            _reduce(torch.stack([chunks[rank] for chunks in inputs]), op, members)
            for rank in range(members)
        ]
        for post, result in zip(posts, results, strict=True):
            post.tensors[0].copy_(result.view_as(post.tensors[0]))

    return compute


def _all_gather(posts: list[_Post]) -> None:
    gathered = torch.cat([_flat(post.tensors[1]) for post in posts])
    for post in posts:
        post.tensors[0].copy_(gathered.view_as(post.tensors[0]))
    mark_gathered([post.tensors[0] for post in posts])  # (one decode may serve them all)


def _all_to_all(posts: list[_Post]) -> None:
    members = len(posts)
    inputs = [_flat(post.tensors[1]).view(members, -1) for post in posts]
    results = [torch.cat([chunks[rank] for chunks in inputs]) for rank in range(members)]
    for post, result in zip(posts, results, strict=True):
        post.tensors[0].copy_(result.view_as(post.tensors[0]))


def _broadcast(src: int) -> Callable[[list[_Post]], None]:
    def compute(posts: list[_Post]) -> None:
        value = posts[src].tensors[0].clone()
        for rank, post in enumerate(posts):
            if rank != src:
                post.tensors[0].copy_(value)

    return compute


def _barrier(posts: list[_Post]) -> None:
    return None


def _describe(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.numel(), tensor.dtype, tensor.device.type)


class InProcessComm:
    """One member's view of an :class:`InProcessGroup` (built by the group)."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        """This member's rank in its current quorum (its slot without faults)."""
        return self._group.round_of(self._rank).index(self._rank)

    @property
    def world_size(self) -> int:
        """The members of its current quorum (the group's size without faults)."""
        return len(self._group.round_of(self._rank))

    @property
    def slot(self) -> int:
        """This member's slot in the group, whatever the quorum."""
        return self._rank

    def enter(self, quorum_id: int, members: tuple[int, ...]) -> None:
        """Take part in quorum ``quorum_id`` of ``members`` (see :meth:`InProcessGroup.enter`)."""
        self._group.enter(self._rank, quorum_id, members)

    @property
    def group(self) -> InProcessGroup:
        return self._group

    def chain_scheduler(self) -> ChainScheduler:
        """The group's scheduler of communication chains (one thread for every member)."""
        return self._group.chains

    def _issue(
        self,
        what: str,
        signature: tuple[object, ...],
        tensors: tuple[torch.Tensor, ...],
        compute: Callable[[list[_Post]], None],
    ) -> Handle:
        post = _Post(signature, tensors, DeviceMark.now(tensors))
        slot = self._group.post(self._rank, what, post, compute)
        return SlotHandle(slot, lambda: self._group.wait(slot, self._rank, what))

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
        return self._issue(what, signature, (tensor,), _all_reduce(op))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        check_scatter_shapes(output, input, self.world_size, "reduce_scatter")
        what = f"reduce_scatter ({role.value})"
        signature = ("reduce_scatter", op, *_describe(input))
        return self._issue(what, signature, (output, input), _reduce_scatter(op))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, self.world_size, "all_gather")
        signature = ("all_gather", *_describe(input))
        return self._issue(f"all_gather ({role.value})", signature, (output, input), _all_gather)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, 1, "all_to_all")
        if input.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: {input.numel()} elements do not split into {self.world_size} "
                f"equal chunks; pad the input to a multiple of world_size"
            )
        signature = ("all_to_all", *_describe(input))
        return self._issue(f"all_to_all ({role.value})", signature, (output, input), _all_to_all)

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is not a rank of a group of {self.world_size}")
        signature = ("broadcast", src, *_describe(tensor))
        what = f"broadcast ({role.value}) from {src}"
        return self._issue(what, signature, (tensor,), _broadcast(src))

    def barrier(self) -> Handle:
        return self._issue("barrier", ("barrier",), (), _barrier)
