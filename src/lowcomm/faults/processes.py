"""Declared faults with one process per worker (``--workers-per-process 1``), or one per rank
of a worker of several ranks.

Every worker process reads the same trace and derives the same quorum at each step, as the
threads of an in-process run do (:mod:`lowcomm.faults.engine`); a round's strategy
collectives run on the ``torch.distributed`` group of its quorum's members
(:class:`~lowcomm.comm.torch_comm.QuorumTorchComm`), so a worker outside it issues none and
its peers never wait for it.

**A crash kills the worker's process** (SIGKILL, :func:`~lowcomm.launch.spawn.end_by_sigkill`)
at the step its event lands on. Before it dies, the held steps' metrics are gathered (its
rows are in them), and it leaves in the launch folder what the others need of it
(:meth:`ProcessFaults.hand_over`): its totals for the summary (times, bytes, tokens,
committed tokens) and its state. The others then keep their bookkeeping on the live
processes (:class:`~lowcomm.comm.torch_comm.LiveBookkeeping`). Every process knows from the
trace who is killed at each step, so they agree without talking. When worker 0's process
is killed, the lowest live worker writes the run directory on from the steps already in it
(:meth:`ProcessFaults.writes`).

**A join takes a process started at launch.** For each join of a slot that follows its
crash, the launch starts one more process for the slot (:func:`process_layout`; ranks follow
slots, so a quorum's group ranks its members in slot order). It stands by outside every
quorum, charging nothing and taking its turn in the bookkeeping with no row of its own,
until the join: it then takes over the slot from what the killed process handed over (the
model, the method's state, the data position, the random streams, the clock and counters),
as the slot's thread of an in-process run would have them, and the join heals it from a live
member over the quorum's group, charged like any transfer. A slot that nobody holds has its
file of every later checkpoint written by the lowest live worker from what its killed
process handed over, with the survivors' progress through the trace; a resumed launch
starts every process again and kills at once those killed before its checkpoint.

A worker whose process is not killed keeps it outside its quorum, charging its clock
nothing and taking its turn in the bookkeeping, whose rows leave it out, as the thread of an
in-process run does: one that left (it rejoins with its state); every worker of a generated
trace (each crash is replaced, a replacement per
crash would be a process per event); and every worker under torchrun. So the same trace
gives the same losses, modeled times and ``faults`` block in both placements.

**A worker of several ranks** (``--ranks-per-worker R``, replicated) is R processes, one per
rank, and a process holds a rank slot (``w R + r`` for rank ``r`` of worker ``w``: its row
in the bookkeeping, its file in a checkpoint and in the launch folder) where a process of one
rank holds its worker's. A crash kills the R processes of its worker; a join after it has R
processes standing by take over its R rank slots, rank by rank, and each is healed from the
same rank of a live member. The collectives between workers run on each rank's outer group
(:class:`QuorumOuterComm`), which follows the quorum: the R groups of a quorum are made
together by every live process, so each rank's group has the same members. A worker's ranks
meet on a replica group of its processes of one generation (those started at launch, or those
standing by for one of its joins), made at launch (:func:`quorum_levels`).

**A sharded worker** (``--worker-sharding fsdp``) is the same R processes, its model
``fully_shard``-ed over its replica group alone (a mesh of that group,
:func:`~lowcomm.train.sharding.group_mesh`), so rank ``r`` holds the r-th shard of every
parameter and its outer group carries that shard between workers. The processes standing by
for a join have a replica group and a mesh of their own, made at launch; a crash kills the R
processes and their mesh with them. At the join each rank is healed with its own shard's
declared state from rank ``r`` of a live member, over its outer group; nothing is gathered
among the worker's ranks. At launch rank ``r`` of every worker takes worker 0's rank ``r``
shards (:meth:`QuorumOuterComm.from_first_worker`), before any quorum has a group.

**Under torchrun a crash is emulated in place**, on either clock. A process is not killed
there: torchrun's elastic agent takes a worker killed by a signal as the failure of the whole
job and stops (or, with ``--max-restarts``, restarts) every worker, and its world is fixed at
launch, with no process to stand by for a join. So the crashed worker's process stays, and
loses its state where it stands: at the crash's step it stops taking part (no strategy
collective, nothing charged to its clock) and zeroes its parameters, their gradients and
every tensor of its method's state (:func:`lose_state`), so that nothing of the lost worker
reaches its join. Until the run ends, or until its slot's join, when it is healed from a
live member like any new worker, it only takes its turn in the run's bookkeeping, whose rows
leave it out, as a thread does. The survivors see what they would see of a killed process:
a member fewer from the crash's step on.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from lowcomm.comm.base import Comm, Role
from lowcomm.comm.torch_comm import QuorumTorchComm, TorchComm, process_group_timeout
from lowcomm.faults.engine import StepPlan, WorkerFaults

if TYPE_CHECKING:
    from torch import nn

    from lowcomm.comm.torch_comm import LiveBookkeeping
    from lowcomm.config import TrainConfig
    from lowcomm.strategies.base import Strategy

__all__ = [
    "ProcessFaults",
    "QuorumOuterComm",
    "ReplicaGroupComm",
    "handover_path",
    "lose_state",
    "process_layout",
    "quorum_levels",
]


class ProcessFaults(WorkerFaults):
    """A worker process's view of the run's faults: the engine's, and as each step is
    resolved (every worker resolves every step, in order, member or not), the process group
    of its quorum is made on every live process (:meth:`QuorumTorchComm.prepare`,
    collective), and which process holds each slot at that step: a crash kills its holder
    (when :attr:`kills`), and the slot's next join or rejoin is taken by the next process of
    the slot (:func:`process_layout`). Made then, a quorum that a generated trace adds when it
    grows past its horizon gets its group like the others."""

    def __init__(self, *args: Any, raw: QuorumTorchComm, **kwargs: Any) -> None:
        from lowcomm.launch.spawn import launch_folder
        from lowcomm.prestart import under_torchrun

        self._groups_made = 0  # (before the engine resolves anything)
        self._quorum_groups = raw
        #: The rank slot of each process (a worker of R ranks has slots ``w R .. w R + R -
        #: 1``, one per rank; R = 1: the worker's slot).
        self.layout = raw.layout
        self.ranks = raw.ranks_per_worker if isinstance(raw, QuorumOuterComm) else 1
        #: This process's rank slot: the row of its worker's rank in the bookkeeping, and
        #: its file in a checkpoint and in the launch folder.
        self.rank_slot = raw.rank_slot if isinstance(raw, QuorumOuterComm) else raw.slot
        self.process = dist_rank()
        #: Each step's holders (world rank of each rank slot's process; None: killed) and
        #: the processes killed at it.
        self._holders: list[tuple[int | None, ...]] = []
        self._killed_at: list[tuple[int, ...]] = []
        #: Each rank slot's latest process so far.
        self._last: list[int] = []
        super().__init__(*args, raw=raw, **kwargs)
        #: Whether a crash kills its worker's process (a file's trace, in a launch of the
        #: local spawner; a generated trace replaces every crashed worker).
        self.kills = self._extend is None and launch_folder() is not None
        self.loses_state_in_place = under_torchrun()

    def resolve(self, step: int) -> None:
        super().resolve(step)
        while self._groups_made <= step:
            resolved = self._groups_made
            self._groups_made += 1  # (members() resolves again: already done)
            self._hold(resolved)
            self._quorum_groups.hold(self._holders[resolved])
            groups, members = self._quorum_groups, self.members(resolved)
            if isinstance(groups, QuorumOuterComm):  # (every rank's outer group, in order)
                groups.prepare_quorum(members)
            else:
                groups.prepare(groups.ranks_of(members))

    def _hold(self, step: int) -> None:
        """Who holds each rank slot at ``step`` (resolved), from the step before and its
        events, in trace order: a crash of a worker lost at it kills the processes of its R
        ranks; a join or rejoin of a worker whose processes were killed is taken, rank by
        rank, by each rank slot's next process."""
        slots = self.trace.workers * self.ranks
        if step == 0:
            holders: list[int | None] = [self.layout.index(s) for s in range(slots)]
            self._last = [self.layout.index(s) for s in range(slots)]
        else:
            holders = list(self._holders[step - 1])
        plan = self.plan(step)
        killed = []
        for event in plan.events:
            worker = event.worker
            assert worker is not None
            for slot in range(worker * self.ranks, (worker + 1) * self.ranks):
                rank = holders[slot]
                if event.kind == "crash" and self.kills and worker in plan.lost:
                    if rank is not None:
                        killed.append(rank)
                    holders[slot] = None
                elif event.kind in ("join", "rejoin") and rank is None:
                    holders[slot] = self._last[slot] = self._next_process(step, worker, slot)
        self._holders.append(tuple(holders))
        self._killed_at.append(tuple(killed))

    def _next_process(self, step: int, worker: int, slot: int) -> int:
        """The process that takes rank slot ``slot`` over at a join: the slot's next."""
        following = [
            r for r, held in enumerate(self.layout) if held == slot and r > self._last[slot]
        ]
        if not following:
            raise RuntimeError(f"step {step}: worker {worker} has no process to join")
        return following[0]

    def holders(self, step: int) -> tuple[int | None, ...]:
        """Each rank slot's process at ``step`` (world ranks; None: killed)."""
        self.resolve(step)
        return self._holders[step]

    def holds(self, step: int) -> bool:
        """Whether this process holds its rank slot at ``step``."""
        return self.holders(step)[self.rank_slot] == self.process

    def plan(self, step: int) -> StepPlan:
        """The engine's plan; a process that does not hold its slot (standing by for it, or
        before its kill) is no member."""
        plan = super().plan(step)
        if plan.member and len(self._holders) > step and not self.holds(step):
            return replace(plan, member=False, quorum=replace(plan.quorum, joined=False))
        return plan

    def begin(self, plan: StepPlan, step: int) -> None:
        self._quorum_groups.hold(self._holders[step])
        super().begin(plan, step)

    def _agreed_start(self) -> float:
        """The engine's, where a process that does not hold its slot gives no time."""
        if self.books is None:
            raise RuntimeError("membership events placed by time need the bookkeeping group")
        last = len(self._resolved) - 1
        holding = last < 0 or self._holders[last][self.rank_slot] == self.process
        mine = self.clock.now() if self.slot in self._alive and holding else -math.inf
        times = torch.tensor([mine], dtype=torch.float64)
        self.books.all_reduce(times, op="max", role=Role.OTHER).wait()
        return float(times[0])

    # --- processes killed by a declared crash ------------------------------------------

    def killed_at(self, step: int, *, since: int | None = None) -> tuple[int, ...]:
        """The processes (world ranks) killed at ``step`` (with ``since``: at any step from
        it to ``step``, for a resumed run whose killed processes were started again)."""
        self.resolve(step)
        first = step if since is None else since
        return tuple(r for s in range(first, step + 1) for r in self._killed_at[s])

    def changed_at(self, step: int) -> bool:
        """Whether a slot changes process at ``step``."""
        self.resolve(step)
        return step > 0 and self._holders[step] != self._holders[step - 1]

    def took_over(self, step: int) -> bool:
        """Whether this process takes over its slot at ``step`` (a join after a kill)."""
        self.resolve(step)
        slot = self.rank_slot
        before = self._holders[step - 1][slot] if step > 0 else self.layout.index(slot)
        return self.holds(step) and before != self.process

    def hand_over(
        self, step: int, totals: torch.Tensor, state: dict[str, Any],
        bytes_by_role: dict[str, float],
    ) -> None:  # fmt: skip
        """This process is killed at ``step``: leave its summary ``totals`` (a
        :class:`~lowcomm.train.records.ProcessTotals` row), its committed tokens, its
        checkpoint ``state`` and its bytes by role in the launch folder, for the others."""
        path = handover_path(self.rank_slot)
        partial = path.with_suffix(".partial")
        torch.save(
            {"step": step, "totals": totals, "committed_tokens": self.committed_tokens,
             "state": state, "bytes_by_role": bytes_by_role},
            partial,
        )  # fmt: skip
        partial.replace(path)

    def take_over(self, faults_state: dict[str, Any]) -> None:
        """This process takes over its slot: the counts, quorum and detection its killed
        process had (a worker outside the quorum has lost its pending tokens)."""
        own = dict(self.state_dict())
        own.update({key: faults_state[key] for key in _OWN_FAULTS})
        own["pending_tokens"] = 0
        self.load_state_dict(own)

    def writes(self, step: int) -> bool:
        """Whether this process writes the run directory from ``step`` on, taking over from
        worker 0's killed process: the lowest live process that holds a slot."""
        holders = self.holders(step)
        if holders[0] is not None:
            return False
        return min(rank for rank in holders if rank is not None) == self.process

    def die(self, step: int) -> NoReturn:
        from lowcomm.launch.spawn import end_by_sigkill

        rank = f" (rank {self.rank_slot % self.ranks})" if self.ranks > 1 else ""
        end_by_sigkill(f"declared crash of worker {self.slot}{rank} at step {step}")

    def vacant_now(self) -> tuple[int, ...]:
        """The rank slots that no live process holds at the latest step resolved (their
        processes were killed)."""
        if not self._holders:
            return ()
        return tuple(slot for slot, rank in enumerate(self._holders[-1]) if rank is None)

    def holds_now(self) -> bool:
        """Whether this process holds its slot at the latest step resolved."""
        if not self._holders:
            return self.layout.index(self.rank_slot) == self.process
        return self._holders[-1][self.rank_slot] == self.process

    def handed_over(self, slot: int) -> dict[str, Any]:
        """What the last killed process of rank slot ``slot`` left (:meth:`hand_over`)."""
        loaded: dict[str, Any] = torch.load(handover_path(slot), weights_only=False)
        return loaded

    def committed_by_vacant(self) -> int:
        """The committed tokens of the rank slots whose processes were killed (and not
        replaced)."""
        return sum(int(self.handed_over(s)["committed_tokens"]) for s in self.vacant_now())

    def write_killed_checkpoints(
        self, run_dir: Path, step: int, val_loss: float, books: LiveBookkeeping,
        digests: list[str],
    ) -> list[str]:  # fmt: skip
        """Write each vacant slot's file of the checkpoint of ``step`` (on the lowest live
        worker) from the state its killed process handed over, as its thread would have
        it: the trace's progress is the survivors', its own quorum, detection and counts are
        its own (a worker outside the quorum loses its pending tokens). Returns ``digests``
        with theirs (collective over ``books``)."""
        from lowcomm.train import checkpoint

        vacant = self.vacant_now()
        if not vacant:
            return digests
        rows = torch.zeros(len(digests), 32, dtype=torch.int64)
        if books.first:
            ours = self.state_dict()
            for slot in vacant:
                state = dict(self.handed_over(slot)["state"])
                theirs = dict(state["faults"])
                state["faults"] = {
                    **ours,
                    **{key: theirs[key] for key in _OWN_FAULTS},
                    "pending_tokens": 0,
                }
                state["step"], state["val_loss"] = step, val_loss
                path = checkpoint.write_rank_state(run_dir, step, slot, state)
                rows[slot] = torch.tensor(list(bytes.fromhex(checkpoint.file_digest(path))))
        books.all_reduce(rows, op="sum", role=Role.OTHER).wait()
        return [
            bytes(rows[slot].tolist()).hex() if slot in vacant else digest
            for slot, digest in enumerate(digests)
        ]


