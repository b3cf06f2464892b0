"""Optimizers owned by strategies: flat (sharded) AdamW and learning-rate schedules."""

from __future__ import annotations

from lowcomm.optim.adamw import AdamWConfig, FlatAdamW
from lowcomm.optim.schedule import ScheduleConfig, learning_rate

__all__ = ["AdamWConfig", "FlatAdamW", "ScheduleConfig", "learning_rate"]
