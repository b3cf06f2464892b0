"""SGD with momentum on one flat fp32 tensor, in DES-LOC's form (docs/ALGORITHMS.md §5.5, Alg. 4).

The momentum is an exponential moving average of gradients (dampened), not PyTorch's
``u <- beta u + g``::

    u <- beta u + (1 - beta) g
    x <- x - eta u

Weight decay, when non-zero, is decoupled (``x <- x (1 - eta lambda)`` before the step).
"""

from __future__ import annotations

import torch


class FlatSGDM:
    """SGD with (dampened) momentum over one flat fp32 tensor, updated in place.

    Args:
        master: the 1-D float32 parameters this optimizer owns.
        beta: momentum decay (DES-LOC's beta).
        weight_decay: decoupled weight decay lambda.
    """

    def __init__(self, master: torch.Tensor, *, beta: float, weight_decay: float = 0.0) -> None:
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError("FlatSGDM needs a 1-D float32 master tensor")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"sgdm.beta: {beta} must lie in [0, 1); try 0.9")
        if not weight_decay >= 0:
            raise ValueError(f"sgdm.weight_decay: {weight_decay} must be >= 0; try 0")
        self.master = master
        self.beta = beta
        self.weight_decay = weight_decay
        self.momentum = torch.zeros_like(master)
        self.step_count = 0

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """Apply one step with gradient ``grad``."""
        if self.weight_decay:
            self.master.mul_(1.0 - lr * self.weight_decay)
        self.momentum.lerp_(grad, 1.0 - self.beta)
        self.master.add_(self.momentum, alpha=-lr)
        self.step_count += 1

    def reset(self) -> None:
        """Forget the momentum (zero, counter 0)."""
        self.momentum.zero_()
        self.step_count = 0

    def state_bytes(self) -> int:
        return self.momentum.numel() * self.momentum.element_size()
