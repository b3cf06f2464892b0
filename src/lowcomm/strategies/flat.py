"""Flat parameter and gradient buffers.

Model parameters and their gradients are rebound as views into two flat, padded buffers, so a
strategy can hand one contiguous tensor to a collective or a flat optimizer without copying,
and ``backward()`` accumulates straight into the communication buffer.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

#: Models copied by :func:`laid_out_copy`, with the buffer their parameters are views of.
_LAID_OUT: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def laid_out_copy(model: nn.Module, memo: dict[int, object], *, room: int = 1) -> nn.Module:
    """``copy.deepcopy(model, memo)`` whose trainable parameters are copied once, end to end
    into one new buffer (``model.parameters()`` order, the length rounded up to a multiple of
    ``room``, zeros after them): :class:`FlatBuffers`' layout, so the first flat buffers made
    for the copy adopt that buffer instead of copying every parameter a second time (one
    allocation and one copy of the model less per in-process worker). Parameters of several
    dtypes or devices are deep-copied as usual."""
    params = _unique_parameters(model)
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return copy.deepcopy(model, memo)
    numel = sum(p.numel() for p in params)
    buffer = torch.empty(-(-numel // room) * room, dtype=params[0].dtype, device=params[0].device)
    buffer[numel:].zero_()
    offset = 0
    with torch.no_grad():
        for p in params:
            view = buffer[offset : offset + p.numel()].view_as(p)
            view.copy_(p)
            memo[id(p)] = nn.Parameter(view, requires_grad=True)
            offset += p.numel()
    copied = copy.deepcopy(model, memo)
    _LAID_OUT[copied] = buffer
    return copied


def _adopted(params: list[nn.Parameter], buffer: torch.Tensor | None, padded: int) -> bool:
    """Whether ``params`` are still :func:`laid_out_copy`'s views of ``buffer``, in order,
    with room for ``padded`` elements."""
    if buffer is None or buffer.numel() < padded:
        return False
    position = 0
    for p in params:
        start = buffer.data_ptr() + position * buffer.element_size()
        if p.dtype != buffer.dtype or not p.is_contiguous() or p.data_ptr() != start:
            return False
        position += p.numel()
    return True


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
        laid_out = _LAID_OUT.pop(model, None)  # (the first flat buffers only)
        adopt = _adopted(params, laid_out, self.padded_numel)
        self.params = (
            laid_out[: self.padded_numel]
            if adopt and laid_out is not None
            else torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        )
        self.grads = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self._offsets: list[int] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                if not adopt:
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
