"""ADOPT on one flat fp32 tensor (Taniguchi et al. 2024; docs/ALGORITHMS.md §5.1).

ADOPT changes Adam in two places: the gradient is normalised by the *previous* second moment
(so the current gradient never enters its own denominator), and the normalised gradient is
clipped to ``t^(1/4)`` before it enters the first moment. The parameter step uses the first
moment directly, without a denominator and without bias correction.

With gradient ``g_t``, learning rate ``eta`` and step counter ``t`` (0 at a fresh state)::

    t = 0:  v_0 = g_0^2                                  (initialisation only, no update)
    t >= 1: u_t = beta1 u_{t-1} + (1 - beta1) clip(g_t / max(sqrt(v_{t-1}), eps), t^(1/4))
            x_{t+1} = x_t - eta u_t
            v_t = beta2 v_{t-1} + (1 - beta2) g_t^2

Weight decay, when non-zero, is decoupled as in AdamW (``x <- x (1 - eta lambda)`` before the
step); the paper trains with ``lambda = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lowcomm.comm.base import Role
from lowcomm.optim.flat import check_master, tensor_bytes


@dataclass(frozen=True, kw_only=True)
class AdoptConfig:
    """ADOPT hyperparameters.

    Attributes:
        betas: (beta1, beta2); ADOPT's defaults are (0.9, 0.9999).
        eps: floor of sqrt(v) in the normalisation (ADOPT's default 1e-6).
        weight_decay: decoupled weight decay lambda.
    """

    betas: tuple[float, float] = (0.9, 0.9999)
    eps: float = 1e-6
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for index, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(
                    f"adopt.betas[{index}]: {beta} must lie in [0, 1); try 0.9, 0.9999"
                )
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"adopt.eps: {self.eps} must be a positive number; try 1e-6")
        if not self.weight_decay >= 0:
            raise ValueError(f"adopt.weight_decay: {self.weight_decay} must be >= 0; try 0")


def _adopt_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step_count: int,
    config: AdoptConfig,
    lr: float,
) -> None:
    """One ADOPT update (t = ``step_count`` >= 1) in place, ``exp_avg_sq`` still v_{t-1}: the
    parameters and u only; the caller updates v afterwards (step) or not at all (lookahead)."""
    beta1 = config.betas[0]
    if config.weight_decay:
        master.mul_(1.0 - lr * config.weight_decay)
    # Normalise by the previous v (before v sees this gradient), then clip to t^(1/4).
    denominator = exp_avg_sq.sqrt().clamp_(min=config.eps)
    bound = step_count**0.25
    normalised = (grad / denominator).clamp_(-bound, bound)
    exp_avg.lerp_(normalised, 1.0 - beta1)
    master.add_(exp_avg, alpha=-lr)


class FlatAdopt:
    """ADOPT over one flat fp32 tensor, updated in place (a
    :class:`~lowcomm.optim.flat.FlatOptimizer`).

    State: first moment ``exp_avg`` (u), second moment ``exp_avg_sq`` (v), step counter
    ``step_count`` (t). A state with ``step_count == 0`` is fresh: its next step only
    initialises ``v``.

    Args:
        master: the 1-D float32 parameters this optimizer owns.
        config: hyperparameters.
    """

    def __init__(self, master: torch.Tensor, config: AdoptConfig) -> None:
        check_master(master, type(self).__name__)
        self.master = master
        self.config = config
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.step_count = 0

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """Apply one ADOPT step with gradient ``grad``."""
        beta2 = self.config.betas[1]
        if self.step_count == 0:
            # v_0 = g_0^2: the first gradient only seeds the second moment.
            self.exp_avg_sq.copy_(grad).mul_(grad)
            self.step_count = 1
            return
        _adopt_update(
            self.master, grad, self.exp_avg, self.exp_avg_sq, self.step_count, self.config, lr
        )
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        self.step_count += 1

    def lookahead(self, grad: torch.Tensor, *, lr: float, out: torch.Tensor) -> torch.Tensor:
        """The parameters :meth:`step` would produce, in ``out``; nothing is written back (a
        fresh state's step moves nothing, so its lookahead is the master itself)."""
        out.copy_(self.master)
        if self.step_count > 0:
            _adopt_update(
                out, grad, self.exp_avg.clone(), self.exp_avg_sq, self.step_count, self.config, lr
            )
        return out

    def states(self) -> dict[Role, torch.Tensor]:
        return {Role.FIRST_MOMENT: self.exp_avg, Role.SECOND_MOMENT: self.exp_avg_sq}

    def on_states_averaged(self, roles: list[Role], global_step: int) -> None:
        # The counter only sets the t^(1/4) clip bound; an averaged moment has the history of
        # the whole run. A fresh state (counter 0) is never averaged by DES-LOC: an average
        # always follows a step, and a step initialises the state.
        if any(role is not Role.PARAMETER for role in roles):
            self.step_count = max(self.step_count, global_step)

    def reset(self) -> None:
        """Forget the state (zero moments, counter 0), as a freshly started worker."""
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step_count = 0

    def state_bytes(self) -> int:
        """Bytes of the two moments (the parameters belong to the caller)."""
        return tensor_bytes(self.exp_avg, self.exp_avg_sq)

    def state_dict(self) -> dict[str, Any]:
        return {
            "master": self.master.clone(),
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "step_count": self.step_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self, name).copy_(state[name])
        self.step_count = int(state["step_count"])
