"""lowcomm: data-parallel training across slow links.

Communication-hiding (ACCO, CO2, eager DiLoCo, CoCoDC) and low-communication (DiLoCo,
DES-LOC, Local SGD) methods on ``torch.distributed``, with a network model that says what each
collective would cost on a declared link and a clock that says whether a time is real or
modeled.

Use a strategy in your own loop with :func:`connect` and :func:`make_strategy`; run whole
experiments with the ``lowcomm`` command, or on your own model, data and loss with
:func:`fit`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public names, imported on first use (PEP 562): `lowcomm --version`, and the start of
# `lowcomm train` (which starts the worker server before it imports torch), do not pay for
# torch.
_PUBLIC = {
    "AccoOptions": "lowcomm.strategies.acco",
    "AdamWConfig": "lowcomm.optim.adamw",
    "DeMoOptions": "lowcomm.strategies.demo",
    "DecoupledOptions": "lowcomm.strategies.decoupled_diloco",
    "DeslocOptions": "lowcomm.strategies.desloc",
    "DiLoCoOptions": "lowcomm.strategies.diloco",
    "FitResult": "lowcomm.fitting",
    "LocalOptions": "lowcomm.strategies.co2",
    "MicroBatchResult": "lowcomm.strategies",
    "ScheduleConfig": "lowcomm.optim.schedule",
    "SparseLoCoOptions": "lowcomm.strategies.sparseloco",
    "SpartaOptions": "lowcomm.strategies.sparta",
    "StepStats": "lowcomm.strategies",
    "Strategy": "lowcomm.strategies",
    "StrategyContext": "lowcomm.strategies",
    "TrainConfig": "lowcomm.config",
    "PlacementConfig": "lowcomm.config",
    "RunConfig": "lowcomm.config",
    "CommConfig": "lowcomm.config",
    "NumericsConfig": "lowcomm.config",
    "FaultConfig": "lowcomm.config",
    "connect": "lowcomm.api",
    "fit": "lowcomm.fitting",
    "load_model": "lowcomm.models.export",
    "make_strategy": "lowcomm.api",
}

if TYPE_CHECKING:
    from lowcomm.api import connect, make_strategy
    from lowcomm.config import (
        CommConfig,
        FaultConfig,
        NumericsConfig,
        PlacementConfig,
        RunConfig,
        TrainConfig,
    )
    from lowcomm.fitting import FitResult, fit
    from lowcomm.models.export import load_model
    from lowcomm.optim.adamw import AdamWConfig
    from lowcomm.optim.schedule import ScheduleConfig
    from lowcomm.strategies import MicroBatchResult, StepStats, Strategy, StrategyContext
    from lowcomm.strategies.acco import AccoOptions
    from lowcomm.strategies.co2 import LocalOptions
    from lowcomm.strategies.decoupled_diloco import DecoupledOptions
    from lowcomm.strategies.demo import DeMoOptions
    from lowcomm.strategies.desloc import DeslocOptions
    from lowcomm.strategies.diloco import DiLoCoOptions
    from lowcomm.strategies.sparseloco import SparseLoCoOptions
    from lowcomm.strategies.sparta import SpartaOptions


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and name in _method_options():
        value = _method_options()[name]  # a method's options class not listed above
    else:
        raise AttributeError(f"module 'lowcomm' has no attribute {name!r}")
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def _method_options() -> dict[str, type]:
    """Every registered method's options class by class name (so a new method's options are
    ``lowcomm.TheirOptions`` with no edit here; tests/test_declaration.py checks that the
    list above names them all, for ``import *`` and type checkers)."""
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import option_groups

    return {kind.__name__: kind for kind in option_groups(STRATEGIES).values()}


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = [
    "AccoOptions",
    "AdamWConfig",
    "CommConfig",
    "DeMoOptions",
    "DecoupledOptions",
    "DeslocOptions",
    "DiLoCoOptions",
    "FaultConfig",
    "FitResult",
    "LocalOptions",
    "MicroBatchResult",
    "NumericsConfig",
    "PlacementConfig",
    "RunConfig",
    "ScheduleConfig",
    "SparseLoCoOptions",
    "SpartaOptions",
    "StepStats",
    "Strategy",
    "StrategyContext",
    "TrainConfig",
    "__version__",
    "connect",
    "fit",
    "load_model",
    "make_strategy",
]
