"""DES-LOC family: DES-LOC, Local Adam, FedAvg with kept or reset state: not implemented yet (its issue is open).

This module holds the family's option dataclass so that the CLI already has its place.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.strategies.base import Strategy


@dataclass(kw_only=True)
class DeslocOptions:
    """Options of the DES-LOC family: DES-LOC, Local Adam, FedAvg with kept or reset state methods (none yet)."""


METHODS: tuple[type[Strategy], ...] = ()
