"""lowcomm: data-parallel training across slow links.

Communication-hiding (ACCO, CO2, eager DiLoCo, CoCoDC) and low-communication (DiLoCo,
DES-LOC, Local SGD) methods on ``torch.distributed``, with a network model that says what each
collective would cost on a declared link and a clock that says whether a time is real or
modeled.

Use a strategy in your own loop with :func:`connect` and :func:`make_strategy`; run whole
experiments with the ``lowcomm`` command.
"""

from __future__ import annotations

from lowcomm.api import connect, make_strategy
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.schedule import ScheduleConfig
from lowcomm.strategies import MicroBatchResult, StepStats, Strategy, StrategyContext
from lowcomm.strategies.acco import AccoOptions
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions

__version__ = "0.1.0"

__all__ = [
    "AccoOptions",
    "AdamWConfig",
    "DeslocOptions",
    "DiLoCoOptions",
    "LocalOptions",
    "MicroBatchResult",
    "ScheduleConfig",
    "StepStats",
    "Strategy",
    "StrategyContext",
    "__version__",
    "connect",
    "make_strategy",
]
