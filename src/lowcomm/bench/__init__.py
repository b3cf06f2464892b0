"""Benchmarks: ratios measured side by side in one run (never thresholds in tests)."""

from __future__ import annotations

from typing import Any

from lowcomm.bench.clock import ClockBench, run_clock
from lowcomm.bench.compare import CompareBench, run_compare
from lowcomm.bench.elastic import ElasticBench, run_elastic
from lowcomm.bench.faults import FaultsBench, run_faults
from lowcomm.bench.fsdp import FsdpBench, run_fsdp
from lowcomm.bench.overhead import OverheadBench, run_overhead
from lowcomm.bench.reallink import RealLinkBench, run_reallink
from lowcomm.bench.scale import ScaleBench, run_scale
from lowcomm.bench.startup import StartupBench, run_startup
from lowcomm.membership.bench import MembershipBench, run_membership_bench

#: ``lowcomm bench NAME``: the benchmark configurations, by name.
BENCHMARKS: dict[str, Any] = {
    "overhead": OverheadBench,
    "compare": CompareBench,
    "reallink": RealLinkBench,
    "startup": StartupBench,
    "clock": ClockBench,
    "elastic": ElasticBench,
    "scale": ScaleBench,
    "fsdp": FsdpBench,
    "faults": FaultsBench,
    "membership": MembershipBench,
}


def run_bench(command: object) -> None:
    """Dispatch a parsed ``lowcomm bench ...`` command."""
    if isinstance(command, OverheadBench):
        run_overhead(command)
        return
    if isinstance(command, CompareBench):
        run_compare(command)
        return
    if isinstance(command, RealLinkBench):
        run_reallink(command)
        return
    if isinstance(command, StartupBench):
        run_startup(command)
        return
    if isinstance(command, ClockBench):
        run_clock(command)
        return
    if isinstance(command, ElasticBench):
        run_elastic(command)
        return
    if isinstance(command, ScaleBench):
        run_scale(command)
        return
    if isinstance(command, FsdpBench):
        run_fsdp(command)
        return
    if isinstance(command, FaultsBench):
        run_faults(command)
        return
    if isinstance(command, MembershipBench):
        run_membership_bench(command)
        return
    raise TypeError(f"unknown bench command {command!r}")


__all__ = [
    "BENCHMARKS",
    "ClockBench",
    "CompareBench",
    "ElasticBench",
    "FaultsBench",
    "FsdpBench",
    "MembershipBench",
    "OverheadBench",
    "RealLinkBench",
    "ScaleBench",
    "StartupBench",
    "run_bench",
]
