"""Network emulation and byte accounting around any ``Comm``.

:class:`NetworkComm` forwards every collective to an inner ``Comm`` (the data really moves) and
charges it what the declared :class:`~lowcomm.comm.network.NetworkProfile` says it costs.

All collectives issued on one ``NetworkComm`` share one link and queue behind each other:
a collective starts when the link is free and every participant has launched it.

* **Real clock**: a handle completes no earlier than its modeled completion time. The delay
  is served inside ``wait()`` (on the wire), never on compute: if the worker computed for
  longer than the transfer takes, ``wait()`` returns at once. The start is this worker's own
  launch time; skew between ranks is absorbed by the inner collective itself.
* **Virtual clock**: each launch also all-reduces (max) the participants' launch times in a
  tiny side collective that is neither charged nor counted, so every rank computes the same
  start and completion. ``done()`` answers by the virtual clock; ``wait()`` moves the clock to
  the completion. Blocking in real time to learn a peer's launch time costs no virtual time.

Collectives issued on another thread (``lowcomm.comm.overlap``): :meth:`NetworkComm.offload`
and :meth:`NetworkComm.record` let the clock's thread account for a chain that a communication
thread issues on ``inner`` (bytes, modeled cost, place on the link, completion time) without
issuing anything itself; the launch-time exchange then runs on the communication thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
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
    arrival_stamp,
    check_device,
    check_segments,
    payload_bytes,
)
from lowcomm.comm.cast import CastBackHandle, travels_cast
from lowcomm.comm.clock import Clock, RealClock
from lowcomm.comm.network import NetworkProfile, bytes_sent
from lowcomm.comm.overlap import LaunchAgreement
from lowcomm.comm.runtime import ClockReader, Runtime


class _EmulatedHandle:
    """An in-flight collective with a modeled completion time."""

    def __init__(
        self,
        owner: NetworkComm,
        inner: Handle,
        cost: float,
        launch_time: float,
        launch_times: torch.Tensor | None,
        launch_times_handle: Handle | None,
    ) -> None:
        self._owner = owner
        self._inner = inner
        self.cost = cost
        self.launch_time = launch_time
        self._launch_times = launch_times
        self._launch_times_handle = launch_times_handle
        self.finish_time: float | None = None
        self._waited = False
        # On a GPU's real clock, the end of the transfer queued on the device's timeline.
        self.device_done: Any = None

    def _resolve_start(self) -> float:
        """The start time agreed by all participants (blocks for peers' launch times)."""
        if self._launch_times_handle is None or self._launch_times is None:
            return self.launch_time
        self._launch_times_handle.wait()
        return float(self._launch_times.item())

    def wait(self) -> None:
        if self._waited:
            return
        clock = self._owner.clock
        exposed_before = clock.exposed_comm_s
        with clock.blocked():
            self._inner.wait()
            finish = self._owner._resolve(self)
            if self.device_done is not None and isinstance(clock, RealClock):
                clock.wait_on_device(self.device_done)
            else:
                clock.wait_until(finish)
        self._owner.exposed_comm_s += clock.exposed_comm_s - exposed_before
        self._waited = True

    def settle(self) -> Settled:
        """Finish the data movement now without charging any time; return the completion:
        the modeled one, and on the real clock the data's arrival if that was later (with
        ``--network none`` the model's is the launch itself). A later :meth:`wait` still moves
        the clock to the modeled completion (used to checkpoint a collective that is in flight
        without changing the run's timing, and by CoCoDC to time its syncs)."""
        with self._owner.clock.blocked():
            self._inner.wait()
            finish = self._owner._resolve(self)
            arrival = self._arrival()
            return Settled(finish if arrival is None else max(finish, arrival))

    def _arrival(self) -> float | None:
        """When the data arrived, on the real clock (None on the virtual clock, or when the
        inner communicator does not stamp its completions)."""
        clock = self._owner.clock
        if not isinstance(clock, RealClock):
            return None
        instant = arrival_stamp(self._inner)
        return None if instant is None else clock.at(instant)

    def done(self) -> bool:
        if self._waited:
            return True
        if self._owner.clock.kind == "virtual":
            with self._owner.clock.blocked():
                finish = self._owner._resolve(self)
            return self._owner.clock.now() >= finish
        if not self._inner.done():
            return False
        return self._owner.clock.now() >= self._owner._resolve(self)


class ScheduledHandle:
    """A collective whose data has arrived and which completes at ``finish_time`` on ``clock``:
    an in-flight collective restored from a checkpoint."""

    def __init__(self, clock: Clock, finish_time: float) -> None:
        self._clock = clock
        self.finish_time = finish_time

    def wait(self) -> None:
        with self._clock.blocked():
            self._clock.wait_until(self.finish_time)

    def done(self) -> bool:
        return self._clock.now() >= self.finish_time

    def settle(self) -> Settled:
        return Settled(self.finish_time)


class NetworkComm:
    """Charges every collective of an inner ``Comm`` its modeled cost and counts its bytes.

    Args:
        raw: the communicator that moves the data.
        profile: the declared link and per-worker speed factors.
        clock: this worker's clock (real or virtual).
        device: the device of the group's tensors (cuda for NCCL): a collective refuses a
            tensor on another device (None: undeclared, unchecked; barriers then use cpu).
        wire_dtype: the dtype float32 gradients and pseudo-gradients travel in
            (``--comm-dtype``, :mod:`lowcomm.comm.cast`); other roles travel as they are.
        bookkeeping: a host (Gloo) group of the same ranks, used from this communicator's
            issuing thread only, on which the virtual clock agrees on launch times as host
            floats (None: on ``raw``, on the payload's device).
    """

    def __init__(
        self,
        raw: Comm,
        profile: NetworkProfile,
        clock: Clock,
        *,
        device: torch.device | None = None,
        wire_dtype: torch.dtype = torch.float32,
        bookkeeping: Comm | None = None,
    ) -> None:
        self.raw = raw
        self._bookkeeping = bookkeeping
        self.wire_dtype = wire_dtype
        # Where the launch-time exchange lives (the group's device).
        self._declared_device = device
        self._barrier_device = device or torch.device("cpu")
        self.profile = profile
        self.clock = clock
        self.bytes_by_role: dict[Role, float] = {role: 0.0 for role in Role}
        self.bytes_by_kind: dict[CollectiveKind, float] = {kind: 0.0 for kind in CollectiveKind}
        self.calls_by_kind: dict[CollectiveKind, int] = {kind: 0 for kind in CollectiveKind}
        self.modeled_comm_s = 0.0
        # Time this worker spent blocked in wait() on this communicator's collectives (a
        # share of clock.exposed_comm_s: with two levels, each level's part).
        self.exposed_comm_s = 0.0
        # Handles launched but not yet placed on the link, in issue order. Every rank issues
        # the same collectives in the same order, so resolving them in this order gives every
        # rank the same link schedule.
        self._unresolved: deque[_EmulatedHandle] = deque()
        self._link_free_at = 0.0
        #: With declared faults: how long a transfer of modeled cost ``cost`` takes when it
        #: starts at ``start`` on a degraded or down link (None: ``cost``, always).
        self.link_model: Callable[[float, float], float] | None = None

    @property
    def rank(self) -> int:
        return self.raw.rank

    @property
    def world_size(self) -> int:
        return self.raw.world_size

    @property
    def device(self) -> torch.device:
        """The device of this group's tensors (cuda for NCCL)."""
        return self._barrier_device

    @property
    def bytes_sent(self) -> float:
        return sum(self.bytes_by_role.values())

    def _resolve(self, handle: _EmulatedHandle) -> float:
        while handle.finish_time is None:
            head = self._unresolved.popleft()
            start = max(head._resolve_start(), self._link_free_at)
            cost = head.cost if self.link_model is None else self.link_model(start, head.cost)
            head.finish_time = start + cost
            self._link_free_at = head.finish_time
        return handle.finish_time

    def _account(
        self,
        kind: CollectiveKind,
        role: Role | None,
        payload_bytes: int,
        src: int = 0,
        shares: list[tuple[Role, int]] | None = None,
    ) -> float:
        """Count one collective's bytes (by role, or by each fused share's role, and by kind);
        return its modeled cost. Ring bytes are linear in the payload, so a fused payload's
        bytes split exactly by share."""
        world_size = self.raw.world_size
        sent = bytes_sent(kind, payload_bytes, world_size, self.raw.rank, src)
        if shares is not None:
            for share_role, share_bytes in shares:
                self.bytes_by_role[share_role] += bytes_sent(
                    kind, share_bytes, world_size, self.raw.rank, src
                )
        elif role is not None:
            self.bytes_by_role[role] += sent
        self.bytes_by_kind[kind] += sent
        self.calls_by_kind[kind] += 1
        cost = self.profile.collective_time(kind, payload_bytes, world_size)
        self.modeled_comm_s += cost
        return cost

    def _agree_launch(
        self, launch_time: float, device: torch.device
    ) -> tuple[torch.Tensor, Handle]:
        """Start agreeing on a launch's start: the latest launch among the participants
        (virtual clock), from the issuing thread, in the same order on every rank.

        With a bookkeeping group, a host float on it (Gloo: reading the agreed value waits
        for no device). Else on this group, right before the payload, on the payload's device
        (NCCL only moves GPU tensors), made by a fill kernel that takes the value as an
        argument (a tensor of a list is a blocking host-to-device copy); reading it back is
        then a host read of a device value."""
        if self._bookkeeping is not None:
            times = torch.full((1,), launch_time, dtype=torch.float64)
            return times, self._bookkeeping.all_reduce(times, op="max", role=Role.OTHER)
        times = torch.full((1,), launch_time, dtype=torch.float64, device=device)
        return times, self.raw.all_reduce(times, op="max", role=Role.OTHER)

    def _launch(
        self,
        kind: CollectiveKind,
        role: Role | None,
        full_bytes: int,
        issue: Callable[[], Handle],
        device: torch.device,
        src: int = 0,
        shares: list[tuple[Role, int]] | None = None,
    ) -> Handle:
        world_size = self.raw.world_size
        check_device(device, self._declared_device, kind.value)
        cost = self._account(kind, role, full_bytes, src, shares)
        launch_time = self.clock.now()
        launch_times: torch.Tensor | None = None
        launch_times_handle: Handle | None = None
        if self.clock.kind == "virtual" and world_size > 1:
            launch_times, launch_times_handle = self._agree_launch(launch_time, device)
        inner = issue()
        handle = _EmulatedHandle(self, inner, cost, launch_time, launch_times, launch_times_handle)
        if isinstance(self.clock, RealClock):
            handle.device_done = self.clock.link_delay(self, cost)
        self._unresolved.append(handle)
        return handle

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        if travels_cast(tensor, role, self.wire_dtype):
            wire = tensor.to(self.wire_dtype)
            handle = self.all_reduce(wire, op=op, role=role, segments=segments)
            return CastBackHandle(handle, wire, tensor)
        shares = (
            None
            if segments is None
            else [(seg_role, count * tensor.element_size()) for seg_role, count in segments]
        )
        return self._launch(
            CollectiveKind.ALL_REDUCE,
            role,
            payload_bytes(tensor),
            lambda: self.raw.all_reduce(tensor, op=op, role=role, segments=segments),
            tensor.device,
            shares=shares,
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        if travels_cast(input, role, self.wire_dtype):
            wire_out = torch.empty_like(output, dtype=self.wire_dtype)
            handle = self.reduce_scatter(wire_out, input.to(self.wire_dtype), op=op, role=role)
            return CastBackHandle(handle, wire_out, output)
        check_device(output.device, self._declared_device, "reduce_scatter")
        return self._launch(
            CollectiveKind.REDUCE_SCATTER,
            role,
            payload_bytes(input),
            lambda: self.raw.reduce_scatter(output, input, op=op, role=role),
            input.device,
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        if travels_cast(input, role, self.wire_dtype):
            wire_out = torch.empty_like(output, dtype=self.wire_dtype)
            handle = self.all_gather(wire_out, input.to(self.wire_dtype), role=role)
            return CastBackHandle(handle, wire_out, output)
        check_device(input.device, self._declared_device, "all_gather")
        return self._launch(
            CollectiveKind.ALL_GATHER,
            role,
            payload_bytes(output),
            lambda: self.raw.all_gather(output, input, role=role),
            output.device,
        )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Priced and counted as the reduce-scatter of ``input`` it is the first step of
        (each rank sends the other ranks' chunks: (n-1)/n of the payload, as a ring does)."""
        check_device(output.device, self._declared_device, "all_to_all")
        return self._launch(
            CollectiveKind.REDUCE_SCATTER,
            role,
            payload_bytes(input),
            lambda: self.raw.all_to_all(output, input, role=role),
            input.device,
        )

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        return self._launch(
            CollectiveKind.BROADCAST,
            role,
            payload_bytes(tensor),
            lambda: self.raw.broadcast(tensor, src=src, role=role),
            tensor.device,
            src=src,
        )

    def barrier(self) -> Handle:
        return self._launch(CollectiveKind.BARRIER, None, 0, self.raw.barrier, self._barrier_device)

    # --- collectives issued on another thread (lowcomm.comm.overlap) ----------------------

    def offload(self, device: torch.device | None = None) -> LaunchAgreement:
        """Start a chain of collectives that a communication thread will issue on ``inner``.

        Call on the clock's thread. Returns the :class:`LaunchAgreement` the communication
        thread must ``run(self.raw)`` before any collective of the chain; pass it to
        :meth:`record` for each collective of the chain. This worker's launch time is read now.
        """
        exchange = self.clock.kind == "virtual" and self.raw.world_size > 1
        return LaunchAgreement(
            self.clock.now(), exchange=exchange, device=device or self._barrier_device
        )

    def record(
        self,
        kind: CollectiveKind,
        *,
        role: Role | None,
        payload_bytes: int,
        completion: Handle,
        agreement: LaunchAgreement,
    ) -> Handle:
        """Account for one collective that another thread issues on ``inner``, without issuing it.

        Counts its bytes (by role and kind), prices it with the network model, and queues it
        on this link behind everything recorded or launched before, exactly as if it had been
        launched at ``agreement.launch_time``. Call on the clock's thread, in the order the
        other thread issues the collectives (the same order on every rank).

        Args:
            kind: the collective.
            role: what the payload is (None for a barrier).
            payload_bytes: the full (unsharded) payload, as for the issuing methods.
            completion: completes when the real transfer is done (e.g. the thread's future).
            agreement: from :meth:`offload`; on the virtual clock its agreed start is used.

        Returns:
            A handle that completes when ``completion`` has and the modeled completion time
            has passed on this clock (on the virtual clock ``done()`` follows the clock only).
        """
        cost = self._account(kind, role, payload_bytes)
        handle = _EmulatedHandle(
            self,
            completion,
            cost,
            agreement.launch_time,
            agreement.times if agreement.exchange else None,
            agreement if agreement.exchange else None,
        )
        self._unresolved.append(handle)
        return handle

    def charge_many(self, charges: Sequence[Charge]) -> list[Handle]:
        """Charge collectives whose data has already moved, in order, behind one agreed
        launch (now): each counted and queued on the link as if launched now, one after the
        other. Call on the issuing thread; every rank at the same point with the same list."""
        if not charges:
            return []
        launch_time = self.clock.now()
        times: torch.Tensor | None = None
        agreement: Handle | None = None
        if self.clock.kind == "virtual" and self.raw.world_size > 1:
            with self.clock.blocked():  # (the exchange, as a launch's wait() runs it)
                times, agreement = self._agree_launch(launch_time, self._barrier_device)
                agreement.wait()
        handles: list[Handle] = []
        for charge in charges:
            cost = self._account(charge.kind, charge.role, charge.payload_bytes)
            handle = _EmulatedHandle(self, CompletedHandle(), cost, launch_time, times, agreement)
            if isinstance(self.clock, RealClock):
                handle.device_done = self.clock.link_delay(self, cost)
            self._unresolved.append(handle)
            handles.append(handle)
        return handles

    def charge(self, kind: CollectiveKind, *, role: Role | None, payload_bytes: int) -> Handle:
        """Charge a collective whose data has already moved (settled for a checkpoint): count
        its bytes, agree on its start (on the virtual clock, with the same uncharged exchange
        as a launch) and queue it on the link as if it were launched now. The returned
        handle's ``wait()`` moves the clock to its modeled completion."""
        return self.charge_many([Charge(kind, role, payload_bytes)])[0]

    def charge_message(
        self, kind: CollectiveKind, role: Role, payload_bytes: int, start: float
    ) -> Handle:
        """Charge a message of this worker alone (to or from a process that is not a member
        of the group, such as a synchronizer): count its bytes as ``kind`` of
        ``payload_bytes`` prices them, and queue it on this worker's link from ``start`` with
        no launch agreement, since no other member takes part. ``settle()`` gives its modeled
        completion without moving the clock; ``wait()`` moves the clock to it."""
        cost = self._account(kind, role, payload_bytes)
        # (A communicator below that records messages, a test's, sees it as its collectives.)
        below = getattr(self.raw, "charge_message", None)
        if below is not None:
            below(kind, role, payload_bytes, start)
        handle = _EmulatedHandle(self, CompletedHandle(), cost, start, None, None)
        self._unresolved.append(handle)
        return handle

    def restore(self, settled: Settled) -> Handle:
        """The handle of a collective settled on this communicator before a checkpoint: its
        data is in place; it completes at the settled modeled completion on this clock."""
        if settled.then:
            raise ValueError(
                "NetworkComm.restore: a one-level communicator never settles follow-up "
                "collectives; the checkpoint was taken on a hierarchical run (resume it with "
                "the same --ranks-per-worker)"
            )
        if settled.finish_time is None:
            return CompletedHandle()
        return ScheduledHandle(self.clock, settled.finish_time)

    def runtime(self) -> Runtime:
        """What a strategy on this communicator may use besides it (the read-only clock, the
        un-emulated group, the accounting of a communication thread's collectives)."""
        return Runtime(
            uncharged=self.raw,
            clock=ClockReader(self.clock),
            offload=self,
            restorer=self.restore,
            message=self.charge_message,
        )

    def state_dict(self) -> dict[str, Any]:
        """Byte counters and the link's schedule (for a checkpoint). Every collective must be
        settled or waited first: an unresolved one cannot be saved."""
        if self._unresolved:
            raise RuntimeError(
                f"NetworkComm.state_dict: {len(self._unresolved)} collective(s) not yet placed "
                f"on the link; the strategy must settle its in-flight handles in state_dict()"
            )
        return {
            "bytes_by_role": {role.value: value for role, value in self.bytes_by_role.items()},
            "bytes_by_kind": {kind.value: value for kind, value in self.bytes_by_kind.items()},
            "calls_by_kind": {kind.value: value for kind, value in self.calls_by_kind.items()},
            "modeled_comm_s": self.modeled_comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "link_free_at": self._link_free_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes_by_role = {role: float(state["bytes_by_role"][role.value]) for role in Role}
        self.bytes_by_kind = {
            kind: float(state["bytes_by_kind"][kind.value]) for kind in CollectiveKind
        }
        self.calls_by_kind = {
            kind: int(state["calls_by_kind"][kind.value]) for kind in CollectiveKind
        }
        self.modeled_comm_s = float(state["modeled_comm_s"])
        self.exposed_comm_s = float(state["exposed_comm_s"])
        self._link_free_at = float(state["link_free_at"])

    def counters(self) -> dict[str, float]:
        """Bytes this worker sent, by role (for metrics)."""
        return {role.value: value for role, value in self.bytes_by_role.items()}
