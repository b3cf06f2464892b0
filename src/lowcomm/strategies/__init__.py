"""Strategies: one file per paper family. Nothing here imports ``torch.distributed``.

To add a method: write a :class:`Strategy` subclass with a ``name`` in a module of this
package and list it in that module's ``METHODS`` tuple; every module here is scanned, so
``lowcomm train --method NAME`` and ``lowcomm plan --method NAME`` pick it up with no other
change. The class is the method's one declaration (docs/ADDING_A_METHOD.md): its options
(a ``kw_only`` dataclass, the type of the constructor's ``options``, in the group named by
``options_field``: a field of that name is added to :class:`lowcomm.config.TrainConfig` and
:class:`lowcomm.plan.PlanConfig`), its planner ``cost`` model, and its ``hierarchical_refusal``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import typing

from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.strategies.base import (
    Closure,
    MicroBatchResult,
    StepStats,
    Strategy,
    StrategyContext,
)
from lowcomm.strategies.ddp import DDP
from lowcomm.strategies.zero1 import ZeRO1


def _discover() -> dict[str, type[Strategy]]:
    found: dict[str, type[Strategy]] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for cls in getattr(module, "METHODS", ()):
            if cls.name in found and found[cls.name] is not cls:
                raise RuntimeError(f"two strategies are named {cls.name!r}")
            found[cls.name] = cls
    return found


STRATEGIES: dict[str, type[Strategy]] = _discover()


def strategy_class(name: str) -> type[Strategy]:
    """Look up a strategy by its ``--method`` name.

    Raises:
        ValueError: naming the unknown method and the available ones.
    """
    if name not in STRATEGIES:
        close = difflib.get_close_matches(
            name.lower().replace("-", "_"), STRATEGIES, n=1, cutoff=0.6
        )
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(
            f"--method: unknown method {name!r}; {hint}choose one of "
            f"{', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name]


def options_class(cls: type[Strategy]) -> type | None:
    """The options dataclass a strategy's constructor takes (its ``options`` argument), or
    None for a method without options."""
    if cls.options_field is None:
        return None
    hint = typing.get_type_hints(cls.__init__).get("options")
    for candidate in typing.get_args(hint) or (hint,):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    raise TypeError(f"{cls.__name__}.__init__ has no dataclass-typed options argument")


def build_strategy(
    method: str, model: nn.Module, comm: Comm, context: StrategyContext, options_source: object
) -> Strategy:
    """Construct ``method``, handing it its family's options read from ``options_source``
    (a :class:`lowcomm.config.TrainConfig`: the attribute named by ``options_field``)."""
    cls = strategy_class(method)
    if cls.options_field is None:
        return cls(model, comm, context)
    options = getattr(options_source, cls.options_field)
    return cls(model, comm, context, options=options)  # type: ignore[call-arg]


__all__ = [
    "DDP",
    "STRATEGIES",
    "Closure",
    "MicroBatchResult",
    "StepStats",
    "Strategy",
    "StrategyContext",
    "ZeRO1",
    "build_strategy",
    "options_class",
    "strategy_class",
]
