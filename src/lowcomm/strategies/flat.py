"""Flat parameter and gradient buffers.

Model parameters and their gradients are rebound as views into two flat, padded buffers, so a
strategy can hand one contiguous tensor to a collective or a flat optimizer without copying,
and ``backward()`` accumulates straight into the communication buffer.
"""

from __future__ import annotations

import torch
from torch import nn


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    # model.parameters() already skips tied duplicates (GPT's embedding and head share one).
    return [p for p in model.parameters() if p.requires_grad]


class FlatBuffers:
    """Parameters and gradients of ``model`` as views into flat buffers.

    Args:
        model: the model; its trainable parameters are rebound in place.
        pad_to: the flat length is rounded up to a multiple of this (the world size, for an
            even reduce-scatter).
    """

    def __init__(self, model: nn.Module, *, pad_to: int = 1) -> None:
        params = _unique_parameters(model)
        if not params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device, found {dtypes} "
                f"on {devices}; cast the model with model.to(dtype) first"
            )
        self.parameters = params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.numel = sum(p.numel() for p in params)
        self.padded_numel = -(-self.numel // pad_to) * pad_to
        self.params = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.grads = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self._offsets: list[int] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.params[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self.params[offset : offset + n].view_as(p)
                p.grad = self.grads[offset : offset + n].view_as(p)
                self._offsets.append(offset)
                offset += n

    def zero_grads(self) -> None:
        self.grads.zero_()

    def sync_grads(self) -> None:
        """Make sure every ``p.grad`` lives in the flat buffer.

        User code may have reset gradients to ``None`` (``zero_grad(set_to_none=True)``), in
        which case backward allocated a fresh tensor: copy it in and rebind the view.
        """
        for p, offset in zip(self.parameters, self._offsets, strict=True):
            n = p.numel()
            view = self.grads[offset : offset + n]
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad.reshape(-1))
            else:
                continue
            p.grad = view.view_as(p)

    def check_params(self) -> None:
        """Rebind any parameter that user code replaced (``p.data = ...``)."""
        for p, offset in zip(self.parameters, self._offsets, strict=True):
            n = p.numel()
            view = self.params[offset : offset + n]
            if p.data.data_ptr() != view.data_ptr():
                view.copy_(p.data.reshape(-1))
                p.data = view.view_as(p)

    @property
    def offsets(self) -> list[int]:
        """Where each of :attr:`parameters` starts in the flat buffers."""
        return list(self._offsets)

    @property
    def bytes(self) -> int:
        """Bytes of the flat parameter and gradient buffers."""
        return 2 * self.padded_numel * self.params.element_size()
