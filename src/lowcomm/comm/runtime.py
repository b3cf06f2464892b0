"""The runtime a strategy gets beside its ``Comm``: everything it may use of the layer below.

A strategy talks to other workers through the :class:`~lowcomm.comm.base.Comm` protocol and
its handles, and through one :class:`Runtime`, handed in with its
:class:`~lowcomm.strategies.base.StrategyContext`. The runtime is built by the communicator
itself (``comm.runtime()`` on an emulated or two-level communicator, see :func:`runtime_for`),
so strategies never import the emulation, the two-level communicator or the launcher, and
never ask which concrete communicator they were given. It holds:

* ``clock``: the run's clock, read-only (:class:`ClockReader`), or None without one.
* ``replica_group``: the communicator over the R replica ranks of this worker when a worker
  has several (for sharding optimizer states inside it), else None.
* ``uncharged``: the same group without emulation, for traffic that must neither occupy the
  modeled link nor count as training bytes (evaluation), and for collectives a communication
  thread issues while the clock's thread accounts for them.
* ``offload``: that accounting (:class:`Offload`), for a chain a communication thread issues
  on ``uncharged`` (ACCO, DPU, WP); None when the communicator is not emulated.
* :meth:`Runtime.restore`: the handle of a collective checkpointed by ``Handle.settle()``.
* :meth:`Runtime.once_per_gather`: a decode of an all-gather, done once for the workers of one
  process that received it.
* ``message``: charges a message of this worker alone (to or from a process outside the
  group, such as a synchronizer) on its link from a given start, with no launch agreement;
  None when nothing is emulated.
* ``quorum``: the live workers of this round (:class:`Quorum`), and :meth:`Runtime.enter_round`,
  which a method that talks once per round calls before its round's collectives (it charges
  the wait for a lost member's detection). Without faults every worker is a member, always.

This module imports nothing of the emulation; a strategy may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lowcomm.comm.base import CollectiveKind, Comm, CompletedHandle, Handle, Role, Settled
from lowcomm.comm.overlap import HelperMeter, LaunchAgreement

if TYPE_CHECKING:
    from lowcomm.comm.clock import Clock


class ClockReader:
    """A strategy's view of the run's clock: it may read it, and fold in compute a helper
    thread did for the worker (:meth:`helper_meter`, :meth:`fold`); it never moves it
    otherwise.

    Args:
        clock: the worker's clock.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    @property
    def kind(self) -> str:
        """``"real"`` or ``"virtual"``."""
        return self._clock.kind

    @property
    def compute_model(self) -> str:
        """How compute is charged: wall (real clock), cpu-time, declared or calibrated."""
        return self._clock.compute_model

    def now(self) -> float:
        """Seconds since the clock started (folds the compute done since the last reading)."""
        return self._clock.now()

    def helper_meter(self) -> HelperMeter:
        """A meter for compute a helper thread will do for this worker: the helper runs its
        work in ``meter.measuring()``; once it is done, :meth:`fold` charges it."""
        return self._clock.helper_meter()

    def fold(self, meter: HelperMeter) -> None:
        """Charge the helper's measured compute to this worker's clock (on the clock's
        thread, after the helper is done): the helper shares the worker's device."""
        self._clock.fold(meter)

    def compute_seconds(self) -> float:
        """Compute time this worker has accumulated so far, on this clock. Nothing waits: on
        a GPU's real clock it is the device time of the regions the device has finished, so
        a reading lags the host by the work still queued (a difference of two readings is the
        compute finished between them: over steps, the per-step compute); a host wait here,
        read each step, would stop the host from running ahead of the device."""
        self._clock.mark()
        return float(self._clock.compute_s)


class Offload(Protocol):
    """Accounting for collectives that a communication thread issues on the uncharged channel
    (:class:`lowcomm.comm.emulated.NetworkComm` implements it); call on the clock's thread."""

    def offload(self, device: torch.device | None = None) -> LaunchAgreement:
        """Start a chain; the thread must ``run(uncharged)`` the agreement first."""
        ...

    def record(
        self,
        kind: CollectiveKind,
        *,
        role: Role | None,
        payload_bytes: int,
        completion: Handle,
        agreement: LaunchAgreement,
    ) -> Handle:
        """Account for one collective of the chain, in the order the thread issues them."""
        ...


def _completed(settled: Settled) -> Handle:
    return CompletedHandle()


