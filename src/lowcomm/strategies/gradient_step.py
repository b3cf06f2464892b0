"""The gradient step every family shares: accumulate micro-batches, average, clip, step.

One place for what DDP, ZeRO-1, the ACCO chain and the inner steps of the local, DiLoCo and
DES-LOC families all do with a gradient (docs/ALGORITHMS.md §0.3):

1. :func:`accumulate`: run ``k`` micro-batches (forward and backward) into the flat gradient
   buffer G (a sum);
2. :func:`average_and_clip`: the fp32 gradient ``G / k`` (``k`` = micro-batches, or the
   contributions of every worker after a sum reduce-scatter), optionally clipped per
   coordinate to [-rho, rho] (DES-LOC), then scaled to global L2 norm at most
   ``--max-grad-norm`` (the squared norm optionally summed over shards first);
3. :func:`step_and_publish`: one optimizer step on the fp32 master, copied into the working
   parameters when they are a separate (lower-precision) tensor.

A family's own communication goes between 1 and 2 (DDP's gradient all-reduce, ZeRO-1's
reduce-scatter) or after 3 (parameter averages, outer steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.adamw import AdamWConfig, make_adamw
from lowcomm.optim.flat import FlatOptimizer
from lowcomm.optim.muon import FlatMuon, MuonLayout, check_muon_replicas
from lowcomm.strategies.base import Closure, Loss, clip_, run_microbatches
from lowcomm.strategies.flat import FlatBuffers
from lowcomm.strategies.sharded_flat import is_sharded


def accumulate(
    flat: FlatBuffers, closure: Closure, count: int, replicas: Comm | None = None
) -> tuple[Loss, int, int]:
    """Zero G, run ``count`` micro-batches into it; return (mean loss, samples, tokens).

    ``replicas``: the worker's replica group when a worker is several ranks (hierarchical
    workers, ``runtime.replica_group``): G is then averaged over it once, on the flat buffer,
    after the step's micro-batches (a mean of sums is the sum of the means: inner
    synchronous data parallelism, exact up to rounding), so every replica steps on the same
    gradient."""
    flat.check_params()
    flat.zero_grads()
    result = run_microbatches(closure, count)
    flat.sync_grads()
    if replicas is not None and replicas.world_size > 1:
        # (The gradients themselves, not the padding: the bytes of the per-micro-batch
        # averaging this replaces, once per step.)
        replicas.all_reduce(flat.grads[: flat.numel], op="mean", role=Role.GRADIENT).wait()
    return result


def average_and_clip(
    grads: torch.Tensor,
    *,
    count: int,
    max_grad_norm: float | None,
    coordinate_clip: float | None = None,
    sum_squared_norm: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The fp32 gradient ``grads / count``, clipped (in place when ``grads`` is fp32).

    Args:
        grads: a summed gradient (G, or a reduced shard of it).
        count: what it is a sum of (micro-batches, or contributions of all workers).
        max_grad_norm: scale to this global L2 norm at most (None: no norm clip).
        coordinate_clip: rho, clip every coordinate to [-rho, rho] first (None: off).
        sum_squared_norm: for a shard of the gradient, sums a one-element float64 squared
            norm over the shards in place (an all-reduce), so the norm is the global one.
    """
    grad = grads if grads.dtype == torch.float32 else grads.float()
    if count > 1:
        grad.div_(count)
    if coordinate_clip is not None:
        grad.clamp_(-coordinate_clip, coordinate_clip)
    if max_grad_norm is not None:
        squared = grad.square().sum()
        if sum_squared_norm is not None:
            squared = squared.reshape(1).double()
            sum_squared_norm(squared)
        clip_(grad, squared, max_grad_norm)
    return grad


def step_and_publish(
    optimizer: FlatOptimizer, grad: torch.Tensor, *, lr: float, flat: FlatBuffers
) -> None:
    """One optimizer step; then the working parameters take the fp32 master's values unless
    they are the master itself (fp32 parameters)."""
    optimizer.step(grad, lr=lr)
    if optimizer.master is not flat.params:
        flat.params.copy_(optimizer.master)


def make_inner_optimizer(
    model: nn.Module,
    flat: FlatBuffers,
    master: torch.Tensor,
    config: AdamWConfig,
    replicas: Comm | None,
    method: str,
) -> FlatOptimizer:
    """The AdamW-family optimizer of a method's (inner) step on the whole flat ``master``:
    AdamW (its moments split over ``replicas``, ``make_adamw``), or with ``--optim.name
    muon`` Muon on ``model``'s hidden matrices and AdamW on the rest
    (:class:`~lowcomm.optim.muon.FlatMuon`; refused with several ranks per worker)."""
    if config.name != "muon":
        return make_adamw(master, config, replicas)
    check_muon_replicas(config, replicas, method)
    if is_sharded(flat):
        raise ValueError(
            f"--optim.name: muon with --worker-sharding fsdp (--method {method}): Muon's "
            f"Newton-Schulz iteration needs each whole matrix, and a rank holds only some of "
            f"its rows; use --worker-sharding replicate or --optim.name adamw"
        )
    return FlatMuon(
        master, config, MuonLayout.build(model, flat.parameters, flat.offsets, master.numel())
    )
