"""DiLoCo family: DiLoCo, Streaming DiLoCo, delayed and eager outer steps, CoCoDC: not implemented yet (its issue is open).

This module holds the family's option dataclass so that the CLI already has its place.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.strategies.base import Strategy


@dataclass(kw_only=True)
class DiLoCoOptions:
    """Options of the DiLoCo family: DiLoCo, Streaming DiLoCo, delayed and eager outer steps, CoCoDC methods (none yet)."""


METHODS: tuple[type[Strategy], ...] = ()
