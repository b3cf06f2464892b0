"""SGD on one flat fp32 tensor, with an explicit momentum form (docs/ALGORITHMS.md §0.3).

With gradient ``g``, learning rate ``eta``, weight decay ``lambda`` and momentum ``mu``, one
step is::

    theta <- theta (1 - eta lambda)                  # decoupled, as AdamW's
    b <- mu b + g          (b = g on the first step)  # dampening "none": PyTorch SGD(dampening=0)
    b <- mu b + (1 - mu) g (b starts at 0)            # dampening "ema": DES-LOC's SGDM (Alg. 4)
    theta <- theta - eta b

With ``mu = 0`` and dampening "none" there is no buffer at all: ``theta <- theta - eta g``
(plain SGD, the optimizer of ACCO's Prop. 3.2 and of the reduction tests). The "ema" form
always keeps its buffer ``u`` (DES-LOC averages it as the first moment).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lowcomm.comm.base import Role
from lowcomm.optim.flat import check_master, tensor_bytes

Dampening = Literal["none", "ema"]


class FlatSGD:
    """SGD with optional momentum over one flat fp32 tensor, updated in place (a
    :class:`~lowcomm.optim.flat.FlatOptimizer`; the module docstring gives the rule).

    Args:
        master: the 1-D float32 parameters this optimizer owns.
        weight_decay: decoupled weight decay lambda.
        momentum: mu, in [0, 1).
        dampening: "none" (PyTorch's momentum, b = mu b + g) or "ema" (an exponential moving
            average, b = mu b + (1 - mu) g, DES-LOC's).
    """

    def __init__(
        self,
        master: torch.Tensor,
        *,
        weight_decay: float,
        momentum: float = 0.0,
        dampening: Dampening = "none",
    ) -> None:
        check_master(master, type(self).__name__)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"sgd momentum: {momentum} must lie in [0, 1); try 0.9 or 0")
        if not weight_decay >= 0:
            raise ValueError(f"sgd weight decay: {weight_decay} must be >= 0; try 0")
        if dampening not in ("none", "ema"):
            raise ValueError(f"sgd dampening: unknown {dampening!r}; choose none or ema")
        self.master = master
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.dampening: Dampening = dampening
        # Plain SGD (no momentum, PyTorch form) holds no state at all (nothing allocated).
        self.momentum_buffer: torch.Tensor | None = (
            torch.zeros_like(master) if momentum > 0 or dampening == "ema" else None
        )
        self.step_count = 0

    def _direction(self, grad: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
        """b after this gradient (``buffer`` updated in place), or g itself without one."""
        if buffer is None:
            return grad
        if self.dampening == "ema":
            return buffer.lerp_(grad, 1.0 - self.momentum)
        if self.step_count == 0:
            return buffer.copy_(grad)
        return buffer.mul_(self.momentum).add_(grad)

    def _update(
        self, target: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor | None, lr: float
    ) -> None:
        if self.weight_decay:
            target.mul_(1.0 - lr * self.weight_decay)
        target.add_(self._direction(grad, buffer), alpha=-lr)

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """Apply one step with gradient ``grad``."""
        self._update(self.master, grad, self.momentum_buffer, lr)
        self.step_count += 1

    def lookahead(self, grad: torch.Tensor, *, lr: float, out: torch.Tensor) -> torch.Tensor:
        """The parameters :meth:`step` would produce, in ``out``; nothing is written back."""
        out.copy_(self.master)
        buffer = None if self.momentum_buffer is None else self.momentum_buffer.clone()
        self._update(out, grad, buffer, lr)
        return out

    def states(self) -> dict[Role, torch.Tensor]:
        return {} if self.momentum_buffer is None else {Role.FIRST_MOMENT: self.momentum_buffer}

    def on_states_averaged(self, roles: list[Role], global_step: int) -> None:
        return None  # no bias correction, nothing to adjust

    def reset(self) -> None:
        """Forget the momentum (zero, counter 0: the "none" form copies its next gradient)."""
        if self.momentum_buffer is not None:
            self.momentum_buffer.zero_()
        self.step_count = 0

    def state_bytes(self) -> int:
        """Bytes of the momentum buffer, if any (the master is counted by its owner)."""
        return tensor_bytes(self.momentum_buffer)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"master": self.master.clone(), "step_count": self.step_count}
        if self.momentum_buffer is not None:
            state["momentum_buffer"] = self.momentum_buffer.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.master.copy_(state["master"])
        self.step_count = int(state["step_count"])
        if self.momentum_buffer is not None:
            self.momentum_buffer.copy_(state["momentum_buffer"])
