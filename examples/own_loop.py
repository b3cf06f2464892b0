"""Your own model, data loader and loop, trained with a lowcomm strategy.

Run on one machine with two workers, over an emulated 10 Gbit/s Ethernet link:

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --method zero1

or as a single worker: ``python examples/own_loop.py``. On GPUs add ``--device cuda`` (NCCL,
one GPU per process). The lines marked ``# lowcomm`` are
the only changes from the plain single-process loop this started as (which used
``optimizer = torch.optim.AdamW(...)``, ``for inputs, targets in loader:`` and
``loss.backward(); optimizer.step(); optimizer.zero_grad()``): the closure now takes the next
batch itself, because a step may run it several times.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowcomm


def make_data(rank: int, world_size: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    """A noisy linear regression; each worker keeps every world_size-th example."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 32, generator=generator)
    weights = torch.randn(32, 1, generator=generator)
    targets = inputs @ weights + 0.1 * torch.randn(4096, 1, generator=generator)
    dataset = TensorDataset(inputs[rank::world_size], targets[rank::world_size])
    return DataLoader(
        dataset, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(rank)
    )


def endless(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[tuple[torch.Tensor, ...]]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--method", default="ddp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    comm = lowcomm.connect(network="ethernet", device=args.device)  # lowcomm
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(comm.device)
    batches = endless(make_data(comm.rank, comm.world_size))  # lowcomm: each worker its shard
    strategy = lowcomm.make_strategy(
        args.method, model, comm, lr=3e-3, weight_decay=0.0, total_steps=args.steps
    )  # lowcomm

    # lowcomm: the closure draws the next batch itself. A step may call it several times
    # (acco, dpu and wp accumulate micro-batches while they communicate, --microbatches-per-step
    # accumulates too), and each call must see a fresh batch, not the step's one again.
    def closure() -> lowcomm.MicroBatchResult:
        inputs, targets = next(batches)
        inputs, targets = inputs.to(comm.device), targets.to(comm.device)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return lowcomm.MicroBatchResult(loss.item(), len(inputs), len(inputs))  # lowcomm

    first_loss = last_loss = float("nan")
    for step in range(args.steps):
        last_loss = strategy.step(closure).loss  # lowcomm: replaces backward/step/zero_grad
        if step == 0:
            first_loss = last_loss
    if comm.rank == 0:
        print(
            f"method={args.method} workers={comm.world_size} first_loss={first_loss:.4f} "
            f"last_loss={last_loss:.4f} bytes_sent={comm.bytes_sent:.0f}"
        )


if __name__ == "__main__":
    main()
