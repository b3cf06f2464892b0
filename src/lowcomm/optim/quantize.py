"""Low-precision encodings of outer gradients (Streaming DiLoCo §"low-precision outer
gradients", docs/ALGORITHMS.md §4.2), on the device of the values (no host copy: on GPU the
payload is encoded, sent and decoded where the outer gradient lives).

Each format turns a 1-D float32 tensor into a flat ``uint8`` payload, the exact bytes that go on
the wire, and back:

* ``none``: float32, 4 bytes per element (no quantization).
* ``bf16``: round-to-nearest bfloat16, 2 bytes per element. Relative error <= 2^-8.
* ``fp8``: float8 e4m3 (max 448) with one float32 scale per row of ``row_size`` elements,
  ``scale = absmax(row) / 448``: 1 byte per element + 4 bytes per row. Error per element
  <= 2^-4 |x| (3 mantissa bits, round to nearest) + 2^-10 scale (half the subnormal spacing
  2^-9).
* ``int4``: symmetric 4-bit integers in [-7, 7] with one float32 scale per row,
  ``scale = absmax(row) / 7``, two codes per byte: 0.5 byte per element + 4 bytes per row.
  Error per element <= scale / 2. (The Streaming DiLoCo paper uses FP4 E3M0 through EXMY; we use
  a uniform 4-bit grid with per-row scale, a format whose error bound is simple and checkable.)

Rows are consecutive runs of ``row_size`` elements of the flat tensor; the last row is padded
with zeros. A payload is ``[codes | scales]``, its size given by :func:`encoded_bytes`.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

QuantizationFormat = Literal["none", "bf16", "fp8", "int4"]
FORMATS: tuple[str, ...] = get_args(QuantizationFormat)

_FP8_MAX = 448.0
_INT4_MAX = 7


def _check(fmt: str, row_size: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(
            f"quantization: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}"
        )
    if row_size < 1:
        raise ValueError(f"quantization row_size: {row_size} must be >= 1; try 256")


def _rows(numel: int, row_size: int) -> int:
    return -(-numel // row_size)


def encoded_bytes(numel: int, fmt: QuantizationFormat, row_size: int = 256) -> int:
    """Bytes of the payload that encodes ``numel`` elements in ``fmt``."""
    _check(fmt, row_size)
    if fmt == "none":
        return 4 * numel
    if fmt == "bf16":
        return 2 * numel
    rows = _rows(numel, row_size)
    padded = rows * row_size
    if fmt == "fp8":
        return padded + 4 * rows
    return -(-padded // 2) + 4 * rows


def _row_view(values: torch.Tensor, row_size: int) -> torch.Tensor:
    rows = _rows(values.numel(), row_size)
    padding = values.new_zeros(rows * row_size - values.numel(), dtype=torch.float32)
    return torch.cat([values.float(), padding]).view(rows, row_size)


def encode(values: torch.Tensor, fmt: QuantizationFormat, row_size: int = 256) -> torch.Tensor:
    """Quantize a 1-D tensor into its ``uint8`` wire payload."""
    _check(fmt, row_size)
    flat = values.detach().reshape(-1).float()
    if fmt == "none":
        return flat.clone().view(torch.uint8)
    if fmt == "bf16":
        return flat.to(torch.bfloat16).view(torch.uint8)
    rows = _row_view(flat, row_size)
    absmax = rows.abs().amax(dim=1)
    limit = _FP8_MAX if fmt == "fp8" else float(_INT4_MAX)
    # An all-zero row keeps scale 1 so that decoding never divides by zero.
    scales = torch.where(absmax > 0, absmax / limit, torch.ones_like(absmax))
    scaled = rows / scales[:, None]
    if fmt == "fp8":
        codes = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        code_bytes = codes.reshape(-1)
    else:
        levels = scaled.round().clamp(-_INT4_MAX, _INT4_MAX).to(torch.int16) + 8  # in [1, 15]
        levels = levels.reshape(-1)
        if levels.numel() % 2:
            levels = torch.cat(
                [levels, torch.full((1,), 8, dtype=torch.int16, device=levels.device)]
            )
        pairs = levels.view(-1, 2)
        code_bytes = (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)
    return torch.cat([code_bytes, scales.float().contiguous().view(torch.uint8)])


def decode(
    payload: torch.Tensor, numel: int, fmt: QuantizationFormat, row_size: int = 256
) -> torch.Tensor:
    """Dequantize a payload made by :func:`encode` back to ``numel`` float32 values."""
    _check(fmt, row_size)
    expected = encoded_bytes(numel, fmt, row_size)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(
            f"quantization {fmt}: payload of {payload.numel()} {payload.dtype} elements, "
            f"expected {expected} uint8 for {numel} values"
        )
    payload = payload.contiguous()
    if fmt == "none":
        return payload.view(torch.float32).clone()
    if fmt == "bf16":
        return payload.view(torch.bfloat16).float()
    rows = _rows(numel, row_size)
    scales = payload[expected - 4 * rows :].clone().view(torch.float32)
    codes = payload[: expected - 4 * rows]
    if fmt == "fp8":
        scaled = codes.view(torch.float8_e4m3fn).float().view(rows, row_size)
    else:
        low = (codes & 0x0F).to(torch.int16)
        high = (codes >> 4).to(torch.int16)
        levels = torch.stack([low, high], dim=1).reshape(-1)[: rows * row_size]
        scaled = (levels - 8).float().view(rows, row_size)
    return (scaled * scales[:, None]).reshape(-1)[:numel].clone()


def error_bound(values: torch.Tensor, fmt: QuantizationFormat, row_size: int = 256) -> torch.Tensor:
    """The per-element bound on ``|decode(encode(x)) - x|`` stated in the module docstring."""
    _check(fmt, row_size)
    flat = values.detach().reshape(-1).float()
    if fmt == "none":
        return torch.zeros_like(flat)
    if fmt == "bf16":
        return flat.abs() * 2.0**-8
    rows = _row_view(flat, row_size)
    absmax = rows.abs().amax(dim=1, keepdim=True)
    if fmt == "fp8":
        scale = absmax / _FP8_MAX
        bound = rows.abs() * 2.0**-4 + scale * 2.0**-10
    else:
        bound = (absmax / _INT4_MAX / 2).expand_as(rows)
    return bound.reshape(-1)[: flat.numel()]
