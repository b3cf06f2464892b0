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
class LinkNames:
    """How a link's settings are named in error messages: the flags of ``lowcomm train`` and
    ``lowcomm plan`` for the outer and the inner link, or the arguments of an API."""

    preset: str
    bandwidth: str
    latency: str
    speed_factors: str = "--speed-factors"


#: The link between workers (``--network``).
OUTER_LINK = LinkNames("--network", "--bandwidth-gbps", "--latency-ms")
#: The link between the ranks of one worker (``--inner-network``).
INNER_LINK = LinkNames("--inner-network", "--inner-bandwidth-gbps", "--inner-latency-ms")
#: A :class:`NetworkProfile` built directly, named by its fields.
PROFILE_FIELDS = LinkNames(
    "NetworkProfile.name",
    "NetworkProfile.bandwidth_gbps",
    "NetworkProfile.latency_ms",
    "NetworkProfile.speed_factors",
)


def check_link(
    preset: str | None,
    bandwidth_gbps: float | None,
    latency_ms: float | None,
    names: LinkNames = OUTER_LINK,
) -> None:
    """The one validation of a link's settings (either level, the planner's, a profile's).

    Args:
        preset: a name of :data:`PRESETS`, or None when there is none to check.
        bandwidth_gbps: Gbit/s (``inf``: unlimited), or None for the preset's.
        latency_ms: one-hop latency in milliseconds, or None for the preset's.
        names: how each setting is named in the message.

    Raises:
        ValueError: the first bad setting, in one line naming it, its value, the rule and
            the fix.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"{names.preset}: unknown preset {preset!r}; choose one of {PRESET_HELP}")
    if bandwidth_gbps is not None and not bandwidth_gbps > 0:
        raise ValueError(
            f"{names.bandwidth}: {bandwidth_gbps} is not a positive bandwidth; pass Gbit/s "
            f"such as 10 (inf: unlimited)"
        )
    if latency_ms is not None and not (latency_ms >= 0 and math.isfinite(latency_ms)):
        raise ValueError(
            f"{names.latency}: {latency_ms} is not a finite non-negative latency; pass "
            f"milliseconds such as 0.05"
        )


def check_speed_factors(
    speed_factors: tuple[float, ...], workers: int | None = None, name: str = "--speed-factors"
) -> None:
    """Per-worker compute-time multipliers: finite and positive, one per worker when
    ``workers`` is given (none at all: every worker runs at 1).

    Raises:
        ValueError: in one line naming ``name``, the value and the fix.
    """
    if speed_factors and workers is not None and len(speed_factors) != workers:
        raise ValueError(
            f"{name}: {len(speed_factors)} values for {workers} workers; give exactly one "
            f"compute-time multiplier per worker, e.g. 1 1 1 2"
        )
    for index, factor in enumerate(speed_factors):
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(
                f"{name}: {factor} (worker {index}) is not a finite positive compute-time "
                f"multiplier; pass e.g. 1 1 1 2"
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
        check_link(None, self.bandwidth_gbps, self.latency_ms, PROFILE_FIELDS)
        check_speed_factors(self.speed_factors, name=PROFILE_FIELDS.speed_factors)

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        bandwidth_gbps: float | None = None,
        latency_ms: float | None = None,
        speed_factors: tuple[float, ...] = (),
        names: LinkNames = OUTER_LINK,
    ) -> NetworkProfile:
        """Build a profile from a named preset, with explicit overrides.

        Args:
            names: how the settings are named if one is refused (:func:`check_link`).

        Raises:
            ValueError: for an unknown preset name or an invalid override.
        """
        check_link(name, bandwidth_gbps, latency_ms, names)
        check_speed_factors(tuple(speed_factors), name=names.speed_factors)
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
                f"{PROFILE_FIELDS.speed_factors}: {len(self.speed_factors)} factors given but rank "
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
