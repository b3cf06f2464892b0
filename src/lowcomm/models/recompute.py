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
process-global generators by ``checkpoint`` itself, and the worker's own generator bound to
the block's dropout (:func:`lowcomm.models.gpt.drawing_from`) by :func:`_replaying_generators`.
The numbers are those of a run without it; it costs one more forward per block and keeps only
each block's input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lowcomm.models.blocks import transformer_blocks
from lowcomm.models.gpt import Dropout


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
        block.forward = functools.partial(
            checkpoint,
            block.forward,
            use_reentrant=False,
            context_fn=_replaying_generators(block),
        )
    return len(blocks)


Contexts = tuple[AbstractContextManager[None], AbstractContextManager[None]]


def _replaying_generators(block: nn.Module) -> Callable[[], Contexts]:
    """``checkpoint``'s ``context_fn`` for ``block``: called as the forward starts, it notes
    the generator bound to each of the block's dropout modules and its state; the
    recomputation in the backward runs with those generators bound again (the backward may
    run after the binding ended), from those states (the same masks), and then puts the
    bindings and the states back as it found them (the forward had drawn past them)."""

    def contexts() -> Contexts:
        bound = [
            (module, module.generator)
            for module in block.modules()
            if isinstance(module, Dropout) and module.generator is not None
        ]  # (the forward's bindings)
        if not bound:
            return nullcontext(), nullcontext()
        generators = list({id(generator): generator for _, generator in bound}.values())
        at_forward = [generator.get_state() for generator in generators]
        return nullcontext(), _replay(bound, generators, at_forward)

    return contexts


@contextmanager
def _replay(
    bound: list[tuple[Dropout, torch.Generator]],
    generators: list[torch.Generator],
    states: list[torch.Tensor],
) -> Iterator[None]:
    bindings = [(module, module.generator) for module, _ in bound]
    now = [generator.get_state() for generator in generators]
    for module, generator in bound:
        module.generator = generator
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
    try:
        yield
    finally:
        for module, binding in bindings:
            module.generator = binding
        for generator, state in zip(generators, now, strict=True):
            generator.set_state(state)


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every transformer block of ``model`` with ``torch.compile``
    (inductor), in place; returns how many. The block's own hooks (FSDP2's all-gather before
    its forward, on a sharded worker) stay outside the compiled code, and names do not change.
    Compiled after :func:`checkpoint_blocks`, a block's recomputation is compiled with it.

    Raises:
        ValueError: ``model`` has no list of blocks.
    """
    blocks = transformer_blocks(model)
    if blocks is None:
        raise ValueError(
            f"--compile: {type(model).__name__} has no list of transformer blocks (a "
            f"ModuleList of one module class) to compile; drop the option"
        )
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)