class QuorumOuterComm(QuorumTorchComm):
    """The outer group of local rank ``r`` of workers of R ranks, one process per rank,
    whose collectives run over the current round's quorum: the processes that hold rank
    ``r`` of each member (:class:`QuorumTorchComm`'s, a level down).

    ``slot`` is the worker, ``rank`` and ``world_size`` the worker's index in the quorum and
    the quorum's size, as on a worker's thread (:class:`~lowcomm.faults.stacked.
    QuorumStackedComm`). The R outer groups follow one quorum: each quorum's R process
    groups are made together by every live process, in rank order
    (:meth:`prepare_quorum`), kept for when the quorum's processes recur, and the oldest
    destroyed past ``keep_groups`` sets, as :class:`QuorumTorchComm` keeps its own.

    Args:
        ranks_per_worker: R.
        timeout_s: as :class:`QuorumTorchComm`'s.
        keep_groups: how many quorums' sets of R groups are kept.
        layout: the rank slot of each process (``w R + r`` for rank ``r`` of worker ``w``,
            in rank order; None: one process per rank slot).
    """

    def __init__(
        self, ranks_per_worker: int, *, timeout_s: float | None = None, keep_groups: int = 16,
        layout: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(timeout_s=timeout_s, keep_groups=keep_groups, layout=layout)
        self.ranks_per_worker = ranks_per_worker
        self.rank_slot = self._slot
        self.local_rank = self.rank_slot % ranks_per_worker
        self._slot = self.rank_slot // ranks_per_worker
        self._rank_holders = self._holders
        workers = len(self._rank_holders) // ranks_per_worker
        self._holders = self._of_rank(self._rank_holders)
        self._members = tuple(range(workers))
        self._rank, self._world_size = self._slot, workers
        #: Each kept quorum's R groups (key: the processes of each rank), oldest first.
        self._quorums: OrderedDict[tuple[tuple[int, ...], ...], list[Any]] = OrderedDict()

    def _of_rank(self, holders: tuple[int | None, ...]) -> tuple[int | None, ...]:
        """This rank's processes of ``holders`` (each rank slot's), one per worker."""
        return holders[self.local_rank :: self.ranks_per_worker]

    def hold(self, holders: tuple[int | None, ...]) -> None:
        """Each rank slot's process from now on (None: killed)."""
        self._rank_holders = holders
        self._holders = self._of_rank(holders)

    def _key(self, members: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The processes of each rank of the workers ``members``."""
        ranks = self.ranks_per_worker
        key = []
        for r in range(ranks):
            processes = [self._rank_holders[w * ranks + r] for w in members]
            if None in processes:
                raise RuntimeError(f"a worker of {members} has no process of its rank {r}")
            key.append(tuple(sorted(p for p in processes if p is not None)))
        return tuple(key)

    @property
    def kept_sets(self) -> tuple[tuple[int, ...], ...]:
        """This rank's processes of each kept quorum, least recently prepared first."""
        return tuple(key[self.local_rank] for key in self._quorums)

    def prepare_quorum(self, members: tuple[int, ...]) -> None:
        """Make the R process groups of the quorum of workers ``members`` unless they exist.
        Collective: every live process of the world calls it, in the same order."""
        key = self._key(tuple(sorted(members)))
        if key in self._quorums:
            self._quorums.move_to_end(key)
            return
        timeout = None if self._timeout_s is None else process_group_timeout(self._timeout_s)
        self._quorums[key] = [dist.new_group(list(ranks), timeout=timeout) for ranks in key]
        while len(self._quorums) > self._keep_groups:
            _, groups = self._quorums.popitem(last=False)
            for group in groups:
                dist.destroy_process_group(group)  # (a non-member's handle: nothing to destroy)

    def prepare(self, members: tuple[int, ...]) -> None:
        raise NotImplementedError("an outer group's quorums are prepared by prepare_quorum()")

    def from_first_worker(self, tensor: torch.Tensor) -> None:
        """Take worker 0's rank ``r`` ``tensor`` on every process of rank ``r`` (uncharged, at
        set-up, before any quorum has a group; a sharded worker's ranks hold different
        shards of one size): one broadcast over the world from each rank's first process in
        turn, which the other ranks' processes receive and drop. Collective: every process."""
        for rank in range(self.ranks_per_worker):
            source = self.layout.index(rank)
            received = tensor if rank == self.local_rank else torch.empty_like(tensor)
            dist.broadcast(received, src=source)

    def enter(self, quorum_id: int, members: tuple[int, ...]) -> None:
        """Take part in quorum ``quorum_id`` of the workers ``members`` on this rank's group
        of their processes (made by :meth:`prepare_quorum`)."""
        members = tuple(sorted(members))
        if self._slot not in members or self._rank_holders[self.rank_slot] != dist.get_rank():
            raise ValueError(
                f"worker {self._slot} (rank {self.local_rank}) is not in quorum {quorum_id} "
                f"{members}"
            )
        groups = self._quorums.get(self._key(members))
        if groups is None:
            raise RuntimeError(
                f"worker {self._slot}: quorum {quorum_id} {members} has no process groups; "
                "every process must prepare_quorum() each set before its members enter it"
            )
        self._group = groups[self.local_rank]
        self._members = members
        self._rank = members.index(self._slot)  # (ranks follow workers: the same index)
        self._world_size = len(members)


def quorum_levels(config: TrainConfig, raw: Comm) -> tuple[Comm, Comm] | None:
    """The (replica, outer) communicators of this process, one rank of a worker of R ranks
    with declared faults (``raw`` the world's :class:`QuorumTorchComm`, its layout by rank
    slot): the replica group of the worker's processes of one generation (those started
    at launch, or those standing by for one of its joins, which take over its R ranks
    together) and the outer group of its rank, which follows the quorum
    (:class:`QuorumOuterComm`). None where ``raw`` is no such world (flat workers, threads,
    no faults). Collective: every process makes every group, in one order."""
    ranks = config.placement.ranks_per_worker
    if ranks == 1 or type(raw) is not QuorumTorchComm:
        return None
    timeout_s = config.comm.collective_timeout_s
    timeout = None if timeout_s is None else process_group_timeout(timeout_s)
    layout, process = raw.layout, dist_rank()
    mine = None
    for worker in range(config.placement.workers):
        first = range(worker * ranks, (worker + 1) * ranks)
        for generation in range(layout.count(worker * ranks)):
            members = [_nth(layout, slot, generation) for slot in first]
            group = dist.new_group(members, timeout=timeout)
            if process in members:
                mine = group
    assert mine is not None, "every process is one rank of one generation of a worker"
    outer = QuorumOuterComm(ranks, timeout_s=timeout_s, layout=layout)
    return ReplicaGroupComm(mine, timeout_s=timeout_s), outer


class ReplicaGroupComm(TorchComm):
    """The group of one generation of a worker's R processes (:func:`quorum_levels`): with
    --worker-sharding fsdp, the group FSDP's mesh is made of
    (:class:`~lowcomm.train.sharding.WorkerGroup`)."""

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` group of the worker's processes."""
        return self._group


def _nth(layout: tuple[int, ...], slot: int, generation: int) -> int:
    """The world rank of rank slot ``slot``'s ``generation``-th process."""
    return [rank for rank, held in enumerate(layout) if held == slot][generation]


def lose_state(model: nn.Module, strategy: Strategy) -> None:
    """A crash emulated in a process that goes on (under torchrun): zero the worker's
    parameters and their gradients, and every tensor of its method's state (what a checkpoint
    holds of it, loaded back as zeros), so that its join finds nothing of it and is healed
    like a new worker's. The model's buffers are not trained state (a new worker builds them
    alike) and stay."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
            if parameter.grad is not None:
                parameter.grad.zero_()
    strategy.lose_state()


def dist_rank() -> int:
    """This process's rank in the world."""
    import torch.distributed as dist

    return dist.get_rank()


def process_layout(config: TrainConfig) -> tuple[int, ...]:
    """The rank slot of each worker process of a run with declared faults, in rank order:
    one per rank of each worker (slot ``w R + r`` for rank ``r`` of worker ``w``; with R = 1
    the worker's slot), and one more per rank for each join or rejoin of a worker that
    follows its crash in the trace (they stand by until they take over the rank slots whose
    processes the crash killed), placed after the slot's others, so that ranks follow
    slots. A generated trace replaces every crashed worker in its processes: one each."""
    from lowcomm.faults.run import FaultSettings, run_trace

    trace = run_trace(config)
    counts = [1] * config.placement.workers
    if trace is not None and FaultSettings.of(config.fault).path is not None:
        crashed: set[int] = set()
        for event in trace.membership_events():
            worker = event.worker
            assert worker is not None
            if event.kind == "crash":
                crashed.add(worker)
            elif event.kind in ("join", "rejoin") and worker in crashed:
                crashed.discard(worker)
                counts[worker] += 1
    ranks = config.placement.ranks_per_worker
    slots = range(config.placement.workers * ranks)
    return tuple(slot for slot in slots for _ in range(counts[slot // ranks]))


#: What a worker's fault state holds of its own rather than of the trace.
_OWN_FAULTS = ("quorum", "detect_until", "step", "committed_tokens", "dropped_steps")


def handover_path(slot: int) -> Path:
    """Where the process of rank slot ``slot`` leaves what it hands over when it is
    killed."""
    from lowcomm.launch.spawn import launch_folder

    folder = launch_folder()
    if folder is None:
        raise RuntimeError("only a worker that spawn_workers started is killed by plan")
    return folder / f"slot{slot}.handover.pt"
