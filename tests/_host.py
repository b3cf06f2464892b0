"""A recording device layer for tests: host-to-device copies and host reads of device
values, counted as a function mode, so a test on a machine without a GPU (tensors on
``meta`` standing in for the GPU's) can assert that a step waits on no device."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Reading one of these of a device tensor waits for the device.
_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__"}


def _device_of(value: Any) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (str, torch.device)):
        return torch.device(value)
    return None


def _from_host(target: torch.Tensor, rest: tuple[Any, ...]) -> bool:
    source = rest[0] if rest else None
    return (
        isinstance(source, torch.Tensor)
        and source.device.type == "cpu"
        and target.device.type != "cpu"
    )


class HostTraffic(TorchFunctionMode):
    """Notes every copy of host data onto a device (``copies``: ``torch.tensor(...,
    device=...)``, ``.to(device)``, ``.cuda()``, ``copy_`` from a host tensor) and every read of a
    device tensor's values on the host (``reads``: ``.item()``, ``float(...)``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []
        self.reads: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        first = args[0] if args else None
        if func in (torch.tensor, torch.as_tensor):
            device = _device_of(kwargs.get("device"))
            source = _device_of(first)
            if (
                device is not None
                and device.type != "cpu"
                and source in (None, torch.device("cpu"))
            ):
                self.copies.append(name)
        elif isinstance(first, torch.Tensor):
            if name in _READS and first.device.type != "cpu":
                self.reads.append(name)
            elif name in ("to", "cuda") and first.device.type == "cpu":
                targets = [_device_of(a) for a in (*args[1:], kwargs.get("device"))]
                if name == "cuda" or any(t is not None and t.type != "cpu" for t in targets):
                    self.copies.append(name)
            elif name == "copy_" and _from_host(first, args[1:]):
                self.copies.append(name)
        return func(*args, **kwargs)
