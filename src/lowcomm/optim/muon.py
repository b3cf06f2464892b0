"""Muon on the hidden matrices, AdamW on the rest, over one flat fp32 tensor (MuLoCo's inner
optimizer; docs/ALGORITHMS.md, "MuLoCo").

Muon (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/; the same rule as
``torch.optim.Muon``) updates a 2-D weight ``W`` (A x B) with gradient ``G``::

    B <- mu B + (1 - mu) G                       # momentum buffer, EMA form
    U <- (1 - mu) G + mu B   (nesterov)  or  B   # the Nesterov look-ahead
    O <- NS_k(U)                                 # k Newton-Schulz steps ~ U's polar factor
    W <- W (1 - eta lambda)                      # decoupled weight decay, as AdamW's
    W <- W - eta s(A, B) O

with ``s(A, B) = 0.2 sqrt(max(A, B))`` (Moonlight, Liu et al. 2025, arXiv 2502.16982: the
update's RMS matches AdamW's, so one learning rate and weight decay serve both optimizers) or
``sqrt(max(1, A / B))`` (Keller Jordan's original). ``NS_k`` is the quintic iteration of the
reference: ``X <- U / max(||U||_F, eps)`` (transposed when A > B), then k times
``X <- a X + (b X X^T + c (X X^T)^2) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, in
bfloat16 as the reference computes it.

Which parameters get Muon (:func:`muon_parameter_names`): the 2-D parameters except the
embeddings (every ``nn.Embedding``'s weight) and the output head (a module named ``lm_head``,
or a Hugging Face model's ``get_output_embeddings()``; the built-in GPT ties it to the token
embedding). Everything else (embeddings, head, norms, biases, anything not 2-D) gets AdamW with
the run's --optim settings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.adamw import AdamWConfig, _adamw_update
from lowcomm.optim.flat import check_master, tensor_bytes

#: The quintic Newton-Schulz coefficients (a, b, c) of the reference implementation.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: The floor of the Frobenius norm the iteration divides by (torch.optim.Muon's).
NS_EPS = 1e-7


def newton_schulz(matrix: torch.Tensor, steps: int, eps: float = NS_EPS) -> torch.Tensor:
    """``steps`` quintic Newton-Schulz iterations towards the polar factor of a 2-D ``matrix``
    (its singular values pushed to about 1), computed in bfloat16 (the module docstring)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_scale(rows: int, cols: int, kind: str) -> float:
    """Muon's per-shape learning-rate factor s(A, B) (the module docstring)."""
    if kind == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _excluded_ids(model: nn.Module) -> set[int]:
    """Ids of the embedding and output-head weights (never Muon's)."""
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head" and isinstance(module, nn.Linear):
            excluded.add(id(module.weight))
        get_output = getattr(module, "get_output_embeddings", None)
        head = get_output() if callable(get_output) else None
        if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), nn.Parameter):
            excluded.add(id(head.weight))
    return excluded


def takes_muon(model: nn.Module) -> list[bool]:
    """For each trainable parameter of ``model`` (``model.parameters()`` order, tied ones
    once: :class:`~lowcomm.strategies.flat.FlatBuffers`' order), whether Muon updates it."""
    excluded = _excluded_ids(model)
    return [p.dim() == 2 and id(p) not in excluded for p in model.parameters() if p.requires_grad]


