"""One worker as a torchft replica group: a ``Comm`` over torchft's Manager and its
reconfigurable Gloo group, and the runtime's ``Membership`` that opens each round with a quorum.

**A round** is one quorum, the method's collectives over its members, and one commit
(docs/ARCHITECTURE.md, "Workers that come and go"): each step for ddp, each outer sync for
diloco. :class:`Replica` opens it with torchft's asynchronous quorum (``Manager.start_quorum``)
so that the quorum forms while the worker computes: ddp's worker opens it at the start of every
step, whose gradient it then computes; a method that syncs every H steps (diloco, the local
family, desloc, ...) opens it at the start of the step whose end enters the round
(:meth:`Replica.open_round_early`, the step its past rounds' period names: one step ahead of
``runtime.enter_round()``, where it opened before), so its sync waits only for what is left of
the quorum. A round opened early is still the round whose collectives and commit follow: a
worker that dies between the quorum and the collective makes the collective fail, and the
round is dropped and tried again on a new quorum. Until the worker reaches its round it
holds torchft's state-dict lock (``disallow_state_dict_read``), so a joiner healed at that
quorum receives the global state as the sync sees it, never one mid-step. A round is not
opened early while one is open or in flight (co2, eager, diloco_delayed, a streaming fragment):
the method's equations settle that one where they do. The
round's payload travels in ``Manager.allreduce`` (a sum, divided by the number of workers that
take part); its handle's ``wait()`` asks the Manager to commit (``should_commit``). A round
that did not commit (a peer died inside the collective, the group could not be reconfigured) is
dropped: its input is put back and the round is tried again on a new quorum, which leaves the
dead worker out once the lighthouse has stopped hearing its heartbeats; the strategy only ever
sees a committed result. After ``--membership.attempts`` failures the worker gives up.

**Gathers.** A method that all-gathers its workers' payloads (demo, sparseloco) gathers in the
round too (:class:`_GatherHandle`): torchft's Manager wraps no all-gather, so it runs on the
reconfigured group directly, reports a failure to the Manager (the round then does not commit)
and is tried again from its saved input on a new quorum. Its output has one row per
participant, in slot order: a member being healed sends a row that is left out.

**Rounds of several collectives.** An exchange whose later collectives need an earlier one's
data (diloco's two-step quantized mean: an all-to-all, then an all-gather) runs as one round
(:meth:`TorchftComm.run_round`): its collectives share the round's quorum, none commits on
its own, a failure of any makes the round not commit, and the whole exchange runs again on a
new quorum.

**Healing.** A worker that asks for a quorum with a lower torchft step than the others is
healed: torchft's Manager has a live member send it what the method declares global
(``Strategy.global_state``: for diloco the global parameters, the outer momentum and the
counters; for ddp the parameters, the AdamW moments and the counters; in a worker of several
ranks, rank r's own slice, ``Strategy.rank_state``, from rank r of the live one; in an
FSDP-sharded worker every declared tensor is rank r's shard's, from rank r) over torchft's
process-group transport (``PGTransport``: the same reconfigured Gloo group, so healing opens no
listener of its own). A worker of R replicated ranks holds the whole declared state on every
rank: rank r sends only the r-th of R contiguous slices of each declared tensor, and the
joining group's ranks complete it by an all-gather over their own group (charged to the
worker's inner link), so the link between workers carries it once, not R times. torchft heals
the ranks of a group from different live workers (rank r from the (i + r)-th up to date): each
element of the state then comes with every tensor's same element from one worker, which keeps
a method whose workers hold different global state (eager's phi_m and own Delta) coherent.
Before a live worker's ranks ask for a quorum they gather every exchange in flight whose round
has committed (:meth:`Replica._settle_moved`: each rank reduced only its own slice of its
mean), so a joiner healed there takes the whole mean. A healed worker is not a participant of
the round it healed in (torchft's asynchronous quorum: its payload is zeroed and the mean
divides by the others): it never counts a peer's data twice. A worker's own state starts by
the method's rule (``Strategy.start_worker_state``). If that round is dropped, the healed worker asks the
retry's quorum with the torchft step it asked its admission with, so it is healed again and
sits the retry out too (:meth:`Replica.retry_round`), unless the others are too few to commit
without it (``--membership.min-workers``): it then takes part with only its own steps, its
gradient or pseudo-gradient counted as any member's and its parameters, which hold its
sender's steps, with weight 0 in a parameter average (:class:`_RoundHandle`). A worker whose
commit alone failed is a torchft step behind: it is healed at its retry's quorum, which for an
overlapping method is already the others' next round, and there takes the state at once
(:meth:`Replica.fell_behind`).

A new worker asks for its first quorum before its first step (:meth:`Replica.admit`): at a run's
start every worker waits until all ``--workers`` are in (or the quorum timeout passes), then
they commit an empty round together, so each holds torchft step 1 and a worker that starts later
(at step 0) is healed. A worker started later is admitted into the live workers' next round: it
takes the healed state, and its loop continues from the step the round belongs to.

**Listeners.** torchft's Manager binds its server to ``[::]`` and its default checkpoint
transport (HTTP) to every interface, and advertises the host name. Here every listener binds
``host`` (127.0.0.1 in a local run): the manager server through a wrapper of the
``ManagerServer`` that Manager constructs (the bind address is not one of its arguments), the
replica group's TCPStore on a socket bound here beforehand (``master_listen_fd``), Gloo on the
interface of ``GLOO_SOCKET_IFNAME`` (the local launcher sets the loopback's), and no HTTP
server at all (:class:`PGTransport`).

This module imports torchft: import it only for ``--membership torchft``
(:func:`lowcomm.membership.options.require_torchft` first).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions
from torchft import manager as torchft_manager
from torchft.checkpointing.pg_transport import PGTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from lowcomm.comm.base import (
    Comm,
    CompletedHandle,
    Handle,
    Role,
    Segments,
    Settled,
    check_scatter_shapes,
    check_segments,
)
from lowcomm.comm.base import (
    ReduceOp as LowcommReduceOp,
)
from lowcomm.comm.clock import Clock, RealClock
from lowcomm.comm.runtime import Quorum
from lowcomm.membership.options import MembershipOptions
from lowcomm.strategies.base import Strategy

__all__ = ["Replica", "RoundFailed", "TorchftComm", "TorchftMembership", "bound_store"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How often a starting worker asks again while fewer than --workers are in its quorum.
ADMISSION_POLL_S = 0.2


class RoundFailed(RuntimeError):
    """A round did not commit in --membership.attempts attempts."""


class _RecordingGloo(ProcessGroupGloo):  # type: ignore[misc]
    """torchft's reconfigurable Gloo group, remembering the members of its current quorum
    (their worker slots: the replica ids' trailing numbers, as torchft derives global ranks)."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.members: tuple[int, ...] = ()
        self.quorum_id = -1
        self.replica_rank = 0

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
            global_ranks,
        )  # fmt: skip
        # (torchft numbers rank r of replica group k as k R + r: the slot is k.)
        ranks = max(1, group_world_size or 1)
        self.members = tuple(g // ranks for g in global_ranks or ())
        self.quorum_id = -1 if quorum_id is None else quorum_id
        self.replica_rank = rank


class _TimedTransport(PGTransport):  # type: ignore[misc]
    """torchft's process-group transport, timing the last state it received."""

    last_receive_s: float | None = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        begin = time.perf_counter()
        state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.last_receive_s = time.perf_counter() - begin
        return state


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bound_store(host: str) -> tuple[Any, socket.socket]:
    """A TCPStore server listening on ``host`` only (a TCPStore made with ``is_master`` binds
    every interface): its socket is bound here and handed over. Keep the socket alive as long
    as the store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    store = dist.TCPStore(  # type: ignore[attr-defined,name-defined]
        host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
        master_listen_fd=sock.fileno(), use_libuv=True,
    )  # fmt: skip
    return store, sock


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """While Manager is constructed, its ManagerServer binds ``host`` instead of ``[::]``."""
    original = torchft_manager.ManagerServer

    def bound(**kwargs: Any) -> Any:
        _, _, port = str(kwargs["bind"]).rpartition(":")
        kwargs["bind"] = f"{_bracketed(host)}:{port}"
        return original(**kwargs)

    torchft_manager.ManagerServer = bound  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original  # type: ignore[misc]


def _group_store(
    host: str, rank: int, store_port: int | None
) -> tuple[Any, socket.socket | None, int]:
    """The replica group's store as rank ``rank`` holds it: rank 0 serves it on ``host``
    (the store, its socket and its port); another rank only knows its port."""
    if rank == 0:
        store, sock = bound_store(host)
        return store, sock, int(store.port)
    if store_port is None:
        raise ValueError(f"Replica: rank {rank} of a group needs its rank 0's store_port")
    return None, None, store_port


@dataclass
class _EarlyRound:
    """A syncing method's round opened before the worker reaches it
    (:meth:`Replica.open_round_early`), and when each round was asked for and reached
    (membership.json's commit events)."""

    steps: list[int] = field(default_factory=list)
    """The loop steps at which the worker reached its rounds (what predicts the next)."""
    holding: bool = False
    """Whether the worker holds torchft's state-dict lock (a round opened early)."""
    asked: tuple[float, int] | None = None
    """When (wall time, loop step) the open round's quorum was asked for."""
    entered: float | None = None
    """When (wall time) the worker reached the open round."""


class Replica:
    """One rank of this worker's torchft replica group: its Manager, its reconfigurable Gloo
    group (to the same rank of the other groups), and the state of the current round.

    A worker of ``--ranks-per-worker R`` is R processes, one Replica each: rank 0 serves the
    group's store and torchft's manager server (which asks the lighthouse once all R ranks
    have asked it, and commits a round only if all R ranks can); rank r's collectives and
    healing go to rank r of the other groups.

    Args:
        options: the run's ``--membership.*``.
        slot: this worker's slot (its data shard; its replica id ends in it).
        workers: the run's worker slots (``--workers``): the size of a full quorum.
        lighthouse: the lighthouse, ``HOST:PORT``.
        host: the address every listener of this worker binds and advertises (rank 0's).
        timeout_s: how long a collective, a commit or a healing transfer may take.
        rank, ranks: this process's rank in its replica group, and the group's size.
        store_port: a rank above 0: the port of the store rank 0 opened (:attr:`store_port`).
    """

    #: With R > 1 ranks: whether every rank of the group says True (a collective over the
    #: group), so that a decision taken from a rank's own clock is the group's.
    agree: Callable[[bool], bool] | None = None
    #: Whether this worker, a joiner needed for --membership.min-workers in a retry of the
    #: round it healed in, gives a parameter average its parameters with weight 0 (until the
    #: round commits: :meth:`retry_round`), and whether its payload counted in the open round.
    _weightless = False
    _counted = True
    #: With --membership.digests: the SHA-256 of each rank's slice of each declared tensor
    #: this rank was last healed with (after its group's gather).
    _took_sha256: list[list[str]] | None = None
    #: The clock readings before and after this worker took the job's time when it was last
    #: healed (None: its clock was left as it was).
    _clock_moved: tuple[float, float] | None = None

    #: With --token-budget: each round carries this worker's tokens since its last commit
    #: (:meth:`carry_count`), and :attr:`job_tokens` adds their sum over the round's
    #: participants when it commits, so every live worker holds the job's count alike.
    count_tokens: bool = False
    #: The tokens the whole job has committed (with :attr:`count_tokens`): goodput's
    #: numerator, summed over every worker's committed rounds; healed to a joiner, kept in
    #: each checkpoint (torchft.json).
    job_tokens: int = 0
    #: Whether the count leaves when the worker waits for its round (the tokens up to the
    #: step that completes it, which a method whose round's tokens commit when it completes
    #: counts: streaming_diloco, cocodc) rather than with its collective (an exchange applied
    #: syncs after its launch, whose tokens are those up to its launch: co2, eager,
    #: diloco_delayed); as a simulated run counts each. The same when both are one step.
    count_at_commit: bool = True
    #: The open round's count in flight (its work and tensor), and the tokens it carried.
    _count: tuple[Any, torch.Tensor, int] | None = None

    #: The worker's clock (set by the worker): sent with the state a joiner heals with, whose
    #: clock may take it (:meth:`_adopt_job_clock`).
    clock: Clock | None = None

    def __init__(
        self,
        options: MembershipOptions,
        *,
        slot: int,
        workers: int,
        lighthouse: str,
        host: str,
        timeout_s: float,
        rank: int = 0,
        ranks: int = 1,
        store_port: int | None = None,
    ) -> None:
        self.options = options
        self.slot, self.workers, self.rank, self.ranks = slot, workers, rank, ranks
        #: The replica group's store (rank 0 serves it; the others know its port).
        self.store, self._store_socket, self.store_port = _group_store(host, rank, store_port)
        timeout = timedelta(seconds=timeout_s)
        self.pg = _RecordingGloo(timeout)
        self.transport = _TimedTransport(self.pg, timeout, torch.device("cpu"))
        self.manager = self._manager(lighthouse, host, timeout)
        self._strategy: Strategy | None = None
        #: The loop step this worker is in (what a healed peer continues from).
        self.loop_step = 0
        self._round_open = self._joined = False
        self._healed_step: int | None = None
        #: The state a joiner took at its admission (torchft offers it again at the round's
        #: commit, which an overlapping method reaches steps later).
        self._admitted_with: object | None = None
        #: The torchft step and batch count a joiner asked for its admission with (a retry of
        #: the round it healed in asks with them again: it is healed again and sits it out).
        self._asked_as: dict[str, int] | None = None
        #: The last round collective issued (settled before a later step opens a round).
        self._in_flight: _RoundHandle | None = None
        #: Rounds committed (the startup round included) and rounds dropped.
        self.commits = self.failed_rounds = 0
        #: What happened, in order, with wall times (membership.json).
        self.events: list[dict[str, Any]] = []
        self.digests: list[dict[str, Any]] = []
        self._last_quorum, self._early = -1, _EarlyRound()
        #: Called after each event (the worker rewrites membership.json: a job's progress).
        self.on_event: Callable[[], None] | None = None
        #: Per loop step: the quorum's size, the workers it lost or gained at that step
        #: (metrics.jsonl's quorum and membership_events), and the steps a round was dropped.
        self.step_quorum: dict[int, int] = {}
        self.step_changes: dict[int, list[dict[str, object]]] = {}
        self.dropped_steps: set[int] = set()
        self._members: tuple[int, ...] = ()
        #: Tokens this worker trained since its last committed round, and the tokens its
        #: committed rounds kept (goodput): a round it sat out (healing) keeps none of its own.
        self.pending_tokens = self.committed_tokens = 0
        #: The wall time this worker ended its last step (None: it has not).
        self.trained_until: float | None = None
        #: The bytes this rank's worker gathered among its ranks when it was last healed (a
        #: replicated worker's sliced payload, :meth:`_whole_state`).
        self.gathered_bytes = 0

    def _manager(self, lighthouse: str, host: str, timeout: timedelta) -> Manager:
        """This rank's torchft Manager: its server and the group's store on ``host``."""
        options = self.options
        address = lighthouse if lighthouse.startswith("http://") else f"http://{lighthouse}"
        with _manager_server_on(host):
            return Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=self._save,
                min_replica_size=options.min_workers, use_async_quorum=True, timeout=timeout,
                quorum_timeout=timedelta(seconds=options.quorum_s),
                connect_timeout=timedelta(seconds=min(options.quorum_s, 30.0)),
                rank=self.rank, world_size=self.ranks, store_addr=host,
                store_port=self.store_port, lighthouse_addr=address,
                replica_id=f"lowcomm_worker_{self.slot}", port=0, hostname=host,
                checkpoint_transport=self.transport, init_sync=False,
            )  # fmt: skip

    # --- the method's state (the Manager's state dict callbacks) ------------------------

    def attach(self, strategy: Strategy) -> None:
        """The strategy whose declared global state heals a joiner."""
        self._strategy = strategy

    def _save(self) -> dict[str, Any]:
        """What a joiner receives: the declared global tensors and counters, and the loop
        step this worker is in (called on torchft's quorum thread while this worker waits in
        its round, or, for ddp, computes a gradient, which none of these tensors is; a round
        opened early holds the state-dict lock until the worker reaches it).

        A worker of R replicated ranks holds the whole declared state on every rank, so rank
        r sends only the r-th of R contiguous slices of each tensor (``layout`` says how they
        are cut back into tensors): the joining group's ranks complete it by an all-gather
        among themselves (:meth:`_whole_state`), and the link between workers carries the
        state once, not R times. (torchft may heal each rank from another live worker: an
        element of every tensor comes from the same one, so the joiner's state is, element by
        element, one live worker's.)"""
        assert self._strategy is not None
        tensors, counters = self._strategy.healing_payload()
        # (A worker of several ranks: each rank's own slice, which torchft sends to the same
        # rank of the joining group.)
        ranks = [tensor for _, tensor in self._strategy.rank_state()]
        payload: dict[str, Any] = {
            "tensors": tensors, "rank_tensors": ranks, "counters": counters,
            "loop_step": self.loop_step, "layout": None, "job_tokens": self.job_tokens,
            "clock": self._clock_reading(),
        }  # fmt: skip
        if self.options.digests:  # (what the joiner must take, before any slicing)
            payload["sha256"] = _slice_digests(tensors, self.ranks)
        if self._replica_group() is not None:
            payload["layout"] = [(tuple(t.shape), t.dtype) for t in tensors]
            payload["tensors"] = [_rank_slice(tensors, self.rank, self.ranks)]
        return payload

    def _clock_reading(self) -> float | None:
        """This worker's real clock now, the job's time a joiner of a method that compares
        its learners' clocks takes (:meth:`_adopt_job_clock`); None for any other method or
        clock. Read on torchft's quorum thread, so without folding the worker's compute
        (``RealClock.at``), which only the worker's own thread does."""
        clock = self.clock
        if not isinstance(clock, RealClock):
            return None
        if not getattr(self._strategy, "compares_clocks", False):
            return None
        return clock.at(time.perf_counter())

    def _replica_group(self) -> Comm | None:
        """The charged group of this worker's R ranks when they are replicas (each holding
        the whole declared state), else None (one rank, or FSDP-sharded ranks, each of whose
        declared tensors is its own shard's)."""
        assert self._strategy is not None
        return self._strategy.runtime.replica_group if self.ranks > 1 else None

    def _whole_state(self, payload: dict[str, Any]) -> tuple[list[torch.Tensor], int]:
        """The declared tensors of a received payload, and the bytes gathered for them inside
        this worker: a sliced payload (:meth:`_save`) is completed by an all-gather of every
        rank's slice over the worker's own group (every rank of a joining group is healed in
        the same round, so each calls this), charged to its link as the group's other
        collectives."""
        layout = payload["layout"]
        if layout is None:
            return list(payload["tensors"]), 0
        group = self._replica_group()
        assert group is not None, "a sliced healing payload reached a worker of one rank"
        items = [(math.prod(shape), _itemsize(dtype)) for shape, dtype in layout]
        ranges = [_element_ranges(numel, self.ranks) for numel, _ in items]
        # (rank 0's piece is the longest: every rank pads its own to it for the gather)
        first = [
            (limits[0][1] - limits[0][0]) * size
            for limits, (_, size) in zip(ranges, items, strict=True)
        ]
        chunk = max(1, sum(first))
        piece = payload["tensors"][0].reshape(-1).view(torch.uint8)
        mine = torch.zeros(chunk, dtype=torch.uint8)
        mine[: piece.numel()].copy_(piece)
        whole = torch.empty(chunk * self.ranks, dtype=torch.uint8)
        group.all_gather(whole, mine, role=Role.OTHER).wait()
        flats = [torch.empty(numel * size, dtype=torch.uint8) for numel, size in items]
        for rank in range(self.ranks):
            offset = rank * chunk
            for flat, limits, (_, size) in zip(flats, ranges, items, strict=True):
                start, stop = (limit * size for limit in limits[rank])
                flat[start:stop].copy_(whole[offset : offset + stop - start])
                offset += stop - start
        tensors = [
            flat.view(dtype).view(shape) for flat, (shape, dtype) in zip(flats, layout, strict=True)
        ]
        return tensors, whole.numel()

    def _load(self, payload: dict[str, Any]) -> None:
        """The Manager applies the healed state when the round commits (after its
        collective, before the strategy uses the result). A joiner took it already at its
        admission, before its first step: applied again at the commit, it would put back
        the state of the round's start, which a method whose all-reduce flies across inner
        steps (co2, cocodc, streaming_diloco) has since moved on from."""
        if payload is self._admitted_with:
            return
        self._apply(payload, rewind=False)

    def _apply(self, payload: dict[str, Any], *, rewind: bool) -> None:
        """Take a live member's global state and start this worker's own by the method's
        rule. ``rewind``: before this worker's first step, the member is inside its loop step
        (past its inner step, for a method that syncs after it), which this worker then takes
        itself: its counters go back by the steps the member has taken into that loop step."""
        strategy = self._strategy
        assert strategy is not None
        counters = {name: int(value) for name, value in payload["counters"].items()}
        step = int(payload["loop_step"])
        if rewind:
            ahead = counters["step_index"] - step
            counters["step_index"] -= ahead
            if "local_steps" in counters:
                counters["local_steps"] -= ahead
        tensors, self.gathered_bytes = self._whole_state(payload)
        if self.options.digests:
            self._took_sha256 = _slice_digests(tensors, self.ranks)
        strategy.take_healing_payload(tensors, counters)
        with torch.no_grad():
            mine = strategy.rank_state()
            for (_, tensor), theirs in zip(mine, payload["rank_tensors"], strict=True):
                tensor.copy_(theirs)
        self._adopt_job_clock(strategy, payload.get("clock"))
        strategy.start_worker_state(kept=False)
        self._healed_step = step
        if self.count_tokens:
            # The job's count as its source knew it before this round; the tokens this
            # worker trained before it took the state are not in the state it continues from.
            self.job_tokens = int(payload["job_tokens"])
            self.pending_tokens = 0

    def _adopt_job_clock(self, strategy: Strategy, job: float | None) -> None:
        """On the real clock each worker process reads its clock from its own start, so a
        worker started while the others train reads less than the job's time. A method whose
        learners compare their clocks (``compares_clocks``: decoupled_diloco's synchronizer
        merges once every live learner's clock has passed the merge) has this worker's clock
        read ``job`` from here on, its healing source's clock when it sent the state
        (:meth:`_save`): it neither waits for its own clock to catch up nor holds the others'
        merges back; it trails its source by the transfer, no more. (On the virtual clock the
        method's join rule moves the clock itself, a modeled wait: ``job`` is None.)"""
        clock = self.clock
        self._clock_moved = None
        if clock is None or job is None or not getattr(strategy, "compares_clocks", False):
            return
        now = clock.now()
        if job > now:
            clock.load_state_dict({**clock.state_dict(), "now": job})
            self._clock_moved = (now, job)

    def _log(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event()

    def quorum_size_at(self, step: int) -> int | None:
        """The size of the quorum this worker's step ``step`` ran in (the last one formed at
        or before it; None before the first)."""
        known = [s for s in self.step_quorum if s <= step]
        return self.step_quorum[max(known)] if known else None

    def take_healed_step(self) -> int | None:
        """The loop step of the state this worker was last healed with (once; None: not
        healed since the last call)."""
        step, self._healed_step = self._healed_step, None
        return step

    # --- rounds ---------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether this worker has asked for a quorum yet."""
        return self._last_quorum >= 0 or self._round_open

    def open_round(self) -> None:
        """Open a round (ask for a quorum; it forms in the background) unless one is open.

        torchft runs one round at a time. A method that launches its next exchange before it
        applies the one in flight (eager, diloco_delayed) opens the next round while that one
        is open: its collective, issued at an earlier step, is waited for and committed (or
        tried again on a new quorum) first; the method still applies its result where its
        equations do."""
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done() and in_flight.step != self.loop_step:
            in_flight.wait()
        if not self._round_open:
            self._settle_moved()
            self._ask()

    def _settle_moved(self) -> None:
        """Before asking for a quorum, at which torchft's quorum thread may send a joiner the
        exchanges in flight: finish the data movement of those whose rounds have committed
        (every earlier round has). On a worker of several ranks each rank has reduced only
        its own slice of such a mean; the worker's ranks gather it here, together (each rank
        asks at the same point of the method), as the method's wait would later."""
        settle = getattr(self._strategy, "settle_moved", None)
        if settle is not None:
            settle()

    def _ask(self) -> None:
        """Ask torchft for the open round's quorum (it forms in the background)."""
        self._early.asked = (time.time(), self.loop_step)
        self.manager.start_quorum(allow_heal=True, timeout=timedelta(seconds=self.options.quorum_s))
        self._round_open = True

    def open_round_early(self) -> None:
        """At the start of a loop step of a method that syncs every H steps: open the round
        this step's end is expected to enter, so its quorum forms while the step computes.

        The step is the one the period of the worker's last two rounds names (none before
        its second round, and none while a round is open or its collective in flight: that
        one is settled where the method's equations say). Until the worker reaches the round
        it holds torchft's state-dict lock, so a peer healed at this quorum receives the
        method's global state from its sync, not from inside the step. A step that turns out
        not to enter a round keeps the round open (and the lock held) until one does: it is
        then that round's quorum."""
        steps = self._early.steps
        if self._round_open or len(steps) < 2 or self.loop_step != 2 * steps[-1] - steps[-2]:
            return
        if self._in_flight is not None and not self._in_flight.done():
            return
        self.manager.disallow_state_dict_read()
        self._early.holding = True
        self.open_round()

    def reach_round(self) -> None:
        """The worker has reached its round (the strategy enters it or issues its
        collective): a peer may now read its state, and the step is remembered."""
        if not self._early.steps or self._early.steps[-1] != self.loop_step:
            self._early.steps.append(self.loop_step)
        if self._early.entered is None:
            self._early.entered = time.time()
        self._release()

    def needs_quorum(self) -> None:
        """The worker is about to wait for its open round's quorum before it reaches the
        round (a step that prices a message by the round's participants, decoupled_diloco's
        send of a fragment): a round opened early releases the state-dict lock first. torchft
        has this worker send a joiner healed at that quorum its state from inside the
        quorum, which waits for the lock: held, the worker and the joiner (and the peers in
        the round, waiting for both) would wait for each other. Once the quorum has formed,
        any healing at it is done and the lock stays held until the round."""
        future = getattr(self.manager, "_quorum_future", None)
        if future is not None and not future.done():
            self._release()

    def _release(self) -> None:
        if self._early.holding:
            self._early.holding = False
            self.manager.allow_state_dict_read()

    def wait_quorum(self) -> Quorum:
        """The open round's quorum, once formed."""
        self._release()  # (a peer's healing reads this worker's state inside the quorum)
        self.manager.wait_quorum()
        self._note_quorum()
        return self.quorum()

    def quorum(self) -> Quorum:
        members = tuple(sorted(self.pg.members)) or (self.slot,)
        return Quorum(members, max(self.pg.quorum_id, 0), joined=self._joined)

    def _note_quorum(self) -> None:
        if self.pg.quorum_id != self._last_quorum:
            self._last_quorum = self.pg.quorum_id
            members = tuple(sorted(self.pg.members))
            # (Before the first committed round the job is still assembling: workers that
            # arrive then are its members from the start, not joins.)
            if self._members and self.commits > 0:
                changes: list[dict[str, object]] = [
                    {"worker": w, "kind": "crash"} for w in self._members if w not in members
                ]
                changes += [
                    {"worker": w, "kind": "join"} for w in members if w not in self._members
                ]
                if changes:
                    self.step_changes.setdefault(self.loop_step, []).extend(changes)
            self._members = members
            self.step_quorum[self.loop_step] = len(members)
            self._log({
                "event": "quorum", "time": time.time(), "step": self.loop_step,
                "quorum_id": self.pg.quorum_id, "members": sorted(self.pg.members),
                "participants": self.manager.num_participants(),
            })  # fmt: skip

    def healing(self) -> bool:
        """Whether this worker is being healed in the open round (its quorum is formed)."""
        return bool(getattr(self.manager, "_healing", False))

    def commit(self) -> bool:
        """End the open round: whether torchft commits it (every collective completed and
        enough workers took part)."""
        started = time.time()
        participating = bool(self.manager.is_participating())
        if self._joined and self.healing():
            # (Healed again on a retry of the round it healed in: torchft offers that state
            # at the commit; it keeps the state it took at its admission, which the dropped
            # attempt left current, and which an overlapping method has moved on from.)
            pending = getattr(self.manager, "_pending_state_dict", None)
            if pending is not None:
                payload = pending["user"]["default"]
                self._admitted_with = payload
                if self.count_tokens:
                    self.job_tokens = int(payload["job_tokens"])
        carried, counted = self._take_count()  # (before the commit: a failed count drops it)
        committed = bool(self.manager.should_commit())
        if committed:
            self._keep_tokens(carried, counted, participating and self._counted)
            if not self._counted:  # (a joiner forced into a retry: its steps in it are lost)
                self.pending_tokens = 0
            self._weightless, self._counted = False, True
        asked, asked_step = self._early.asked if self._early.asked is not None else (None, None)
        event = {
            "event": "commit" if committed else "dropped", "time": time.time(),
            "step": self.loop_step, "quorum_id": self.pg.quorum_id, "waited_s": time.time() - started,
            "asked": asked, "asked_step": asked_step, "entered": self._early.entered,
        }  # fmt: skip
        if committed and self.count_tokens:
            event["job_tokens"] = self.job_tokens
        self._log(event)
        self._early.asked = self._early.entered = None
        if committed:
            self.commits += 1
            self._round_open = False
            self._joined = False
        else:
            self.failed_rounds += 1
            self.dropped_steps.add(self.loop_step)
            error = self.manager.errored()
            cause = "" if error is None else f" ({_first_line(error.original_exception)})"
            print(
                f"lowcomm: worker {self.slot}: the round at step {self.loop_step} did not "
                f"commit{cause}; trying it again on a new quorum",
                file=sys.stderr,
                flush=True,
            )
        return committed

    def _keep_tokens(self, carried: int | None, counted: int, participating: bool) -> None:
        """A committed round keeps the tokens it carried (a member that sat it out keeps
        none of its own) and adds their sum over its participants to the job's count. Without
        a count every pending token is kept; with one, a round that carried none (the startup
        round) keeps none, and the tokens trained after the count left stay pending for the
        next round (an exchange that flies across steps)."""
        if carried is None:
            carried = 0 if self.count_tokens else self.pending_tokens
        self.committed_tokens += carried if participating else 0
        # (A worker healed at this commit has started its own count afresh: none is left.)
        self.pending_tokens = max(self.pending_tokens - carried, 0)
        self.job_tokens += counted

    def carry_count(self) -> None:
        """With a token budget: the open round carries this worker's tokens since its last
        commit, in one 8-byte sum over the round's quorum issued right behind its first
        collective on the same group (with it, or when the worker waits for it:
        :attr:`count_at_commit`), uncharged, as a static run's count on its bookkeeping
        group. torchft zeroes a member that sits the round out (a healing one), and a worker
        that dies takes its uncounted tokens with it."""
        if not self.count_tokens or self._count is not None:
            return
        # (A payload that does not count, a joiner's parameters with weight 0 in a retry,
        # carries no tokens: the round keeps none of that worker's.)
        carried = self.pending_tokens if self._counted else 0
        tensor = torch.tensor([carried], dtype=torch.int64)
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
        self._count = (work, tensor, carried)

    def _take_count(self) -> tuple[int | None, int]:
        """The tokens the open round carried for this worker (None: it carried no count) and
        their sum over the round's participants, once the count has arrived; a count that
        failed is reported to the Manager, so the round does not commit."""
        count, self._count = self._count, None
        if count is None:
            return None, 0
        work, tensor, carried = count
        try:
            work.wait()
        except Exception as error:
            self.manager.report_error(error)
            return carried, 0
        return carried, int(tensor[0])

    def retry_round(self) -> None:
        """Open the round again on a new quorum after it did not commit.

        A joiner healed in this round sits it out (its payload was zeroed and the mean
        divided by the others). On the retry torchft would count it in, its torchft step
        being the others' since its healing, with its saved payload: the parameters it
        took from its sender, for the local family, count that member's steps twice, and
        an exchange whose mean the method weighs by its launch quorum's participants (eager,
        diloco_delayed) would divide by one more. So it asks with the step it asked its
        admission with: torchft heals it again, and it sits the retry out too. It sits out
        only while the others are enough to commit without it (``--membership.min-workers``;
        the failed round's quorum stands for the retry's): a round that needs it could
        otherwise never commit. It then takes part in the retry (torchft counts it towards
        the minimum) with only its own steps: a gradient or pseudo-gradient it computed from
        the state it took is its own, counted as any member's; its parameters hold its
        sender's steps, so a parameter average takes them with weight 0 (the mean is the
        others', :class:`_RoundHandle`), and the joiner's tokens of the round are not kept."""
        others = len(self.quorum().members) - 1
        if self._joined and self._asked_as is not None:
            if others >= self.options.min_workers:
                self.manager.load_state_dict(dict(self._asked_as))
            else:
                self._weightless = True
        # (Not open_round: the round retried may be the one in flight it would wait for.)
        self._ask()

    def admit(self) -> int:
        """This worker's first quorum; the loop step it starts at.

        At a run's start the workers ask until a quorum holds all ``--workers`` of them (or
        the quorum timeout passed with at least ``--membership.min-workers``), then commit an
        empty round together. A worker whose quorum finds the others further on is healed
        from one of them: its round stays open (it is the live workers' round, whose
        collectives this worker joins in its first step) and it starts at their loop step."""
        deadline = time.monotonic() + self.options.quorum_s
        while True:
            asked_as = {
                "step": self.manager.current_step(),
                "batches_committed": self.manager.batches_committed(),
            }
            self.open_round()
            began = time.time()
            quorum = self._wait_admission()
            if self.manager.errored() is None and self.healing():
                self._asked_as = asked_as
                return self._take_admission(quorum, began)
            full = quorum.size >= self.workers
            late = time.monotonic() >= deadline and quorum.size >= self.options.min_workers
            ready = self.manager.errored() is None and (full or late)
            if self.agree is not None:  # (every rank of the group commits, or none)
                ready = self.agree(ready)
            if ready and self.commit():
                return 0
            self._round_open = False
            if time.monotonic() >= deadline + self.options.quorum_s:
                raise RoundFailed(
                    f"worker {self.slot}: no quorum of --membership.min-workers "
                    f"{self.options.min_workers} formed within "
                    f"{2 * self.options.quorum_s:g} s (the last had {quorum.size})"
                )
            time.sleep(ADMISSION_POLL_S)

    def _wait_admission(self) -> Quorum:
        """The quorum this starting worker asked for, once formed and (if it heals) healed.

        torchft bounds the quorum by the quorum timeout but the healing inside it only by the
        collective timeout, and a joiner that never gets its state would wait that long while
        the live workers wait for it in their round: once twice the quorum timeout has passed
        (the quorum's own, then as long again for its group and healing, as the admission's
        other deadline allows) the worker gives up in one line instead."""
        import concurrent.futures

        self._release()
        future = getattr(self.manager, "_quorum_future", None)
        if future is not None:
            limit = 2 * self.options.quorum_s
            try:
                future.result(timeout=limit)
            except concurrent.futures.TimeoutError:
                raise RoundFailed(
                    f"worker {self.slot}: not admitted: its quorum and healing did not "
                    f"complete within {limit:g} s (twice --membership.quorum-s "
                    f"{self.options.quorum_s:g}); the live workers' state never reached it"
                ) from None
        return self.wait_quorum()

    def _take_admission(self, quorum: Quorum, began: float) -> int:
        """Take the state torchft healed this starting worker with; the loop step it
        starts at (the live workers' round's)."""
        pending = getattr(self.manager, "_pending_state_dict", None)
        if pending is None:
            raise RoundFailed(f"worker {self.slot}: torchft reported healing but received no state")
        payload = pending["user"]["default"]
        self._apply(payload, rewind=True)
        self._healed_with(payload, began, quorum.members)
        self.loop_step = int(payload["loop_step"])
        return self.take_healed_step() or self.loop_step

    def _healed_with(self, payload: dict[str, Any], began: float, members: tuple[int, ...]) -> None:
        """This worker took ``payload`` (applied): it sits out the round it healed in, whose
        commit offers the payload again (not applied again), and says so (``healed``)."""
        self._admitted_with = payload
        self._joined = True
        healed: dict[str, Any] = {
            "event": "healed", "time": time.time(), "asked": began,
            "step": int(payload["loop_step"]), **_healed_bytes(payload),
            "gathered_bytes": self.gathered_bytes,
            "transfer_s": self.transport.last_receive_s, "members": list(members),
        }  # fmt: skip
        if self.options.digests and self._strategy is not None:  # (what it took)
            healed["global_sha256"] = _sha256(_global_parameters(self._strategy))
            # (Per declared tensor, the digest of each rank's slice of it: of the whole state
            # as its sender held it, and as this rank assembled it, slice r' from the sender
            # of rank r'.)
            healed["sent_sha256"] = payload.get("sha256")
            healed["took_sha256"] = self._took_sha256
        if self.count_tokens:  # (the job's committed tokens, as its source held them)
            healed["job_tokens"] = self.job_tokens
        if self._clock_moved is not None:  # (its clock before, and the job's time it took)
            healed["clock_from"], healed["clock_to"] = self._clock_moved
        self._log(healed)

    def fell_behind(self, step: int) -> bool:
        """After a retry's quorum, for a round whose collective this worker issued at an
        earlier loop step ``step`` (an overlapping method's, waited steps later): whether the
        others had committed it (this worker's commit alone failed) and this quorum, their
        next round's, heals this worker. It then takes the state at once, as a joiner does
        at its admission: the round is settled for it (the state holds its result), this
        quorum is its next round's, which it sits out, and it issues nothing more for the
        round. Healed instead at the round's commit, it would enter its next round on a
        quorum of its own, a round behind the others from then on."""
        if step == self.loop_step or self._joined:
            return False
        began = time.time()
        quorum = self.wait_quorum()
        pending = getattr(self.manager, "_pending_state_dict", None)
        if self.manager.errored() is not None or not self.healing() or pending is None:
            return False
        payload = pending["user"]["default"]
        # (It has taken the payload's step already: nothing to rewind.)
        self._apply(payload, rewind=False)
        self._healed_with(payload, began, quorum.members)
        # (A retry of that round asks as one behind: it is healed again and sits it out.)
        self._asked_as = {
            "step": int(self.manager.current_step()) - 1,
            "batches_committed": int(self.manager.batches_committed()),
        }
        return True

    def record_digest(self, step: int, parameters: Iterator[torch.Tensor]) -> None:
        """A SHA-256 of the parameters after a committed round (of a sharded worker's, this
        rank's own shards: rank r's are compared with rank r's of another worker), and one of the global
        parameters the method declares (``global_sha256``): where a worker's own parameters
        differ from its peers' by design (cocodc's local progress, eager's phi_m), these are
        what healing transfers and, but for eager, what every worker holds alike."""
        entry = {"step": step, "sha256": _sha256(parameters)}
        if self._strategy is not None:
            entry["global_sha256"] = _sha256(_global_parameters(self._strategy))
        self.digests.append(entry)

    def shutdown(self) -> None:
        """Stop the manager server (its heartbeats) and the group."""
        with contextlib.suppress(Exception):
            self._release()
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self.pg.abort(errored=False)
        if self._store_socket is not None:
            with contextlib.suppress(OSError):
                self._store_socket.close()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _element_ranges(numel: int, ranks: int) -> list[tuple[int, int]]:
    """The ``ranks`` contiguous slices of a tensor of ``numel`` elements, as (start, stop)
    element indices: ``ceil(numel / ranks)`` elements each, the last shorter (or empty)."""
    chunk = -(-numel // ranks)
    return [(min(r * chunk, numel), min((r + 1) * chunk, numel)) for r in range(ranks)]


def _rank_slice(tensors: list[torch.Tensor], rank: int, ranks: int) -> torch.Tensor:
    """The ``rank``-th of ``ranks`` contiguous slices of each of ``tensors`` (whole elements),
    their bytes laid end to end in a storage of its own (torchft's transport sends a tensor's
    whole storage)."""
    pieces = []
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1)
        start, stop = _element_ranges(flat.numel(), ranks)[rank]
        pieces.append(flat[start:stop].view(torch.uint8))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def _slice_digests(tensors: list[torch.Tensor], ranks: int) -> list[list[str]]:
    """Per tensor, the SHA-256 of each of its ``ranks`` slices (:func:`_rank_slice`'s)."""
    digests = []
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1)
        ranges = _element_ranges(flat.numel(), ranks)
        digests.append([_sha256([flat[start:stop]]) for start, stop in ranges])
    return digests


def _healed_bytes(payload: dict[str, Any]) -> dict[str, int]:
    """A healed rank's bytes: those it received from its live peer (``bytes``, as torchft's
    transport sends them: each tensor's whole storage) and the declared state it took
    (``state_bytes``: the whole of a sliced payload's tensors, and its own rank slices)."""
    received = [*payload["tensors"], *payload["rank_tensors"]]
    layout = payload["layout"]
    declared = (
        sum(int(t.numel()) * t.element_size() for t in payload["tensors"])
        if layout is None
        else sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in layout)
    )
    ranks = sum(int(t.numel()) * t.element_size() for t in payload["rank_tensors"])
    return {
        "bytes": sum(int(t.untyped_storage().nbytes()) for t in received),
        "state_bytes": declared + ranks,
    }


