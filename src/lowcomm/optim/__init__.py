"""Optimizers owned by strategies: the flat optimizers (AdamW, ADOPT, SGD, one protocol), the
outer Nesterov step and learning-rate schedules."""

from __future__ import annotations

from lowcomm.optim.adamw import AdamWConfig, FlatAdamW
from lowcomm.optim.adopt import AdoptConfig, FlatAdopt
from lowcomm.optim.flat import FlatOptimizer
from lowcomm.optim.schedule import ScheduleConfig, learning_rate
from lowcomm.optim.sgd import FlatSGD

__all__ = [
    "AdamWConfig",
    "AdoptConfig",
    "FlatAdamW",
    "FlatAdopt",
    "FlatOptimizer",
    "FlatSGD",
    "ScheduleConfig",
    "learning_rate",
]
