"""The network model: what a collective costs on a declared link.

Costs follow the ring model of docs/ALGORITHMS.md §0.4. For a payload of ``S`` bytes (the full,
unsharded tensor), ``M`` workers, bandwidth ``B`` (bytes/s) and per-hop latency ``l``:

* all-reduce: ``2 (M-1)/M * S/B + 2 (M-1) l``; each worker sends ``2 (M-1)/M * S`` bytes;
* reduce-scatter, all-gather: ``(M-1)/M * S/B + (M-1) l``; each worker sends ``(M-1)/M * S``;
* broadcast (pipelined chain from the source): ``S/B + (M-1) l``; every worker but the last in
  the chain forwards ``S`` bytes;
* barrier: an all-reduce of nothing, ``2 (M-1) l``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lowcomm.comm.base import CollectiveKind

#: Named links: (bandwidth in Gbit/s, one-hop latency in milliseconds).
PRESETS: dict[str, tuple[float, float]] = {
    "none": (math.inf, 0.0),
    "datacenter": (100.0, 0.005),
    "ethernet": (10.0, 0.05),
    "wan": (1.0, 10.0),
    "slow-wan": (0.1, 50.0),
}

PRESET_HELP = (
    "none (no emulation), datacenter (100 Gbit/s, 5 us), ethernet (10 Gbit/s, 50 us), "
    "wan (1 Gbit/s, 10 ms), slow-wan (100 Mbit/s, 50 ms)"
)


@dataclass(frozen=True)
class NetworkProfile:
    """A declared link between workers and the compute speed of each worker.

    Args:
        name: preset name, or ``custom`` when bandwidth and latency were given explicitly.
        bandwidth_gbps: link bandwidth in Gbit/s (``inf`` for an unlimited link).
        latency_ms: one-hop latency in milliseconds.
        speed_factors: per-worker multipliers of compute time (2.0 = a worker twice as slow);
            empty means every worker runs at 1.0.
    """

    name: str = "none"
    bandwidth_gbps: float = math.inf
    latency_ms: float = 0.0
    speed_factors: tuple[float, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(
                f"network.bandwidth_gbps: {self.bandwidth_gbps} is not positive; "
                f"pass a bandwidth in Gbit/s such as 10"
            )
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(
                f"network.latency_ms: {self.latency_ms} is not a finite non-negative number; "
                f"pass a latency in milliseconds such as 0.05"
            )
        for index, factor in enumerate(self.speed_factors):
            if not (factor > 0 and math.isfinite(factor)):
                raise ValueError(
                    f"network.speed_factors[{index}]: {factor} is not a positive number; "
                    f"pass compute-time multipliers such as 1,1,1,2"
                )

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        bandwidth_gbps: float | None = None,
        latency_ms: float | None = None,
        speed_factors: tuple[float, ...] = (),
    ) -> NetworkProfile:
        """Build a profile from a named preset, with explicit overrides.

        Raises:
            ValueError: for an unknown preset name or an invalid override.
        """
        if name not in PRESETS:
            raise ValueError(
                f"--network: unknown preset {name!r}; choose one of {', '.join(PRESETS)} "
                f"or give --bandwidth-gbps and --latency-ms"
            )
        bandwidth, latency = PRESETS[name]
        overridden = bandwidth_gbps is not None or latency_ms is not None
        return cls(
            name=f"{name}+custom" if overridden else name,
            bandwidth_gbps=bandwidth if bandwidth_gbps is None else bandwidth_gbps,
            latency_ms=latency if latency_ms is None else latency_ms,
            speed_factors=tuple(speed_factors),
        )

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8.0

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3

    @property
    def is_unlimited(self) -> bool:
        return math.isinf(self.bandwidth_gbps) and self.latency_ms == 0.0

    def speed_factor(self, rank: int) -> float:
        """The compute-time multiplier of worker ``rank`` (1.0 when none was declared)."""
        if not self.speed_factors:
            return 1.0
        if rank >= len(self.speed_factors):
            raise ValueError(
                f"network.speed_factors: {len(self.speed_factors)} factors given but rank "
                f"{rank} exists; give one factor per worker"
            )
        return self.speed_factors[rank]

    def collective_time(self, kind: CollectiveKind, payload_bytes: float, world_size: int) -> float:
        """Modeled seconds for one collective of ``payload_bytes`` (the full tensor)."""
        m = world_size
        if m <= 1:
            return 0.0
        transfer = payload_bytes / self.bytes_per_second
        hops = m - 1
        if kind is CollectiveKind.ALL_REDUCE:
            return 2.0 * hops / m * transfer + 2.0 * hops * self.latency_s
        if kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER):
            return hops / m * transfer + hops * self.latency_s
        if kind is CollectiveKind.BROADCAST:
            return transfer + hops * self.latency_s
        if kind is CollectiveKind.BARRIER:
            return 2.0 * hops * self.latency_s
        raise AssertionError(f"unpriced collective {kind}")


def bytes_sent(
    kind: CollectiveKind, payload_bytes: float, world_size: int, rank: int, src: int = 0
) -> float:
    """Bytes one worker puts on the wire for one collective under the ring model."""
    m = world_size
    if m <= 1:
        return 0.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (m - 1) / m * payload_bytes
    if kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER):
        return (m - 1) / m * payload_bytes
    if kind is CollectiveKind.BROADCAST:
        position = (rank - src) % m  # place in the chain starting at the source
        return payload_bytes if position < m - 1 else 0.0
    return 0.0
