"""The dtype gradients and pseudo-gradients travel in (``--comm-dtype``).

With ``--comm-dtype bf16`` a :class:`~lowcomm.comm.emulated.NetworkComm` casts the float32
payload of every gradient and pseudo-gradient collective to bfloat16 before handing it to the
communicator that moves it (the tensor really sent is bf16, so bytes and modeled time follow
from its size), and copies the result back into the float32 tensor the caller gave once the
collective has completed (``wait`` or ``settle``). The reduction itself runs in bfloat16, as a
bf16 all-reduce on NCCL does; parameters, optimizer states and every other role stay float32.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from lowcomm.comm.base import Handle, Role, Settled, arrival_stamp

CommDtype = Literal["fp32", "bf16"]
COMM_DTYPES: tuple[str, ...] = get_args(CommDtype)

#: The roles ``--comm-dtype`` applies to.
CAST_ROLES = frozenset({Role.GRADIENT, Role.PSEUDO_GRADIENT})

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def wire_dtype(comm_dtype: str) -> torch.dtype:
    """The torch dtype of ``--comm-dtype``."""
    return _DTYPES[comm_dtype]


def travels_cast(tensor: torch.Tensor, role: Role | None, dtype: torch.dtype) -> bool:
    """Whether ``tensor`` goes on the wire as ``dtype`` rather than as itself."""
    return role in CAST_ROLES and tensor.dtype == torch.float32 and dtype != torch.float32


class CastBackHandle:
    """A collective on a cast copy: completing it copies the copy back into ``target``."""

    def __init__(self, inner: Handle, wire: torch.Tensor, target: torch.Tensor) -> None:
        self._inner = inner
        self._wire = wire
        self._target = target
        self._copied = False

    def _copy_back(self) -> None:
        if not self._copied:
            self._target.copy_(self._wire)
            self._copied = True

    def copy_back_moved(self) -> None:
        """Copy the result into the target now, without waiting for or settling the inner
        handle: for a caller that knows the data has moved (the collective completed
        underneath, e.g. a live-membership round committed) and must read the result in the
        dtype the caller gave, as ``wait`` will leave it (copying again later changes
        nothing)."""
        self._copy_back()

    def wait(self) -> None:
        self._inner.wait()
        self._copy_back()

    def done(self) -> bool:
        return self._inner.done()

    def settle(self) -> Settled:
        settled = self._inner.settle()
        self._copy_back()
        return settled

    def completed_at(self) -> float | None:
        """The inner collective's arrival stamp."""
        return arrival_stamp(self._inner)
