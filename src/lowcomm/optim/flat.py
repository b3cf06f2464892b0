"""The flat-optimizer protocol every strategy's optimizer follows (docs/ALGORITHMS.md §0.3).

A flat optimizer owns one 1-D float32 ``master`` tensor (the fp32 parameters, or this worker's
slice of them) and updates it in place from a gradient of the same length. The same objects
serve every family: DDP, ZeRO-1 and the ACCO family step them on an averaged (or reduced)
gradient, the local and DiLoCo families on a worker's own gradient, DES-LOC averages their
states on its own periods. Three implementations exist: :class:`~lowcomm.optim.adamw.FlatAdamW`,
:class:`~lowcomm.optim.adopt.FlatAdopt` and :class:`~lowcomm.optim.sgd.FlatSGD`. Weight decay is
decoupled in all three (``theta <- theta (1 - lr lambda)`` before the update), so it behaves the
same whatever family an optimizer sits in.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lowcomm.comm.base import Role


class FlatOptimizer(Protocol):
    """What a strategy may ask of its optimizer.

    Attributes:
        master: the 1-D float32 parameters the optimizer updates in place.
    """

    master: torch.Tensor

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """Apply one update with gradient ``grad`` (same length as ``master``)."""
        ...

    def lookahead(self, grad: torch.Tensor, *, lr: float, out: torch.Tensor) -> torch.Tensor:
        """The parameters :meth:`step` would produce, written to ``out`` and returned; nothing
        (master, states, counters) is written back. Bit for bit what a step would give."""
        ...

    def states(self) -> dict[Role, torch.Tensor]:
        """The optimizer's state tensors (first/second moment) by role, each as long as
        ``master``; empty for a stateless optimizer. Averaging them is DES-LOC's business."""
        ...

    def on_states_averaged(self, roles: list[Role], global_step: int) -> None:
        """Told that the states ``roles`` were just replaced by a cross-worker average taken at
        ``global_step`` (steps completed), so counters that go with them can follow."""
        ...

    def reset(self) -> None:
        """Forget every state (zeros, counters 0), as a freshly started worker; the master
        is kept."""
        ...

    def state_bytes(self) -> int:
        """Bytes of the optimizer's own states (the master is counted by its owner)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Master, states and counters, cloned (for a checkpoint)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, in place."""
        ...


def check_master(master: torch.Tensor, owner: str) -> None:
    """Refuse a master that is not a 1-D float32 tensor."""
    if master.dtype != torch.float32 or master.dim() != 1:
        raise ValueError(f"{owner} needs a 1-D float32 master tensor")


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
