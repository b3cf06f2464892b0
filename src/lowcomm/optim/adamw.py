"""AdamW on one flat fp32 tensor, with PyTorch's semantics (ALGORITHMS.md §0.3).

Used for sharded optimizer states (ZeRO-1 and the methods built on it), where the optimizer
owns a slice of a flat parameter vector rather than a list of ``nn.Parameter``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """AdamW hyperparameters.

    Attributes:
        lr: peak learning rate (eta).
        betas: (beta1, beta2) decay rates of the first and second moments.
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled weight decay (lambda), applied as theta *= 1 - lr * lambda.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"--optim.lr: {self.lr} must be a finite non-negative number; try 1e-3")
        for index, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"--optim.betas[{index}]: {beta} must lie in [0, 1); try 0.9, 0.95")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"--optim.eps: {self.eps} must be a finite positive number; try 1e-8")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(
                f"--optim.weight-decay: {self.weight_decay} must be a finite number >= 0; try 0.1"
            )


class FlatAdamW:
    """AdamW over one flat fp32 master tensor.

    State: first moment ``m``, second moment ``v``, step count ``s``. One step is, with
    gradient ``g`` and learning rate ``eta``::

        s <- s + 1
        theta <- theta * (1 - eta * lambda)
        m <- beta1 m + (1 - beta1) g
        v <- beta2 v + (1 - beta2) g^2
        theta <- theta - eta * [m / (1 - beta1^s)] / (sqrt(v / (1 - beta2^s)) + eps)

    Args:
        master: the fp32 parameters this optimizer owns; updated in place.
        config: hyperparameters.
    """

    def __init__(self, master: torch.Tensor, config: AdamWConfig) -> None:
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError("FlatAdamW needs a 1-D float32 master tensor")
        self.master = master
        self.config = config
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.step_count = 0

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """Apply one AdamW step with gradient ``grad`` (same shape as the master)."""
        beta1, beta2 = self.config.betas
        self.step_count += 1
        bias1 = 1.0 - beta1**self.step_count
        bias2 = 1.0 - beta2**self.step_count
        if self.config.weight_decay:
            self.master.mul_(1.0 - lr * self.config.weight_decay)
        self.exp_avg.lerp_(grad, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (self.exp_avg_sq / bias2).sqrt_().add_(self.config.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)

    def state_bytes(self) -> int:
        """Bytes of the persistent tensors this optimizer holds (master and moments)."""
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        return {
            "master": self.master.clone(),
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "step_count": self.step_count,
        }

    def load_state_dict(self, state: dict[str, torch.Tensor | int]) -> None:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            value = state[name]
            assert isinstance(value, torch.Tensor)
            getattr(self, name).copy_(value)
        step_count = state["step_count"]
        assert isinstance(step_count, int)
        self.step_count = step_count
