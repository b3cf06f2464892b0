"""Per-block wrappers of a model's forward: activation checkpointing and ``--compile``.

Activation checkpointing (``--activation-checkpointing``): each transformer block's
activations are recomputed in the backward instead of being kept from the forward (the
built-in GPT's blocks, a ``transformers`` model's decoder layers:
:func:`~lowcomm.models.blocks.transformer_blocks`).

The block's ``forward`` is replaced, on the instance, by a non-reentrant
:func:`torch.utils.checkpoint.checkpoint` of the original one, so parameter names, state dict
keys and exports do not change (a wrapper module would add a level to every name), and the
module's own hooks (FSDP2's all-gather before the forward, on a sharded worker) still run
around it. The recomputation restores the RNG state, so dropout draws the same mask: the
numbers are those of a run without it; it costs one more forward per block and keeps only
each block's input.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from lowcomm.models.blocks import transformer_blocks


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute every transformer block of ``model`` in the backward; returns how many
    blocks it wrapped.

    Raises:
        ValueError: ``model`` has no list of blocks.
    """
    blocks = transformer_blocks(model)
    if blocks is None:
        raise ValueError(
            f"--activation-checkpointing: {type(model).__name__} has no list of transformer "
            f"blocks (a ModuleList of one module class) to recompute; drop the option"
        )
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every transformer block of ``model`` with ``torch.compile``
    (inductor), in place; returns how many. The block's own hooks (FSDP2's all-gather before
    its forward, on a sharded worker) stay outside the compiled code, and names do not change.
    Compiled after :func:`checkpoint_blocks`, a block's recomputation is compiled with it.

    Raises:
        ValueError: ``model`` has no list of blocks.
    """
    import torch

    blocks = transformer_blocks(model)
    if blocks is None:
        raise ValueError(
            f"--compile: {type(model).__name__} has no list of transformer blocks (a "
            f"ModuleList of one module class) to compile; drop the option"
        )
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)