def muon_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters Muon updates (the rest get AdamW)."""
    excluded = _excluded_ids(model)
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and id(p) not in excluded
    ]


@dataclass(frozen=True)
class Matrix:
    """One Muon matrix inside the flat master: ``master[offset : offset + rows * cols]``
    viewed as rows x cols (row-major, as the parameter itself)."""

    offset: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class MuonLayout:
    """Which part of a flat master Muon updates (``matrices``) and which AdamW does
    (``adamw_ranges``, the complement as [begin, end) ranges, padding included)."""

    matrices: tuple[Matrix, ...]
    adamw_ranges: tuple[tuple[int, int], ...]
    numel: int

    @property
    def muon_numel(self) -> int:
        return sum(m.numel for m in self.matrices)

    @property
    def adamw_numel(self) -> int:
        return self.numel - self.muon_numel

    @classmethod
    def build(
        cls,
        model: nn.Module,
        parameters: Sequence[nn.Parameter],
        offsets: Sequence[int],
        numel: int,
    ) -> MuonLayout:
        """The layout of a flat buffer holding ``parameters`` at ``offsets`` (``numel``
        long, padding included), the Muon ones chosen by :func:`takes_muon`."""
        chosen = takes_muon(model)
        if len(chosen) != len(parameters):
            raise ValueError("the flat buffer does not hold the model's trainable parameters")
        matrices = tuple(
            Matrix(offset, p.shape[0], p.shape[1])
            for p, offset, muon in zip(parameters, offsets, chosen, strict=True)
            if muon
        )
        ranges: list[tuple[int, int]] = []
        cursor = 0
        for matrix in sorted(matrices, key=lambda m: m.offset):
            if matrix.offset > cursor:
                ranges.append((cursor, matrix.offset))
            cursor = matrix.offset + matrix.numel
        if cursor < numel:
            ranges.append((cursor, numel))
        return cls(matrices, tuple(ranges), numel)


@dataclass
class _State:
    """Muon's momentum and AdamW's moments, compact (each holds only its own part)."""

    momentum: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def clone(self) -> _State:
        return _State(self.momentum.clone(), self.exp_avg.clone(), self.exp_avg_sq.clone())


class FlatMuon:
    """Muon on the layout's matrices and AdamW on the rest of one flat fp32 master (a
    :class:`~lowcomm.optim.flat.FlatOptimizer`; the module docstring gives the rule).

    State: one momentum buffer as long as the Muon matrices together, AdamW's two moments as
    long as the rest, and one step counter (AdamW's bias correction).

    Args:
        master: the fp32 parameters; updated in place.
        config: --optim (``config.lr`` is not read: the learning rate comes with each step).
        layout: which part of ``master`` is Muon's (:meth:`MuonLayout.build`).
    """

    def __init__(self, master: torch.Tensor, config: AdamWConfig, layout: MuonLayout) -> None:
        check_master(master, type(self).__name__)
        if layout.numel != master.numel():
            raise ValueError(
                f"FlatMuon: layout of {layout.numel} elements for a master of {master.numel()}"
            )
        self.master = master
        self.config = config
        self.layout = layout
        self.state = _State(
            torch.zeros(layout.muon_numel, dtype=torch.float32, device=master.device),
            torch.zeros(layout.adamw_numel, dtype=torch.float32, device=master.device),
            torch.zeros(layout.adamw_numel, dtype=torch.float32, device=master.device),
        )
        self.step_count = 0

    def _update(
        self, master: torch.Tensor, grad: torch.Tensor, state: _State, step: int, lr: float
    ) -> None:
        """One step of both optimizers on ``master`` with ``state`` (shared by the step and
        the lookahead, so the two agree bit for bit)."""
        config = self.config
        mu = config.muon_momentum
        cursor = 0
        for m in self.layout.matrices:
            window = slice(m.offset, m.offset + m.numel)
            g = grad[window].view(m.rows, m.cols)
            buffer = state.momentum[cursor : cursor + m.numel].view(m.rows, m.cols)
            cursor += m.numel
            buffer.lerp_(g, 1.0 - mu)
            direction = g.lerp(buffer, mu) if config.muon_nesterov else buffer
            ortho = newton_schulz(direction, config.muon_ns_steps)
            weight = master[window].view(m.rows, m.cols)
            if config.weight_decay:
                weight.mul_(1.0 - lr * config.weight_decay)
            weight.add_(ortho, alpha=-lr * lr_scale(m.rows, m.cols, config.muon_lr_scale))
        cursor = 0
        for begin, end in self.layout.adamw_ranges:
            moments = slice(cursor, cursor + end - begin)
            cursor += end - begin
            _adamw_update(
                master[begin:end], grad[begin:end], state.exp_avg[moments],
                state.exp_avg_sq[moments], (step, step), config, lr,
            )  # fmt: skip

    def step(self, grad: torch.Tensor, *, lr: float) -> None:
        """One Muon + AdamW step with gradient ``grad`` (as long as the master)."""
        self.step_count += 1
        self._update(self.master, grad, self.state, self.step_count, lr)

    def lookahead(self, grad: torch.Tensor, *, lr: float, out: torch.Tensor) -> torch.Tensor:
        """The parameters one step would give, in ``out``; nothing is written back."""
        out.copy_(self.master)
        self._update(out, grad, self.state.clone(), self.step_count + 1, lr)
        return out

    def states(self) -> dict[Role, torch.Tensor]:
        raise NotImplementedError(
            "FlatMuon's states are not master-sized (Muon's momentum covers the matrices, "
            "AdamW's moments the rest); a method that averages optimizer states refuses "
            "--optim.name muon"
        )

    def on_states_averaged(self, roles: list[Role], global_step: int) -> None:
        raise NotImplementedError("FlatMuon's states are never averaged")

    def reset(self) -> None:
        for tensor in (self.state.momentum, self.state.exp_avg, self.state.exp_avg_sq):
            tensor.zero_()
        self.step_count = 0

    def state_bytes(self) -> int:
        """Bytes of Muon's momentum and AdamW's two moments (the master is its owner's)."""
        return tensor_bytes(self.state.momentum, self.state.exp_avg, self.state.exp_avg_sq)

    def state_dict(self) -> dict[str, Any]:
        # Keys unlike FlatAdamW's ("exp_avg"...): elastic resume treats them as plain
        # per-worker tensors, never as AdamW moments to split over replicas.
        return {
            "master": self.master.clone(),
            "muon_momentum": self.state.momentum.clone(),
            "adamw_exp_avg": self.state.exp_avg.clone(),
            "adamw_exp_avg_sq": self.state.exp_avg_sq.clone(),
            "step_count": self.step_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "muon_momentum" not in state:
            raise ValueError(
                "--optim.name: the checkpoint holds AdamW's state, not Muon's; resume with "
                "--optim.name adamw as it was trained"
            )
        pairs = (
            (self.master, "master"),
            (self.state.momentum, "muon_momentum"),
            (self.state.exp_avg, "adamw_exp_avg"),
            (self.state.exp_avg_sq, "adamw_exp_avg_sq"),
        )
        for tensor, name in pairs:
            value = state[name]
            assert isinstance(value, torch.Tensor)
            tensor.copy_(value)
        self.step_count = int(state["step_count"])


def muon_refusal(method: str, why: str) -> ValueError:
    """The one-line error of a method that cannot run Muon as its inner optimizer."""
    return ValueError(
        f"--optim.name: muon with --method {method}: {why}; use --optim.name adamw with this "
        f"method, or a method whose inner optimizer is AdamW (`lowcomm methods` lists them)"
    )


def check_muon_replicas(config: AdamWConfig, replicas: Comm | None, method: str) -> None:
    """Refuse Muon on a worker of several ranks (its momentum is not split over replicas)."""
    if config.name == "muon" and replicas is not None and replicas.world_size > 1:
        raise ValueError(
            f"--optim.name: muon with --ranks-per-worker {replicas.world_size} (--method "
            f"{method}): Muon's matrices are not split over a worker's ranks; use "
            f"--ranks-per-worker 1 or --optim.name adamw"
        )
