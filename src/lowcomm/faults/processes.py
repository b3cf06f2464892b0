"""Declared faults with one process per worker (``--workers-per-process 1``), on the virtual
clock.

Every worker process reads the same trace and derives the same quorum at each step, as the
threads of an in-process run do (:mod:`lowcomm.faults.engine`); a round's strategy
collectives run on the ``torch.distributed`` group of its quorum's members
(:class:`~lowcomm.comm.torch_comm.QuorumTorchComm`), so a worker outside it issues none and
its peers never wait for it. A worker that crashed, left or has not joined yet keeps its
process: it charges its clock nothing and takes its turn in the run's bookkeeping (the
metrics gather, the validation sums, the summary, on a Gloo group of every process), whose
rows leave it out, as the thread of an in-process run does. So the same trace gives the same
losses, modeled times and ``faults`` block in both placements, and a joining worker is healed
from a live member over its quorum's group, charged like any transfer.

What the crashed worker's process does not do here is die: on the virtual clock a crash is
the modeled event (the survivors' detection wait, the dropped round, the lost state is
replaced by healing at a join), and the bookkeeping that gives every report its rows runs
over every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowcomm.faults.engine import WorkerFaults

if TYPE_CHECKING:
    from lowcomm.comm.torch_comm import QuorumTorchComm

__all__ = ["ProcessFaults"]


class ProcessFaults(WorkerFaults):
    """A worker process's view of the run's faults: the engine's, and as each step is
    resolved (every worker resolves every step, in order, member or not), the process group
    of its quorum is made on every process (:meth:`QuorumTorchComm.prepare`, collective).
    Made then, a quorum that a generated trace adds when it grows past its horizon gets its
    group like the others."""

    def __init__(self, *args: Any, raw: QuorumTorchComm, **kwargs: Any) -> None:
        self._groups_made = 0  # (before the engine resolves anything)
        self._quorum_groups = raw
        super().__init__(*args, raw=raw, **kwargs)

    def resolve(self, step: int) -> None:
        super().resolve(step)
        while self._groups_made <= step:
            resolved = self._groups_made
            self._groups_made += 1  # (members() resolves again: already done)
            self._quorum_groups.prepare(self.members(resolved))
