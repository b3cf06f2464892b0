"""local-update family: Local SGD/AdamW, Overlap-Local-SGD, SlowMo, CO2: not implemented yet (its issue is open).

This module holds the family's option dataclass so that the CLI already has its place.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.strategies.base import Strategy


@dataclass(kw_only=True)
class LocalOptions:
    """Options of the local-update family: Local SGD/AdamW, Overlap-Local-SGD, SlowMo, CO2 methods (none yet)."""


METHODS: tuple[type[Strategy], ...] = ()
