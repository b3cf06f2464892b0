"""The Rosenbrock toy of DES-LOC (docs/ALGORITHMS.md §5.5 hyperparameters, §7.3 F5).

Minimise f(x1, x2) = (1 - x1)^2 + 100 (x2 - x1^2)^2 on M workers that each see the gradient
plus Gaussian noise of standard deviation sigma (1.5 in the paper, with M = 256 and
(K_x, K_u, K_v) = (192, 192, 692)). Prediction F5: DES-LOC and Local Adam reach (1, 1), FedAvg
with kept or reset optimizer state oscillates or stalls.

All M workers run in this one process, unchanged lowcomm strategies included: the model's
parameter is an (M, 2) matrix, one row per worker, and :class:`StackedWorkers` is a ``Comm``
whose mean all-reduce averages the rows. This is exact because every DES-LOC step is
elementwise (coordinate-wise clipping, Adam), so the rows never interact except through
the all-reduce; global-norm clipping, which would couple them, is switched off.

    python examples/rosenbrock_desloc.py [--workers 256] [--steps 4000] [--sigma 1.5]

It prints, per method, the averaged final point and its distance to the optimum (1, 1).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lowcomm.comm.base import CompletedHandle, Handle, ReduceOp, Role, Segments
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.strategies import MicroBatchResult, StrategyContext, strategy_class
from lowcomm.strategies.desloc import DeslocOptions

START = (-1.5, 2.0)


class StackedWorkers:
    """A ``Comm`` for M workers stacked along the rows of every tensor it is handed.

    A tensor of ``n * M * dim`` elements is read as ``n`` blocks (the states a fused sync
    concatenates) of M rows of ``dim`` elements; a mean all-reduce replaces every row of a
    block by the block's mean row. It presents itself as a group of one, since the strategy
    object itself is shared by the stacked workers.
    """

    def __init__(self, workers: int, dim: int) -> None:
        self.workers = workers
        self.dim = dim
        self.payload_elements = 0

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        if op != "mean":
            raise NotImplementedError(f"StackedWorkers only averages; got op {op!r}")
        blocks = tensor.view(-1, self.workers, self.dim)
        blocks.copy_(blocks.mean(dim=1, keepdim=True).expand_as(blocks))
        self.payload_elements += tensor.numel() // self.workers
        return CompletedHandle()

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        raise NotImplementedError("the DES-LOC family only all-reduces")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        raise NotImplementedError("the DES-LOC family only all-reduces")

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        return CompletedHandle()

    def barrier(self) -> Handle:
        return CompletedHandle()


class Rosenbrock(nn.Module):
    """One (x1, x2) row per worker; the loss is the sum of the workers' Rosenbrock values."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.point = nn.Parameter(torch.tensor([START] * workers, dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        x1, x2 = self.point[:, 0], self.point[:, 1]
        return ((1 - x1) ** 2 + 100 * (x2 - x1**2) ** 2).sum()


def run(
    method: str,
    options: DeslocOptions,
    *,
    workers: int,
    steps: int,
    sigma: float,
    lr: float,
    seed: int,
) -> torch.Tensor:
    """Train ``method`` and return the workers' averaged final point."""
    model = Rosenbrock(workers)
    comm = StackedWorkers(workers, dim=2)
    context = StrategyContext(
        optim=AdamWConfig(lr=lr, betas=(0.9, 0.999), weight_decay=0.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=0, min_lr_ratio=0.01),
        total_steps=steps,
        max_grad_norm=None,  # global-norm clipping would couple the stacked workers
    )
    strategy = strategy_class(method)(model, comm, context, options=options)  # type: ignore[call-arg]
    generator = torch.Generator().manual_seed(seed)

    def closure() -> MicroBatchResult:
        loss = model()
        loss.backward()
        assert model.point.grad is not None
        # Each worker's stochastic gradient: the true gradient plus N(0, sigma^2) noise.
        model.point.grad.add_(torch.randn(model.point.shape, generator=generator), alpha=sigma)
        return MicroBatchResult(float(loss.detach()) / workers, 1, 1)

    for _ in range(steps):
        strategy.step(closure)
    strategy.finish()
    return model.point.detach().mean(dim=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--sigma", type=float, default=1.5)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The paper's toy periods (third-party excerpt): (K_x, K_u, K_v) = (192, 192, 692); the
    # baselines sync every K = 192.
    methods = {
        "desloc": DeslocOptions(
            param_period=192, first_moment_period=192, second_moment_period=692
        ),
        "local_adam": DeslocOptions(param_period=192),
        "favg_opt": DeslocOptions(param_period=192),
        "favg_reset": DeslocOptions(param_period=192),
    }
    print(f"Rosenbrock from {START}, M = {args.workers}, sigma = {args.sigma}, {args.steps} steps")
    for method, options in methods.items():
        point = run(
            method,
            options,
            workers=args.workers,
            steps=args.steps,
            sigma=args.sigma,
            lr=args.lr,
            seed=args.seed,
        )
        distance = float((point - torch.tensor([1.0, 1.0])).norm())
        print(
            f"{method:<11} x = ({float(point[0]):+.4f}, {float(point[1]):+.4f})  distance to (1, 1) {distance:.4f}"
        )


if __name__ == "__main__":
    main()
