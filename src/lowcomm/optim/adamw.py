"""AdamW on one flat fp32 tensor, with PyTorch's semantics (docs/ALGORITHMS.md §0.3).

Used for sharded optimizer states (ZeRO-1 and the methods built on it), where the optimizer
owns a slice of a flat parameter vector rather than a list of ``nn.Parameter``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowcomm.comm.base import Comm, Role


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


def _adamw_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step_count: int,
    config: AdamWConfig,
    lr: float,
) -> None:
    """One AdamW update in place, ``step_count`` already incremented (the class docstring)."""
    beta1, beta2 = config.betas
    bias1 = 1.0 - beta1**step_count
    bias2 = 1.0 - beta2**step_count
    if config.weight_decay:
        master.mul_(1.0 - lr * config.weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq / bias2).sqrt_().add_(config.eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias1)


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
        self.step_count += 1
        _adamw_update(
            self.master, grad, self.exp_avg, self.exp_avg_sq, self.step_count, self.config, lr
        )

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


class ReplicaShardedAdamW(FlatAdamW):
    """FlatAdamW with its moments split over the R replica ranks of one worker (ZeRO-1 inside
    a worker, ``--ranks-per-worker``).

    The replicas hold the same master and receive the same (inner-averaged) gradient, so rank
    r updates only its slice r of the master with its slice of the moments, then an all-gather
    over ``group`` (the worker's fast inner link) hands every replica the whole update: the
    result equals :class:`FlatAdamW`'s exactly, with 2/R instead of 2 moment copies per rank.

    Args:
        master: the full fp32 parameters (identical on the replicas); updated in place.
        config: hyperparameters.
        group: the communicator over the worker's R replica ranks.
    """

    def __init__(self, master: torch.Tensor, config: AdamWConfig, group: Comm) -> None:
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError("ReplicaShardedAdamW needs a 1-D float32 master tensor")
        self.master = master
        self.config = config
        self.group = group
        self.slice_numel = -(-master.numel() // group.world_size)
        self.begin = min(group.rank * self.slice_numel, master.numel())
        self.end = min(self.begin + self.slice_numel, master.numel())
        self.exp_avg = torch.zeros(self.end - self.begin, dtype=torch.float32, device=master.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step_count = 0

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        self.step_count += 1
        mine = slice(self.begin, self.end)
        _adamw_update(
            self.master[mine], grad[mine], self.exp_avg, self.exp_avg_sq, self.step_count,
            self.config, lr,
        )  # fmt: skip
        piece = torch.zeros(self.slice_numel, dtype=torch.float32, device=self.master.device)
        piece[: self.end - self.begin].copy_(self.master[mine])
        gathered = torch.empty(
            self.slice_numel * self.group.world_size, dtype=torch.float32, device=self.master.device
        )
        self.group.all_gather(gathered, piece, role=Role.PARAMETER).wait()
        self.master.copy_(gathered[: self.master.numel()])


def make_adamw(master: torch.Tensor, config: AdamWConfig, replicas: Comm | None) -> FlatAdamW:
    """AdamW for a strategy's (inner) optimizer: sharded over ``replicas`` (the worker's inner
    group, see ``lowcomm.comm.hierarchical.replica_group``) when there is more than one."""
    if replicas is not None and replicas.world_size > 1:
        return ReplicaShardedAdamW(master, config, replicas)
    return FlatAdamW(master, config)
