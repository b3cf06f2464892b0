"""AdamW on one flat fp32 tensor, with PyTorch's semantics (docs/ALGORITHMS.md §0.3).

Used for sharded optimizer states (ZeRO-1 and the methods built on it), where the optimizer
owns a slice of a flat parameter vector rather than a list of ``nn.Parameter``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.flat import check_master, tensor_bytes

#: The inner optimizers ``--optim.name`` chooses from.
OptimizerName = Literal["adamw", "muon"]
#: Muon's learning-rate scaling by matrix shape (rows A, columns B).
MuonLrScale = Literal["match_rms_adamw", "original"]


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """The (inner) optimizer's hyperparameters: AdamW's, and Muon's with --optim.name muon.

    Attributes:
        name: adamw, or muon: Muon on the hidden 2-D matrices and AdamW (these same
            settings) on embeddings, head, norms and biases (docs/ALGORITHMS.md, MuLoCo;
            diloco with muon is MuLoCo). Not with zero1, the ACCO family, the DES-LOC
            family, an SGD inner optimizer or --ranks-per-worker > 1.
        lr: peak learning rate (eta); with muon it drives both optimizers (see
            muon_lr_scale).
        betas: (beta1, beta2) decay rates of the first and second moments.
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled weight decay (lambda), applied as theta *= 1 - lr * lambda
            (to the Muon matrices too).
        muon_momentum: Muon's momentum mu (B <- mu B + (1 - mu) g; 0.95, Keller Jordan's
            and torch.optim.Muon's default).
        muon_nesterov: Muon orthogonalises the Nesterov form (1 - mu) g + mu B instead of B.
        muon_ns_steps: Newton-Schulz iterations of the orthogonalisation (5, the reference's).
        muon_lr_scale: match_rms_adamw (Moonlight, arXiv 2502.16982: the step of an A x B
            matrix is lr * 0.2 * sqrt(max(A, B)), so Muon reuses AdamW's lr and weight decay)
            or original (Keller Jordan's: lr * sqrt(max(1, A / B)), which wants a larger lr).
    """

    name: OptimizerName = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_lr_scale: MuonLrScale = "match_rms_adamw"

    def __post_init__(self) -> None:
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(
                f"--optim.lr: {self.lr} must be a finite non-negative number; try 1e-3"
            )
        for index, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(
                    f"--optim.betas[{index}]: {beta} must lie in [0, 1); try 0.9, 0.95"
                )
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"--optim.eps: {self.eps} must be a finite positive number; try 1e-8")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(
                f"--optim.weight-decay: {self.weight_decay} must be a finite number >= 0; try 0.1"
            )
        self._check_muon()

    def _check_muon(self) -> None:
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"--optim.name: unknown {self.name!r}; choose adamw or muon")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(
                f"--optim.muon-momentum: {self.muon_momentum} must lie in [0, 1); try 0.95"
            )
        if (
            isinstance(self.muon_ns_steps, bool)
            or not isinstance(self.muon_ns_steps, int)
            or not 1 <= self.muon_ns_steps <= 20
        ):
            raise ValueError(
                f"--optim.muon-ns-steps: {self.muon_ns_steps} must be an integer in [1, 20]; try 5"
            )
        if self.muon_lr_scale not in ("match_rms_adamw", "original"):
            raise ValueError(
                f"--optim.muon-lr-scale: unknown {self.muon_lr_scale!r}; choose "
                f"match_rms_adamw or original"
            )
        if self.name != "muon":
            defaults = AdamWConfig(name="muon")
            for key in ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_lr_scale"):
                if getattr(self, key) != getattr(defaults, key):
                    flag = "--optim." + key.replace("_", "-")
                    raise ValueError(
                        f"{flag}: {getattr(self, key)!r} is set but --optim.name is "
                        f"{self.name}; add --optim.name muon, or drop {flag}"
                    )


def _adamw_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: tuple[int, int],
    config: AdamWConfig,
    lr: float,
) -> None:
    """One AdamW update in place; ``steps`` = (s_m, s_v), already incremented (the class
    docstring). Shared by the step and the lookahead, so the two agree bit for bit."""
    beta1, beta2 = config.betas
    bias1 = 1.0 - beta1 ** steps[0]
    bias2 = 1.0 - beta2 ** steps[1]
    if config.weight_decay:
        master.mul_(1.0 - lr * config.weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq / bias2).sqrt_().add_(config.eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias1)


def fused_available(master: torch.Tensor) -> bool:
    """Whether steps on ``master`` use torch's fused AdamW kernel: on a GPU, where it exists
    (one kernel for the whole update, no full-size temporary). On the CPU the update stays
    :func:`_adamw_update`'s, bit for bit the one the regression pins were recorded with."""
    return master.is_cuda and hasattr(torch, "_fused_adamw_")


def _fused_adamw_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    config: AdamWConfig,
    lr: float,
) -> None:
    """:func:`_adamw_update` with one counter (s_m = s_v, held in the one-element float32
    ``step`` on the master's device) through torch's fused AdamW kernel: the same update,
    equal to rounding (it divides sqrt(v) by sqrt(1 - beta2^s) where the unfused path takes
    sqrt(v / (1 - beta2^s)))."""
    beta1, beta2 = config.betas
    torch._fused_adamw_(
        [master], [grad], [exp_avg], [exp_avg_sq], [], [step],
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=config.weight_decay, eps=config.eps,
        amsgrad=False, maximize=False,
    )  # fmt: skip


class FlatAdamW:
    """AdamW over one flat fp32 master tensor (a :class:`~lowcomm.optim.flat.FlatOptimizer`).

    State: first moment ``m``, second moment ``v``, one bias-correction counter per moment
    (``s_m``, ``s_v``; equal, and called ``step_count``, unless DES-LOC averaged one moment
    without the other). One step is, with gradient ``g`` and learning rate ``eta``::

        s_m, s_v <- s_m + 1, s_v + 1
        theta <- theta * (1 - eta * lambda)
        m <- beta1 m + (1 - beta1) g
        v <- beta2 v + (1 - beta2) g^2
        theta <- theta - eta * [m / (1 - beta1^s_m)] / (sqrt(v / (1 - beta2^s_v)) + eps)

    When a moment is replaced by a cross-worker average its counter becomes the global step
    (the averaged moment carries the whole run's history; DES-LOC, docs/ALGORITHMS.md §5.5).

    Args:
        master: the fp32 parameters this optimizer owns; updated in place.
        config: hyperparameters (``config.lr`` is not read: the learning rate comes with
            each step).
    """

    def __init__(self, master: torch.Tensor, config: AdamWConfig) -> None:
        check_master(master, type(self).__name__)
        self.master = master
        self.config = config
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.first_moment_steps = 0
        self.second_moment_steps = 0

    def _update(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        moments: tuple[torch.Tensor, torch.Tensor],
        steps: tuple[int, int],
        lr: float,
    ) -> None:
        """One update (the step's and the lookahead's, so that the two agree): torch's fused
        kernel on a GPU when both moments count the same steps, else :func:`_adamw_update`."""
        if fused_available(master) and steps[0] == steps[1]:
            counter = getattr(self, "_fused_step", None)
            if counter is None:
                counter = torch.zeros((), dtype=torch.float32, device=master.device)
                self._fused_step = counter
            counter.fill_(float(steps[0]))  # (a fill kernel: no host-to-device copy)
            _fused_adamw_update(master, grad, *moments, counter, self.config, lr)
            return
        _adamw_update(master, grad, *moments, steps, self.config, lr)

    @property
    def step_count(self) -> int:
        """Steps taken since the state started (the first moment's counter)."""
        return self.first_moment_steps

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """Apply one AdamW step with gradient ``grad`` (same shape as the master)."""
        self.first_moment_steps += 1
        self.second_moment_steps += 1
        self._update(
            self.master, grad, (self.exp_avg, self.exp_avg_sq),
            (self.first_moment_steps, self.second_moment_steps), lr,
        )  # fmt: skip

    def lookahead(self, grad: torch.Tensor, *, lr: float, out: torch.Tensor) -> torch.Tensor:
        """AdamW lookahead (docs/ALGORITHMS.md §0.3): the theta' one step with ``grad`` would
        give from the current (theta, m, v, s), written to ``out``; nothing is written back."""
        out.copy_(self.master)
        self._update(
            out, grad, (self.exp_avg.clone(), self.exp_avg_sq.clone()),
            (self.first_moment_steps + 1, self.second_moment_steps + 1), lr,
        )  # fmt: skip
        return out

    def states(self) -> dict[Role, torch.Tensor]:
        return {Role.FIRST_MOMENT: self.exp_avg, Role.SECOND_MOMENT: self.exp_avg_sq}

    def on_states_averaged(self, roles: list[Role], global_step: int) -> None:
        if Role.FIRST_MOMENT in roles:
            self.first_moment_steps = global_step
        if Role.SECOND_MOMENT in roles:
            self.second_moment_steps = global_step

    def reset(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.first_moment_steps = 0
        self.second_moment_steps = 0

    def state_bytes(self) -> int:
        """Bytes of the two moments (the master is counted by its owner)."""
        return tensor_bytes(self.exp_avg, self.exp_avg_sq)

    def state_dict(self) -> dict[str, Any]:
        return {
            "master": self.master.clone(),
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "step_count": self.first_moment_steps,
            "second_moment_steps": self.second_moment_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            value = state[name]
            assert isinstance(value, torch.Tensor)
            getattr(self, name).copy_(value)
        self.first_moment_steps = int(state["step_count"])
        self.second_moment_steps = int(state.get("second_moment_steps", state["step_count"]))


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
        check_master(master, type(self).__name__)
        self.master = master
        self.config = config
        self.group = group
        self.slice_numel = -(-master.numel() // group.world_size)
        self.begin = min(group.rank * self.slice_numel, master.numel())
        self.end = min(self.begin + self.slice_numel, master.numel())
        self.exp_avg = torch.zeros(self.end - self.begin, dtype=torch.float32, device=master.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.first_moment_steps = 0
        self.second_moment_steps = 0

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        self.first_moment_steps += 1
        self.second_moment_steps += 1
        mine = slice(self.begin, self.end)
        self._update(
            self.master[mine], grad[mine], (self.exp_avg, self.exp_avg_sq),
            (self.first_moment_steps, self.second_moment_steps), lr,
        )  # fmt: skip
        piece = torch.zeros(self.slice_numel, dtype=torch.float32, device=self.master.device)
        piece[: self.end - self.begin].copy_(self.master[mine])
        gathered = torch.empty(
            self.slice_numel * self.group.world_size, dtype=torch.float32, device=self.master.device
        )
        self.group.all_gather(gathered, piece, role=Role.PARAMETER).wait()
        self.master.copy_(gathered[: self.master.numel()])

    def lookahead(self, grad: torch.Tensor, *, lr: float, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "ReplicaShardedAdamW has no lookahead (its moments are split over the replicas); "
            "ACCO, DPU and WP refuse --ranks-per-worker > 1"
        )

    def states(self) -> dict[Role, torch.Tensor]:
        raise NotImplementedError(
            "ReplicaShardedAdamW holds only its slice of the moments; a method that averages "
            "optimizer states uses an unsharded optimizer"
        )


def make_adamw(master: torch.Tensor, config: AdamWConfig, replicas: Comm | None) -> FlatAdamW:
    """AdamW for a strategy's (inner) optimizer: sharded over ``replicas`` (the worker's inner
    group, see ``lowcomm.comm.hierarchical.replica_group``) when there is more than one."""
    if replicas is not None and replicas.world_size > 1:
        return ReplicaShardedAdamW(master, config, replicas)
    return FlatAdamW(master, config)