def _sha256(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _global_parameters(strategy: Strategy) -> list[torch.Tensor]:
    """The parameters among what ``strategy`` declares global (its outer parameters, or for
    a method that keeps none, the parameters themselves)."""
    tensors, _ = strategy.global_state()
    return [tensor for role, tensor in tensors if role == Role.PARAMETER]


def _round_failed(replica: Replica) -> RoundFailed:
    """The error that ends a worker whose round did not commit in --membership.attempts."""
    error = replica.manager.errored()
    cause = "" if error is None else f": {_first_line(error.original_exception)}"
    return RoundFailed(
        f"worker {replica.slot}: the round at step {replica.loop_step} did not commit in "
        f"{replica.options.attempts} attempts (--membership.attempts){cause}"
    )


class _RoundHandle:
    """The round's payload in flight; ``wait()`` returns once a round committed it (tried
    again on a new quorum if one did not; see the module docstring).

    ``weighted`` (a mean of parameters): each worker sends its payload and a trailing weight,
    1, or 0 with a zero payload for a joiner whose parameters must not count
    (:meth:`Replica.retry_round`); the sum is divided by the weights' sum. torchft zeroes a
    healing member's payload, weight included, so with no such joiner the weights' sum is the
    round's participants, torchft's own divisor."""

    def __init__(
        self,
        replica: Replica,
        tensor: torch.Tensor,
        op: LowcommReduceOp,
        *,
        commits: bool = True,
        weighted: bool = False,
    ) -> None:
        self._replica = replica
        self._tensor = tensor
        self._op = op
        self._input = tensor.detach().clone()  # (a dropped round starts again from it)
        self._wire: torch.Tensor | None = None
        self._weighted = weighted and op == "mean"
        self.step = replica.loop_step
        self._work = self._issue()
        self._done = False
        #: False: one collective of a round that holds several (TorchftComm.run_round), which
        #: commits the round and tries it again itself.
        self._commits = commits
        if commits:
            replica._in_flight = self

    def _issue(self) -> Any:
        replica = self._replica
        if not self._weighted:
            reduce = ReduceOp.AVG if self._op == "mean" else ReduceOp.SUM
            work = replica.manager.allreduce(self._tensor, reduce_op=reduce)
        else:
            replica._counted = not replica._weightless
            wire = self._input.new_zeros(self._input.numel() + 1)
            if replica._counted:
                wire[:-1].copy_(self._input.reshape(-1))
                wire[-1] = 1
            self._wire = wire
            work = replica.manager.allreduce(wire, reduce_op=ReduceOp.SUM)
        if not replica.count_at_commit:
            replica.carry_count()
        return work

    def _place(self) -> None:
        """A weighted round's committed sum, divided by its weights' sum, into the tensor."""
        wire, self._wire = self._wire, None
        if wire is None:
            return
        weights = round(float(wire[-1]))
        with torch.no_grad():
            if weights > 0:  # (else no worker counted: the tensor keeps its input)
                self._tensor.copy_((wire[:-1] / weights).reshape(self._tensor.shape))

    def wait(self) -> None:
        if self._done:
            return
        if not self._commits:
            self._work.wait()  # (an error is reported to the Manager: the round is dropped)
            self._place()
            self._done = True
            return
        replica = self._replica
        attempts = replica.options.attempts
        for attempt in range(1, attempts + 1):
            replica.carry_count()  # (if the collective did not carry it)
            self._work.wait()  # (an error is reported to the Manager, which then drops it)
            replica._note_quorum()
            if replica.commit():
                self._place()
                self._done = True
                return
            if attempt == attempts:
                break
            with torch.no_grad():
                self._tensor.copy_(self._input)
            replica.retry_round()
            if replica.fell_behind(self.step):  # (the others committed it: it heals instead)
                self._done = True
                return
            self._work = self._issue()
        raise _round_failed(replica)

    def done(self) -> bool:
        return self._done

    def settle(self) -> Settled:
        self.wait()
        return Settled()


class _MaxHandle:
    """A max over the round's members (the virtual clock's agreement on a launch time)
    outside the commit: a failure is reported to the Manager, which drops the round's
    commit, and the tensor keeps this worker's value."""

    def __init__(self, replica: Replica, tensor: torch.Tensor) -> None:
        self._replica = replica
        self._tensor = tensor
        self._input = tensor.detach().clone()
        self._work: Any = None
        manager = replica.manager
        manager.wait_quorum()
        if manager.errored() is None:
            options = AllreduceOptions()
            options.reduceOp = ReduceOp.MAX  # type: ignore[assignment]
            try:
                self._work = replica.pg.allreduce([tensor], options)
            except Exception as error:  # (the group could not issue it: a broken quorum)
                manager.report_error(error)

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        try:
            work.wait()
        except Exception as error:
            self._replica.manager.report_error(error)
            with torch.no_grad():
                self._tensor.copy_(self._input)

    def done(self) -> bool:
        return self._work is None

    def settle(self) -> Settled:
        self.wait()
        return Settled()


class _GatherHandle:
    """The round's all-gather: every participant's ``input``, in slot order, written into
    ``output``; ``wait()`` returns once a round committed it (tried again on a new quorum
    from the saved input if one did not, as :class:`_RoundHandle`).

    torchft's Manager wraps only the all-reduce, so the gather runs on its reconfigured
    group directly, over every member of the round's quorum, and reports a failure to the
    Manager, which then drops the round's commit on every member. A member being healed in
    the round takes part in the collective (the group holds it) but not in the result: each
    member sends a trailing flag byte saying whether it participates, and only the
    participants' rows are kept, so the output has one row per participant
    (``Manager.num_participants()``, what ``TorchftComm.world_size`` says) and a healer's
    data never counts, nor a peer's twice. A retry's quorum may hold another number of
    participants: ``output`` is then resized to it (read the count from ``output.numel()``
    after ``wait()``)."""

    def __init__(
        self, replica: Replica, output: torch.Tensor, input: torch.Tensor, *, commits: bool = True
    ) -> None:
        self._replica = replica
        self._output = output
        self._input = input.detach().reshape(-1).clone()  # (a dropped round resends it)
        self._rows: list[torch.Tensor] = []
        #: False: one collective of a round that holds several (TorchftComm.run_round).
        self._commits = commits
        self._failed = False  # (this attempt's rows are not the round's)
        self._work = self._issue()
        self._done = False

    def _issue(self) -> Any:
        """Start the gather of this round's quorum (None: the round has already failed)."""
        manager = self._replica.manager
        manager.wait_quorum()
        self._failed = True
        if manager.errored() is not None:
            return None
        flag = torch.tensor([1 if manager.is_participating() else 0], dtype=torch.uint8)
        wire = torch.cat([self._input.view(torch.uint8), flag])
        self._rows = [torch.empty_like(wire) for _ in self._replica.pg.members]
        try:
            work = self._replica.pg.allgather([self._rows], [wire], AllgatherOptions())
        except Exception as error:  # (the group could not issue it: a broken quorum)
            manager.report_error(error)
            return None
        self._failed = False
        if not self._replica.count_at_commit:
            self._replica.carry_count()
        return work

    def _finish(self) -> None:
        """Wait for the gather; a failure, or rows that disagree with the quorum's
        participants, is reported to the Manager (the round then does not commit)."""
        manager = self._replica.manager
        work, self._work = self._work, None
        if work is None:
            return
        try:
            work.wait()
        except Exception as error:
            manager.report_error(error)
            self._failed = True
            return
        participants = sum(int(row[-1]) for row in self._rows)
        if participants != manager.num_participants():
            self._failed = True
            manager.report_error(
                RuntimeError(
                    f"all_gather: {participants} rows flagged participating, the quorum has "
                    f"{manager.num_participants()} participants"
                )
            )

    def _place(self) -> None:
        """The participants' rows, in slot order, into ``output``."""
        kept = self._participants()
        count = self._input.numel()
        if self._output.numel() != len(kept) * count:
            self._output.resize_(len(kept) * count)
        flat = self._output.view(-1).view(torch.uint8)
        with torch.no_grad():
            flat.copy_(torch.cat(kept))

    def _participants(self) -> list[torch.Tensor]:
        """The participants' rows, in slot order, without their flag bytes."""
        return [self._rows[i][:-1] for i in self._participant_rows()]

    def _participant_rows(self) -> list[int]:
        """The indices of the participants' rows, in slot order."""
        members = self._replica.pg.members
        order = sorted(range(len(members)), key=lambda index: members[index])
        return [i for i in order if int(self._rows[i][-1]) == 1]

    def wait(self) -> None:
        if self._done:
            return
        if not self._commits:
            # (One collective of several in the round: a failure leaves zeros, which the
            # round, not committed, never lets the strategy keep.)
            self._finish()
            if not self._failed:
                self._place()
            else:
                with torch.no_grad():
                    self._output.zero_()
            self._done = True
            return
        replica = self._replica
        attempts = replica.options.attempts
        for attempt in range(1, attempts + 1):
            replica.carry_count()  # (if the gather did not carry it)
            self._finish()
            replica._note_quorum()
            if replica.commit():
                self._place()
                self._done = True
                return
            if attempt == attempts:
                break
            replica.retry_round()
            self._work = self._issue()
        raise _round_failed(replica)

    def done(self) -> bool:
        return self._done

    def settle(self) -> Settled:
        self.wait()
        return Settled()


class _AllToAllHandle(_GatherHandle):
    """An all-to-all among the round's participants, one collective of a round that holds
    several (:meth:`TorchftComm.run_round`, which commits it): chunk j of every
    participant's ``input`` (``world_size`` chunks, the participants'), in slot order, into
    ``output`` of the j-th participant in slot order.

    torchft's Manager wraps no all-to-all, so it runs as a gather on the round's group (every
    member's whole input with its participation flag, as :class:`_GatherHandle`) of which
    each member keeps its own chunks: a member being healed in the round takes part in the
    collective but not in the result, and receives zeros (it sits the round out)."""

    def __init__(self, replica: Replica, output: torch.Tensor, input: torch.Tensor) -> None:
        super().__init__(replica, output, input, commits=False)

    def _place(self) -> None:
        replica = self._replica
        rows = self._participant_rows()
        slots = [replica.pg.members[i] for i in rows]
        flat = self._output.view(-1).view(torch.uint8)
        with torch.no_grad():
            if replica.slot not in slots:
                flat.zero_()
                return
            mine = slots.index(replica.slot)
            chunks = [self._rows[i][:-1].view(len(rows), -1)[mine] for i in rows]
            flat.copy_(torch.cat(chunks))


class TorchftComm:
    """The strategy's raw ``Comm`` between workers, over this worker's :class:`Replica`.

    Before the worker starts (set-up) it is a group of ``--workers`` in which this worker has
    its slot's rank (so set-up takes the slot's data shard) and a broadcast changes nothing
    (every worker builds the same model from the run's seed; torchft's ``init_sync`` is off).
    Then its rank and size are those of the current round.
    """

    #: Each collective is a committed round over its quorum's participants: an all-gather's
    #: rows are theirs alone, in slot order (a method that learns who sent which row reads it
    #: from the rows; decoupled_diloco).
    committed_rounds = True

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._started = False
        #: Inside :meth:`run_round`: the collectives issued belong to its round, which it
        #: commits (none commits on its own).
        self._compound = False

    def start(self) -> None:
        """Set-up is over: from now on collectives run in rounds."""
        self._started = True

    @property
    def rank(self) -> int:
        if not self._started or not self.replica.started:
            return self.replica.slot
        return self.replica.pg.replica_rank

    @property
    def world_size(self) -> int:
        if not self._started or not self.replica.started:
            return self.replica.workers
        # (The workers that take part: a healing one sits the round out.)
        self.replica.needs_quorum()
        return max(1, int(self.replica.manager.num_participants()))

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: LowcommReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        self._check_started("all_reduce")
        self.replica.reach_round()
        self.replica.open_round()
        if op == "max":
            return _MaxHandle(self.replica, tensor)
        # (A mean of parameters weighs each worker's: a joiner's may hold its sender's steps.)
        roles = {role} if segments is None else {segment[0] for segment in segments}
        return _RoundHandle(
            self.replica,
            tensor,
            op,
            commits=not self._compound,
            weighted=Role.PARAMETER in roles,
        )

    def run_round(self, exchange: Callable[[], _T]) -> _T:
        """Run ``exchange``, which issues several collectives on this group (through any
        wrapper) and waits for them, as one round: every collective belongs to the round's
        quorum and none commits on its own; the round commits once ``exchange`` returns, and
        a failure of any of them (reported to the Manager) makes it not commit. A round that
        did not commit is tried again on a new quorum, ``exchange`` called again from its
        own inputs (it reads ``world_size`` anew: the new quorum's participants). Its
        collectives run in the loop step that calls this (a round that flies across steps
        commits at its collective's wait instead)."""
        self._check_started("run_round")
        replica = self.replica
        replica.reach_round()
        replica.open_round()
        attempts = replica.options.attempts
        for attempt in range(1, attempts + 1):
            self._compound = True
            try:
                result = exchange()
            finally:
                self._compound = False
            replica._note_quorum()
            if replica.commit():
                return result
            if attempt == attempts:
                break
            replica.retry_round()
        raise _round_failed(replica)

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        if not self._started:
            return CompletedHandle()
        raise NotImplementedError(self._unsupported("broadcast"))

    def barrier(self) -> Handle:
        if not self._started:
            return CompletedHandle()
        raise NotImplementedError(self._unsupported("barrier"))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: LowcommReduceOp = "sum", role: Role
    ) -> Handle:
        raise NotImplementedError(self._unsupported("reduce_scatter"))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """The participants' ``input``, in slot order, into ``output`` (``world_size`` rows),
        committed as the round (:class:`_GatherHandle`; a retry on a quorum of another size
        resizes ``output``)."""
        self._check_started("all_gather")
        self.replica.reach_round()
        self.replica.open_round()
        check_scatter_shapes(output, input, self.world_size, "all_gather")
        return _GatherHandle(self.replica, output, input, commits=not self._compound)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        """Chunk j of every participant's ``input`` into participant j's ``output``, in slot
        order (:class:`_AllToAllHandle`): only as one collective of a round that holds
        several (:meth:`run_round`), whose later collectives need its data."""
        self._check_started("all_to_all")
        if not self._compound:
            raise NotImplementedError(self._unsupported("all_to_all"))
        check_scatter_shapes(output, input, 1, "all_to_all")
        if input.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: {input.numel()} elements do not split into {self.world_size} "
                "equal chunks; pad the input to a multiple of world_size"
            )
        return _AllToAllHandle(self.replica, output, input)

    def _check_started(self, op: str) -> None:
        if not self._started:
            raise RuntimeError(f"TorchftComm.{op}: called during set-up, before any quorum")

    @staticmethod
    def _unsupported(op: str) -> str:
        return (
            f"TorchftComm.{op}: a round here is one quorum and its mean all-reduces or "
            "all-gathers (and, inside run_round, all-to-alls); the methods that run with "
            "--membership torchft issue nothing else"
        )


class TorchftMembership:
    """The runtime's ``Membership`` of a torchft worker: entering a round opens it (if the
    worker has not already: ddp's worker at every step's start, a syncing method's at the
    start of the step that ends in its sync) and waits for its quorum."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def quorum(self) -> Quorum:
        return self.replica.quorum()

    def enter_round(self) -> Quorum:
        self.replica.reach_round()
        self.replica.open_round()
        return self.replica.wait_quorum()