@dataclass(frozen=True)
class Quorum:
    """The members of a round: the live workers, the same set on every member.

    Attributes:
        members: the workers' slots, sorted; a collective runs over them, in this order (a
            member's rank in the round's collectives is its index here).
        id: changes whenever the set does (0: the run's first set).
        joined: this worker joined (or rejoined) at this round and was healed.
    """

    members: tuple[int, ...]
    id: int = 0
    joined: bool = False

    @property
    def size(self) -> int:
        """How many members: what a mean divides by."""
        return len(self.members)


class Membership(Protocol):
    """Who takes part in this worker's rounds (the fault engine implements it)."""

    def quorum(self) -> Quorum:
        """The current round's quorum."""
        ...

    def enter_round(self) -> Quorum:
        """Begin a round: wait (on the clock) until a member lost since the last round has
        been detected, then return the round's quorum."""
        ...


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """What a strategy may use besides its ``Comm`` (see the module docstring).

    Attributes:
        uncharged: the strategy's group without emulation.
        clock: the run's clock, read-only; None without one.
        replica_group: this worker's replica ranks when it has several, else None.
        offload: accounting for collectives issued on ``uncharged`` by a communication
            thread; None when nothing is emulated (the thread's collectives are then all).
        restorer: builds :meth:`restore`'s handle (from the communicator; default: a
            completed handle, right for a communicator without a clock).
        membership: who takes part in each round (None: every worker, always).
        message: charges a message of this worker alone: ``message(kind, role,
            payload_bytes, start)`` counts its bytes and queues it on this worker's link from
            ``start``; its handle completes at the modeled arrival (None: no emulation).
    """

    uncharged: Comm
    clock: ClockReader | None = None
    replica_group: Comm | None = None
    offload: Offload | None = None
    restorer: Callable[[Settled], Handle] = field(default=_completed, repr=False)
    membership: Membership | None = field(default=None, repr=False)
    message: Callable[[CollectiveKind, Role, int, float], Handle] | None = field(
        default=None, repr=False
    )

    @property
    def quorum(self) -> Quorum:
        """This round's members (every worker of the group when the run has no faults)."""
        if self.membership is None:
            return Quorum(tuple(range(self.uncharged.world_size)))
        return self.membership.quorum()

    def enter_round(self) -> Quorum:
        """Begin a round of collectives (see :class:`Membership`); without faults, the
        quorum of every worker, at no cost."""
        if self.membership is None:
            return self.quorum
        return self.membership.enter_round()

    def restore(self, settled: Settled) -> Handle:
        """The handle of a collective checkpointed by ``Handle.settle()``: its data is already
        in place; its ``wait()`` charges the clock what the original's would have."""
        return self.restorer(settled)

    def restore_pending(self, state: dict[str, Any]) -> Handle | None:
        """The handle :func:`pending_state` recorded (None when nothing was in flight)."""
        if not state["pending"]:
            return None
        return self.restore(Settled.from_state(state))

    def once_per_gather(
        self,
        gathered: torch.Tensor,
        key: str,
        compute: Callable[[], torch.Tensor],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``compute()``, a deterministic function of the all-gathered ``gathered``: the
        workers of one process that received the same gather compute it once, each gets the
        bits in a tensor of its own and is charged what computing it costs
        (:func:`lowcomm.comm.gathered.once_per_gather`, which says when it is shared).
        ``out``: the tensor ``compute`` writes into and returns (None: it returns a new one)."""
        from lowcomm.comm.gathered import once_per_gather

        model = None if self.clock is None else self.clock.compute_model
        return once_per_gather(gathered, key, compute, compute_model=model, out=out)


def pending_state(handle: Handle | None) -> dict[str, Any]:
    """A checkpointable record of an optional in-flight collective (settled now)."""
    if handle is None:
        return {"pending": False, **Settled().state_dict()}
    return {"pending": True, **handle.settle().state_dict()}


def runtime_for(comm: Comm) -> Runtime:
    """The runtime of ``comm``: the one it describes (``comm.runtime()``, which the emulated
    and the two-level communicators provide), else that of a plain communicator (no clock, no
    replica group, ``comm`` itself uncharged, restored handles complete)."""
    describe = getattr(comm, "runtime", None)
    if callable(describe):
        runtime = describe()
        if not isinstance(runtime, Runtime):
            raise TypeError(f"{type(comm).__name__}.runtime() returned {type(runtime).__name__}")
        return runtime
    return Runtime(uncharged=comm)
