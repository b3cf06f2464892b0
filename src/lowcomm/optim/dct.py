"""The chunked orthonormal DCT-II of DeMo (docs/ALGORITHMS.md, "DeMo").

The orthonormal DCT-II of a length-``N`` vector ``x`` and its inverse (the DCT-III) are::

    X_k = sqrt(2 / N) c_k sum_n x_n cos(pi (2n + 1) k / (2N)),   c_0 = 1 / sqrt(2), c_k = 1
    x_n = sqrt(2 / N) sum_k c_k X_k cos(pi (2n + 1) k / (2N))

i.e. ``X = C x`` and ``x = C^T X`` with the orthogonal matrix ``C`` (:func:`dct_matrix`, built
once per size in float64 and cached). A parameter tensor is cut into blocks as DeMo's reference
code does (github.com/bloc97/DeMo, ``TransformDCT``): along each dimension the block side is
the largest divisor of that dimension not above the target chunk, a 1-D tensor gets a 1-D DCT
per block and a 2-D tensor a separable 2-D DCT per block (``C_1 X C_2^T``); a tensor of more
dimensions is treated as 2-D (its first dimension by the product of the others) and a scalar as
1-D. :class:`BlockDCT` turns a tensor into one row of coefficients per block and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from lowcomm.comm.calibration import uncounted


@lru_cache(maxsize=64)
def _dct_matrix_cpu(size: int) -> torch.Tensor:
    n = torch.arange(size, dtype=torch.float64, device="cpu")  # (whatever device is default)
    k = n.reshape(-1, 1)
    matrix = torch.cos(math.pi * (2 * n + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    matrix[0] /= math.sqrt(2.0)
    # cos(pi m / (2N)) with m = (2n + 1) k is exactly 0 where m = N mod 2N (an odd N only),
    # but float64 cos(pi / 2) is 6e-17, and DeMo's sign step would make that a full +-lr step.
    odd = (2 * n.long() + 1) * k.long()
    matrix[odd % (2 * size) == size] = 0.0
    return matrix


_DEVICE_CACHE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def dct_matrix(
    size: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``C`` of ``size`` (``C[k, n]``, module docstring),
    computed in float64 and cast to ``dtype`` on ``device``; cached."""
    key = (size, torch.device("cpu") if device is None else torch.device(device), dtype)
    cached = _DEVICE_CACHE.get(key)
    if cached is None:
        with uncounted():  # (a constant, built by whichever worker of a process needs it first)
            cached = _dct_matrix_cpu(size).to(device=key[1], dtype=dtype)
        _DEVICE_CACHE[key] = cached
    return cached


def dct(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal DCT-II of ``x`` along its last dimension."""
    return x @ dct_matrix(x.shape[-1], x.device, x.dtype).T


def idct(coefficients: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`dct` (the orthonormal DCT-III) along the last dimension."""
    size = coefficients.shape[-1]
    return coefficients @ dct_matrix(size, coefficients.device, coefficients.dtype)


def block_side(dim: int, chunk: int) -> int:
    """The largest divisor of ``dim`` that is at most ``chunk`` (the reference code's
    ``_get_smaller_split``): the block side along a dimension of ``dim`` entries."""
    best = 1
    for d in range(1, math.isqrt(dim) + 1):
        if dim % d == 0:
            for divisor in (d, dim // d):
                if best < divisor <= chunk:
                    best = divisor
    return best


@dataclass(frozen=True)
class BlockDCT:
    """The block DCT of one tensor shape (module docstring).

    Attributes:
        shape: the tensor's shape.
        chunk: the target block side.
    """

    shape: tuple[int, ...]
    chunk: int

    @cached_property
    def matrix_shape(self) -> tuple[int, ...]:
        """The tensor as the reference code sees it: (n,) or (rows, columns)."""
        if len(self.shape) <= 1:
            return (math.prod(self.shape),)
        return (self.shape[0], math.prod(self.shape[1:]))

    @cached_property
    def sides(self) -> tuple[int, ...]:
        """The block side along each dimension of :attr:`matrix_shape`."""
        return tuple(block_side(d, self.chunk) for d in self.matrix_shape)

    @cached_property
    def block(self) -> int:
        """Entries (coefficients) per block."""
        return math.prod(self.sides)

    @cached_property
    def blocks(self) -> int:
        """Number of blocks."""
        return math.prod(self.matrix_shape) // self.block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The coefficients of ``x`` (``shape``), one row of :attr:`block` per block:
        shape ``(blocks, block)``."""
        if len(self.sides) == 1:
            (s,) = self.sides
            return dct(x.reshape(-1, s))
        (a, b), (s1, s2) = self.matrix_shape, self.sides
        c1 = dct_matrix(s1, x.device, x.dtype)
        c2 = dct_matrix(s2, x.device, x.dtype)
        # Per tile C1 @ tile @ C2^T, as two large matmuls: along the columns (every row of
        # every tile), then along the rows of each band of s1 rows; then one row per tile.
        y = (x.reshape(a, b // s2, s2) @ c2.T).reshape(a // s1, s1, b)
        y = (c1 @ y).reshape(a // s1, s1, b // s2, s2)
        return y.transpose(1, 2).reshape(-1, s1 * s2)

    def inverse(self, rows: torch.Tensor) -> torch.Tensor:
        """The tensor (``shape``) whose :meth:`forward` is ``rows``."""
        if len(self.sides) == 1:
            return idct(rows).reshape(self.shape)
        (a, b), (s1, s2) = self.matrix_shape, self.sides
        c1 = dct_matrix(s1, rows.device, rows.dtype)
        c2 = dct_matrix(s2, rows.device, rows.dtype)
        y = rows.reshape(a // s1, b // s2, s1, s2).transpose(1, 2).reshape(a // s1, s1, b)
        y = (c1.T @ y).reshape(a, b // s2, s2)
        return (y @ c2).reshape(self.shape)
