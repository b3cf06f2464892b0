"""Helpers shared by the multi-process tests (importable from spawned workers)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.strategies.base import MicroBatchResult, Strategy

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def global_batch(
    step: int, world_size: int, per_rank: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step``: rank r owns rows [r*per_rank, (r+1)*per_rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(
        0, TINY.vocab_size, (world_size * per_rank, TINY.block_size + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def closure_for(
    strategy: Strategy, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[], MicroBatchResult]:
    """A closure that runs forward and backward on ``batches`` in order, one per call."""
    queue = list(batches)

    def closure() -> MicroBatchResult:
        inputs, targets = queue.pop(0)
        _, loss = strategy.model(inputs, targets)
        assert loss is not None
        loss.backward()
        return MicroBatchResult(float(loss), inputs.shape[0], inputs.numel())

    return closure
