"""The network model: ring cost formulas, byte counts, presets and validation."""

from __future__ import annotations

import math
import re

import pytest

from lowcomm.comm import CollectiveKind, NetworkProfile, bytes_sent
from lowcomm.config import PlacementConfig, with_options


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_ring_costs_match_the_formulas(world_size: int) -> None:
    profile = NetworkProfile(name="t", bandwidth_gbps=8.0, latency_ms=2.0)
    size = 10_000_000.0  # bytes
    bandwidth = 8e9 / 8  # bytes per second
    latency = 2e-3
    m = world_size
    assert profile.collective_time(CollectiveKind.ALL_REDUCE, size, m) == pytest.approx(
        2 * (m - 1) / m * size / bandwidth + 2 * (m - 1) * latency
    )
    for kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER):
        assert profile.collective_time(kind, size, m) == pytest.approx(
            (m - 1) / m * size / bandwidth + (m - 1) * latency
        )
    assert profile.collective_time(CollectiveKind.BROADCAST, size, m) == pytest.approx(
        size / bandwidth + (m - 1) * latency
    )
    # All-reduce has the traffic and cost of reduce-scatter followed by all-gather.
    assert profile.collective_time(CollectiveKind.ALL_REDUCE, size, m) == pytest.approx(
        2 * profile.collective_time(CollectiveKind.REDUCE_SCATTER, size, m)
    )


def test_single_worker_costs_nothing() -> None:
    profile = NetworkProfile.from_preset("slow-wan")
    for kind in CollectiveKind:
        assert profile.collective_time(kind, 1e9, 1) == 0.0
        assert bytes_sent(kind, 1e9, 1, 0) == 0.0


def test_bytes_sent_per_worker() -> None:
    assert bytes_sent(CollectiveKind.ALL_REDUCE, 1200, 4, 0) == 2 * 3 / 4 * 1200
    assert bytes_sent(CollectiveKind.REDUCE_SCATTER, 1200, 4, 1) == 3 / 4 * 1200
    assert bytes_sent(CollectiveKind.ALL_GATHER, 1200, 4, 2) == 3 / 4 * 1200
    chain = [bytes_sent(CollectiveKind.BROADCAST, 1200, 4, rank, src=1) for rank in range(4)]
    # Chain 1 -> 2 -> 3 -> 0: rank 0 is last and forwards nothing.
    assert chain == [0.0, 1200, 1200, 1200]


def test_presets_and_overrides() -> None:
    assert NetworkProfile.from_preset("wan").bandwidth_gbps == 1.0
    assert NetworkProfile.from_preset("wan").latency_ms == 10.0
    assert NetworkProfile.from_preset("datacenter").latency_ms == pytest.approx(0.005)
    assert NetworkProfile.from_preset("slow-wan").bandwidth_gbps == 0.1
    assert NetworkProfile.from_preset("ethernet").bandwidth_gbps == 10.0
    custom = NetworkProfile.from_preset("wan", bandwidth_gbps=5.0)
    assert custom.bandwidth_gbps == 5.0 and custom.latency_ms == 10.0
    assert custom.name == "wan+custom"
    assert NetworkProfile.from_preset("none").is_unlimited
    assert (
        NetworkProfile.from_preset("none").collective_time(CollectiveKind.ALL_REDUCE, 1e9, 4) == 0.0
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"bandwidth_gbps": -1.0}, "bandwidth_gbps"),
        ({"bandwidth_gbps": 0.0}, "bandwidth_gbps"),
        ({"latency_ms": -0.1}, "latency_ms"),
        ({"latency_ms": math.nan}, "latency_ms"),
        ({"speed_factors": (1.0, 0.0)}, "speed_factors: 0.0 (worker 1)"),
    ],
)
def test_bad_profiles_name_the_field(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"NetworkProfile.{fragment}")):
        NetworkProfile(**kwargs)  # type: ignore[arg-type]


def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'lan'.*slow-wan"):
        NetworkProfile.from_preset("lan")


def test_speed_factor_lookup() -> None:
    profile = NetworkProfile(speed_factors=(1.0, 2.5))
    assert profile.speed_factor(1) == 2.5
    assert NetworkProfile().speed_factor(7) == 1.0
    with pytest.raises(ValueError, match="one factor per worker"):
        profile.speed_factor(2)


@pytest.mark.parametrize(
    ("setting", "value", "rule"),
    [
        ("bandwidth", -1.0, "is not a positive bandwidth; pass Gbit/s such as 10"),
        ("latency", math.inf, "is not a finite non-negative latency; pass milliseconds"),
        ("preset", "lan", "unknown preset 'lan'; choose one of none (no emulation)"),
    ],
)
def test_one_validation_of_a_link_at_every_place_that_takes_one(
    setting: str, value: object, rule: str
) -> None:
    """The outer and the inner link of train, plan's two links and a profile
    built from a preset are checked by one function: the same rule in the same words, only
    the setting's name differs."""
    from lowcomm.config import ConfigError, TrainConfig
    from lowcomm.plan import PlanConfig

    fields = {"preset": "network", "bandwidth": "bandwidth_gbps", "latency": "latency_ms"}
    outer, inner = fields[setting], f"inner_{fields[setting]}"
    flag = {"preset": "--network", "bandwidth": "--bandwidth-gbps", "latency": "--latency-ms"}
    attempts = [
        (lambda: with_options(TrainConfig(), **{outer: value}).validate(), flag[setting]),
        (
            lambda: with_options(
                TrainConfig(placement=PlacementConfig(ranks_per_worker=2)), **{inner: value}
            ).validate(),
            flag[setting].replace("--", "--inner-"),
        ),
        (lambda: PlanConfig(**{outer: value}), flag[setting]),
        (lambda: PlanConfig(**{inner: value}), flag[setting].replace("--", "--inner-")),
    ]
    if setting == "preset":
        attempts.append((lambda: NetworkProfile.from_preset(str(value)), "--network"))
    else:
        attempts.append(
            (lambda: NetworkProfile.from_preset("wan", **{fields[setting]: value}), flag[setting])
        )
        attempts.append((lambda: NetworkProfile(**{fields[setting]: value}), "NetworkProfile."))
    for attempt, name in attempts:
        with pytest.raises((ValueError, ConfigError)) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith(f"{name}") and rule in message, message
        assert "\n" not in message
