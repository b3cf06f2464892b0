"""Your own model, data loader and loop, trained with a lowcomm strategy.

Run on one machine with two workers, over an emulated 10 Gbit/s Ethernet link:

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --method zero1

or as a single worker: ``python examples/own_loop.py``. On GPUs add ``--device cuda`` (NCCL,
one GPU per process). The lines marked ``# lowcomm`` are
the only changes from the plain single-process loop this started as (which used
``optimizer = torch.optim.AdamW(...)`` and ``loss.backward(); optimizer.step();
optimizer.zero_grad()``).
"""

from __future__ import annotations

import argparse

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
    return DataLoader(dataset, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--method", default="ddp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    comm = lowcomm.connect(network="ethernet", device=args.device)  # lowcomm
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(comm.device)
    loader = make_data(comm.rank, comm.world_size)  # lowcomm: each worker reads its shard
    strategy = lowcomm.make_strategy(args.method, model, comm, lr=3e-3, weight_decay=0.0, total_steps=args.steps)  # lowcomm

    batches = iter(loader)
    first_loss = last_loss = float("nan")
    for step in range(args.steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets = next(batches)
        inputs, targets = inputs.to(comm.device), targets.to(comm.device)

        def closure() -> lowcomm.MicroBatchResult:
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            return lowcomm.MicroBatchResult(loss.item(), len(inputs), len(inputs))  # lowcomm

        last_loss = strategy.step(closure).loss  # lowcomm: replaces backward/step/zero_grad
        if step == 0:
            first_loss = last_loss
    if comm.rank == 0:
        print(f"method={args.method} workers={comm.world_size} first_loss={first_loss:.4f} "
              f"last_loss={last_loss:.4f} bytes_sent={comm.bytes_sent:.0f}")


if __name__ == "__main__":
    main()
