"""How a strategy gets its flat buffers when its worker is sharded (``--worker-sharding fsdp``,
:mod:`lowcomm.train.sharding`): the training loop registers, for the worker's model, what builds
them (the local shards of every parameter, aliased by FSDP's storage); a strategy asks
:func:`flat_buffers` and never sees the sharding itself, nor imports ``torch.distributed``.
"""

from __future__ import annotations

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


_MAKERS: weakref.WeakKeyDictionary[nn.Module, Callable[[nn.Module], FlatBuffers]] = (
    weakref.WeakKeyDictionary()
)


def register_flat_buffers(model: nn.Module, make: Callable[[nn.Module], FlatBuffers]) -> None:
    """Have :func:`flat_buffers` build ``model``'s buffers with ``make`` (a sharded worker's)."""
    _MAKERS[model] = make


def flat_buffers(model: nn.Module) -> FlatBuffers:
    """The flat buffers a strategy trains: plain ones, or what the training loop registered for
    ``model`` (:func:`register_flat_buffers`)."""
    make = _MAKERS.get(model)
    return FlatBuffers(model) if make is None else make(model)


def norm_summer(flat: FlatBuffers) -> Callable[[torch.Tensor], None] | None:
    """What sums a clipping norm over the shards of ``flat`` (None: it holds the whole)."""
    summer: Callable[[torch.Tensor], None] | None = getattr(flat, "sum_squared_norm", None)
    return summer
