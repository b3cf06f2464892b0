"""Named records that every worker sends to rank 0 on the bookkeeping group.

A record is a dataclass of numbers; it travels as one float64 CPU tensor (the bookkeeping group
is Gloo) and comes back as a record again, one per process in rank order, so a reader names the
field it wants instead of a column position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from lowcomm.comm.base import Comm, Role

_Record = TypeVar("_Record", bound="_Gathered")


class _Gathered:
    """A dataclass of float fields that can be all-gathered by name."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_tensor(self) -> torch.Tensor:
        """The fields in declaration order, as one float64 tensor."""
        values = [float(getattr(self, field.name)) for field in dataclasses.fields(self)]  # type: ignore[arg-type]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def from_rows(cls: type[_Record], rows: torch.Tensor) -> list[_Record]:
        """One record per row of ``rows`` (processes x fields)."""
        names = [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return [
            cls(**dict(zip(names, row, strict=True))) for row in rows.view(-1, len(names)).tolist()
        ]

    def all_gather(self: _Record, bookkeeping: Comm) -> list[_Record]:
        """Every process's record, in rank order (uncharged: the bookkeeping group)."""
        local = self.to_tensor()
        gathered = torch.zeros(bookkeeping.world_size * local.numel(), dtype=torch.float64)
        bookkeeping.all_gather(gathered, local, role=Role.OTHER).wait()
        return self.from_rows(gathered)


@dataclass
class StepMetrics(_Gathered):
    """What one process measured in one step."""

    loss: float
    """Mean training loss of the step's micro-batches."""
    compute_s: float
    """Compute seconds on the run's clock."""
    exposed_comm_s: float
    """Seconds spent waiting for communication on the run's clock."""
    bytes_sent: float
    """Bytes this process sent for the method (every level)."""
    clock_s: float
    """The process's clock at the end of the step."""
    microbatches: float
    tokens: float
    committed_steps: float
    """Optimizer steps the method has committed so far (the same on every worker)."""
    params_finite: float
    """1.0 when every parameter is finite after the step, else 0.0."""


@dataclass
class ProcessTotals(_Gathered):
    """What one process reports at the end of the run."""

    compute_s: float
    exposed_comm_s: float
    clock_s: float
    bytes_sent: float
    state_bytes: float
    tokens: float
    replica_bytes_sent: float
    """Bytes sent on the link between the ranks of one worker (0 with flat workers)."""
    replica_exposed_comm_s: float
    outer_bytes_sent: float
    """Bytes sent on the link between workers (all of them with flat workers)."""
    outer_exposed_comm_s: float
    peak_memory: float
    """``torch.cuda.max_memory_allocated`` on a GPU, else 0."""


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: on a GPU the caching allocator's peak
    (``torch.cuda.max_memory_allocated``), on the CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, else KiB
