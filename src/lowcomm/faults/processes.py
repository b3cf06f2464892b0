"""Declared faults with one process per worker (``--workers-per-process 1``), on the virtual
clock.

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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from lowcomm.comm.base import Role
from lowcomm.faults.engine import StepPlan, WorkerFaults

if TYPE_CHECKING:
    from torch import nn

    from lowcomm.comm.torch_comm import LiveBookkeeping, QuorumTorchComm
    from lowcomm.config import TrainConfig
    from lowcomm.strategies.base import Strategy

__all__ = ["ProcessFaults", "handover_path", "lose_state", "process_layout"]


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
        self.layout = raw.layout
        self.process = dist_rank()
        #: Each step's holders (world rank of each slot's process; None: killed) and the
        #: processes killed at it.
        self._holders: list[tuple[int | None, ...]] = []
        self._killed_at: list[tuple[int, ...]] = []
        #: Each slot's latest process so far.
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
            self._quorum_groups.prepare(self._quorum_groups.ranks_of(self.members(resolved)))

    def _hold(self, step: int) -> None:
        """Who holds each slot at ``step`` (resolved), from the step before and its events,
        in trace order: a crash of a worker lost at it kills its process; a join or rejoin
        of a slot whose process was killed is taken by the slot's next process."""
        if step == 0:
            holders: list[int | None] = [self.layout.index(s) for s in range(self.trace.workers)]
            self._last = [self.layout.index(s) for s in range(self.trace.workers)]
        else:
            holders = list(self._holders[step - 1])
        plan = self.plan(step)
        killed = []
        for event in plan.events:
            worker = event.worker
            assert worker is not None
            rank = holders[worker]
            if event.kind == "crash" and self.kills and worker in plan.lost:
                if rank is not None:
                    killed.append(rank)
                holders[worker] = None
            elif event.kind in ("join", "rejoin") and rank is None:
                following = [
                    r for r, slot in enumerate(self.layout) if slot == worker and r > self._last[worker]
                ]  # fmt: skip
                if not following:
                    raise RuntimeError(f"step {step}: worker {worker} has no process to join")
                holders[worker] = self._last[worker] = following[0]
        self._holders.append(tuple(holders))
        self._killed_at.append(tuple(killed))

    def holders(self, step: int) -> tuple[int | None, ...]:
        """Each slot's process at ``step`` (world ranks; None: killed)."""
        self.resolve(step)
        return self._holders[step]

    def holds(self, step: int) -> bool:
        """Whether this process holds its slot at ``step``."""
        return self.holders(step)[self.slot] == self.process

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
        holding = last < 0 or self._holders[last][self.slot] == self.process
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
        before = self._holders[step - 1][self.slot] if step > 0 else self.layout.index(self.slot)
        return self.holds(step) and before != self.process

    def hand_over(
        self, step: int, totals: torch.Tensor, state: dict[str, Any],
        bytes_by_role: dict[str, float],
    ) -> None:  # fmt: skip
        """This process is killed at ``step``: leave its summary ``totals`` (a
        :class:`~lowcomm.train.records.ProcessTotals` row), its committed tokens, its
        checkpoint ``state`` and its bytes by role in the launch folder, for the others."""
        path = handover_path(self.slot)
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

        end_by_sigkill(f"declared crash of worker {self.slot} at step {step}")

    def vacant_now(self) -> tuple[int, ...]:
        """The slots that no live process holds at the latest step resolved (their processes
        were killed)."""
        if not self._holders:
            return ()
        return tuple(slot for slot, rank in enumerate(self._holders[-1]) if rank is None)

    def holds_now(self) -> bool:
        """Whether this process holds its slot at the latest step resolved."""
        if not self._holders:
            return self.layout.index(self.slot) == self.process
        return self._holders[-1][self.slot] == self.process

    def handed_over(self, slot: int) -> dict[str, Any]:
        """What the last killed process of ``slot`` left (:meth:`hand_over`)."""
        loaded: dict[str, Any] = torch.load(handover_path(slot), weights_only=False)
        return loaded

    def committed_by_vacant(self) -> int:
        """The committed tokens of the slots whose processes were killed (and not replaced)."""
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
    """The slot of each worker process of a run with declared faults, in rank order: one per
    worker, and one more for each join or rejoin of a worker other than 0 that follows its
    crash in the trace (it stands by until it takes over the slot whose process the crash
    killed), placed after the slot's others, so that ranks follow slots. A generated trace
    replaces every crashed worker in its process: one each."""
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
    return tuple(slot for slot in range(config.placement.workers) for _ in range(counts[slot]))


#: What a worker's fault state holds of its own rather than of the trace.
_OWN_FAULTS = ("quorum", "detect_until", "step", "committed_tokens", "dropped_steps")


def handover_path(slot: int) -> Path:
    """Where the process of ``slot`` leaves what it hands over when it is killed."""
    from lowcomm.launch.spawn import launch_folder

    folder = launch_folder()
    if folder is None:
        raise RuntimeError("only a worker that spawn_workers started is killed by plan")
    return folder / f"slot{slot}.handover.pt"
