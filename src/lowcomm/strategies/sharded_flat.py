"""How a strategy gets its flat buffers when its worker is sharded (``--worker-sharding fsdp``,
:mod:`lowcomm.train.sharding`): the training loop registers, for the worker's model, what builds
them (the local shards of every parameter, aliased by FSDP's storage); a strategy asks
:func:`flat_buffers` and never sees the sharding itself, nor imports ``torch.distributed``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch import nn

from lowcomm.strategies.flat import FlatBuffers

#: The attribute in which :func:`shard_model` records, on each FSDP-sharded parameter, the
#: elements it takes in a :class:`ShardedFlatBuffers` layout (its padded local shard).
FLAT_NUMEL_ATTRIBUTE = "_lowcomm_flat_numel"


def flat_numel(parameter: torch.Tensor) -> int:
    """Elements ``parameter`` takes in its strategy's flat buffer: its padded local shard when
    FSDP-sharded, else all of it."""
    numel: int = getattr(parameter, FLAT_NUMEL_ATTRIBUTE, parameter.numel())
    return numel


#: What builds a sharded worker's flat buffers: (model, pad_to) -> buffers.
Maker = Callable[[nn.Module, int], FlatBuffers]

_MAKERS: weakref.WeakKeyDictionary[nn.Module, Maker] = weakref.WeakKeyDictionary()


def register_flat_buffers(model: nn.Module, make: Maker) -> None:
    """Have :func:`flat_buffers` build ``model``'s buffers with ``make`` (a sharded worker's)."""
    _MAKERS[model] = make


def flat_buffers(model: nn.Module, *, pad_to: int = 1) -> FlatBuffers:
    """The flat buffers a strategy trains: plain ones, or what the training loop registered for
    ``model`` (:func:`register_flat_buffers`); the length rounded up to a multiple of
    ``pad_to`` (ZeRO-1's even reduce-scatter)."""
    make = _MAKERS.get(model)
    return FlatBuffers(model, pad_to=pad_to) if make is None else make(model, pad_to)


def is_sharded(flat: FlatBuffers) -> bool:
    """Whether ``flat`` holds only this rank's shards of its worker's parameters."""
    return norm_summer(flat) is not None


def norm_summer(flat: FlatBuffers) -> Callable[[torch.Tensor], None] | None:
    """What sums a clipping norm over the shards of ``flat`` (None: it holds the whole)."""
    summer: Callable[[torch.Tensor], None] | None = getattr(flat, "sum_squared_norm", None)
    return summer


def whole_norm(flat: FlatBuffers, tensor: torch.Tensor) -> float:
    """The L2 norm of ``tensor`` (shaped like a part of ``flat``) over the whole worker: on a
    sharded worker the squared norms of the ranks' shards are summed first (a collective over
    the worker's ranks: every rank calls it), so every rank reads the replicated run's norm."""
    summer = norm_summer(flat)
    if summer is None:
        return float(tensor.norm())
    squared = tensor.detach().double().square().sum().reshape(1)
    summer(squared)
    return math.sqrt(float(squared))


#: (start in the whole model's flat layout, stop there, start in this rank's flat buffer)
WholeRange = tuple[int, int, int]


def whole_ranges(flat: FlatBuffers) -> list[WholeRange]:
    """Where the elements of ``flat`` sit in the whole model's flat layout (the replicated
    :class:`FlatBuffers`' order): one contiguous range per parameter (a shard is a run of rows,
    hence of elements); padding is in none."""
    ranges: list[WholeRange] | None = getattr(flat, "whole_ranges", None)
    if ranges is not None:
        return ranges
    return [
        (offset, offset + p.numel(), offset)
        for p, offset in zip(flat.parameters, flat.offsets, strict=True)
    ]


def whole_mean(flat: FlatBuffers, tensor: torch.Tensor) -> float:
    """The mean of ``tensor`` (shaped like ``flat.params``) over the whole worker's parameters:
    its own mean on a whole replica; on a sharded worker the sum and count of the shards'
    elements (padding left out) summed over the worker's ranks (a collective)."""
    summer = norm_summer(flat)
    if summer is None:
        return float(tensor.mean())
    total = torch.zeros(2, dtype=torch.float64, device=tensor.device)
    for start, stop, local in whole_ranges(flat):
        total[0] += tensor[local : local + stop - start].double().sum()
        total[1] += stop - start
    summer(total)
    return float(total[0] / total[1])


def ranks_mean(flat: FlatBuffers, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` averaged over the ranks of a sharded worker (in place; a collective), so that
    they take the same decisions from it; unchanged on a whole replica."""
    average: Callable[[torch.Tensor], None] | None = getattr(flat, "average_over_ranks", None)
    if average is not None:
        average(tensor)
    return tensor
