"""The next-token loss without materialising the whole ``B x T x V`` logits.

A language model's output layer maps each of the ``N = B * T`` hidden states to ``V`` logits.
With a large vocabulary (Llama 3: 128k) the float32 logits of a micro-batch of 8 x 256 are
1 GB, and autograd keeps the log-softmax and then the logits' gradient beside them. Here the
``N`` rows are cut into chunks of at most :data:`CHUNK_ELEMENTS` logits; each chunk's logits
are computed, reduced to a summed cross-entropy and dropped, inside
``torch.utils.checkpoint`` so that backward recomputes one chunk's logits at a time instead of
keeping every chunk's. Peak memory is then one chunk's logits and their gradient (plus the
output matrix's gradient), whatever ``N`` and ``V``; the price is the output layer's matmul
computed twice. The log-sum-exp is taken in float32 even when the logits come out of the
matmul in bfloat16 (autocast), since that is where low precision hurts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as functional
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 24
"""Logits per chunk (64 MiB in float32). A loss whose ``N x V`` logits fit in one chunk is
computed in one piece, exactly as an unchunked cross-entropy."""


def fits_one_chunk(rows: int, vocab_size: int, chunk_elements: int | None = None) -> bool:
    """Whether ``rows x vocab_size`` logits fit in one chunk of ``chunk_elements`` (default
    :data:`CHUNK_ELEMENTS`); then no chunking is needed."""
    return rows * vocab_size <= (CHUNK_ELEMENTS if chunk_elements is None else chunk_elements)


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor) -> Tensor:
    logits = functional.linear(hidden, weight, bias)  # (n, V)
    return functional.cross_entropy(at_least_float32(logits), targets, reduction="sum")


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    chunk_elements: int | None = None,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, chunk by chunk.

    Args:
        hidden: Final hidden states, shape ``(N, H)`` (or ``(B, T, H)``, flattened here).
        weight: Output matrix, shape ``(V, H)``.
        targets: Target ids, shape ``(N,)`` (or ``(B, T)``).
        bias: Output bias ``(V,)``, or None.
        chunk_elements: Most logits computed at once (default :data:`CHUNK_ELEMENTS`).

    Returns:
        The mean over all ``N`` rows, a float32 scalar.
    """
    hidden = hidden.reshape(-1, hidden.size(-1))
    targets = targets.reshape(-1)
    rows, vocab_size = hidden.size(0), weight.size(0)
    budget = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    step = max(1, budget // vocab_size)
    total: Tensor | None = None
    for start in range(0, rows, step):
        part = checkpoint(
            _chunk_loss_sum,
            hidden[start : start + step],
            weight,
            bias,
            targets[start : start + step],
            use_reentrant=False,
        )
        total = part if total is None else total + part
    assert total is not None, "no rows to compute a loss over"
    return total / rows


def at_least_float32(logits: Tensor) -> Tensor:
    """Logits in float32, or wider if they are (float64 stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits already computed, in float32: the one-piece path."""
    flat = logits.reshape(-1, logits.size(-1))
    return functional.cross_entropy(at_least_float32(flat), targets.reshape(-1))


__all__ = ["CHUNK_ELEMENTS", "chunked_cross_entropy", "fits_one_chunk", "next_token_loss"]
