"""Outer Nesterov SGD on a flat fp32 tensor (docs/ALGORITHMS.md §0.3), used by the DiLoCo family.

The outer gradient uses the gradient-like sign convention ``Delta = anchor - local``, so a
step *subtracts* it, exactly like PyTorch's ``SGD(nesterov=True, dampening=0)``::

    b <- mu * b + Delta              # b starts at 0, so the first call gives b = Delta
    theta <- theta - eta_out * (Delta + mu * b)     (nesterov)
    theta <- theta - eta_out * b                    (plain heavy ball, nesterov=False)

Symbols: eta_out -> ``lr``, mu -> ``momentum``, b -> ``momentum_buffer``, theta -> ``params``.
"""

from __future__ import annotations

import math

import torch


class OuterNesterov:
    """Outer SGD with (Nesterov) momentum over one flat fp32 tensor, updated in place.

    Args:
        params: the global (outer) parameters theta, 1-D float32; updated in place.
        lr: outer learning rate eta_out.
        momentum: outer momentum mu (0 disables momentum; then the step is theta -= lr Delta).
        nesterov: Nesterov form (the DiLoCo default) or plain heavy-ball momentum.
    """

    def __init__(
        self, params: torch.Tensor, *, lr: float, momentum: float, nesterov: bool = True
    ) -> None:
        if params.dtype != torch.float32 or params.dim() != 1:
            raise ValueError("OuterNesterov needs a 1-D float32 parameter tensor")
        if not (lr >= 0 and math.isfinite(lr)):
            raise ValueError(f"outer lr: {lr} must be a finite non-negative number; try 0.7")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum: {momentum} must lie in [0, 1); try 0.9")
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.momentum_buffer = torch.zeros_like(params)
        self.step_count = 0

    def step(self, outer_gradient: torch.Tensor) -> None:
        """Apply one outer step with the averaged outer gradient ``Delta`` (anchor - local)."""
        delta = outer_gradient.float()
        self.step_count += 1
        if self.momentum == 0.0:
            # No momentum: theta <- theta - eta_out Delta (the buffer stays zero).
            self.params.add_(delta, alpha=-self.lr)
            return
        self.momentum_buffer.mul_(self.momentum).add_(delta)
        if self.nesterov:
            update = delta.add(self.momentum_buffer, alpha=self.momentum)
        else:
            update = self.momentum_buffer
        self.params.add_(update, alpha=-self.lr)

    def state_bytes(self) -> int:
        """Bytes of the momentum buffer (the parameters are counted by their owner)."""
        return self.momentum_buffer.numel() * self.momentum_buffer.element_size()

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        return {"momentum_buffer": self.momentum_buffer.clone(), "step_count": self.step_count}

    def load_state_dict(self, state: dict[str, torch.Tensor | int]) -> None:
        buffer = state["momentum_buffer"]
        count = state["step_count"]
        assert isinstance(buffer, torch.Tensor) and isinstance(count, int)
        self.momentum_buffer.copy_(buffer)
        self.step_count = count
