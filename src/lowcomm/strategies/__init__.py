"""Strategies: one file per paper family. Nothing here imports ``torch.distributed``.

To add a method: write a :class:`Strategy` subclass with a ``name`` in its own module and
add it to :data:`STRATEGIES` below; ``lowcomm train --method NAME`` picks it up.
"""

from __future__ import annotations

from lowcomm.strategies.base import (
    Closure,
    MicroBatchResult,
    StepStats,
    Strategy,
    StrategyContext,
)
from lowcomm.strategies.ddp import DDP
from lowcomm.strategies.zero1 import ZeRO1

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, ZeRO1)}


def strategy_class(name: str) -> type[Strategy]:
    """Look up a strategy by its ``--method`` name.

    Raises:
        ValueError: naming the unknown method and the available ones.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"--method: unknown method {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name]


__all__ = [
    "DDP",
    "STRATEGIES",
    "Closure",
    "MicroBatchResult",
    "StepStats",
    "Strategy",
    "StrategyContext",
    "ZeRO1",
    "strategy_class",
]
