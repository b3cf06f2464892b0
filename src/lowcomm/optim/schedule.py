"""Learning-rate schedules, indexed by a step counter the strategy chooses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule.

    Attributes:
        kind: "constant" or "cosine" (linear warm-up, then cosine decay to min_lr_ratio x lr).
        warmup_steps: steps of linear warm-up from 0 to the peak learning rate.
        min_lr_ratio: floor of the cosine decay as a fraction of the peak learning rate.
    """

    kind: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine"):
            raise ValueError(f"--schedule.kind: unknown {self.kind!r}; choose constant or cosine")
        if self.warmup_steps < 0:
            raise ValueError(f"--schedule.warmup-steps: {self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--schedule.min-lr-ratio: {self.min_lr_ratio} must lie in [0, 1]")


def learning_rate(config: ScheduleConfig, peak_lr: float, step: int, total_steps: int) -> float:
    """Learning rate for 0-based ``step`` out of ``total_steps``."""
    if config.warmup_steps > 0 and step < config.warmup_steps:
        return peak_lr * (step + 1) / config.warmup_steps
    if config.kind == "constant":
        return peak_lr
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, max(0.0, (step - config.warmup_steps) / decay_steps))
    floor = config.min_lr_ratio * peak_lr
    return floor + 0.5 * (peak_lr - floor) * (1.0 + math.cos(math.pi * progress))
