"""Declared faults: traces of workers that fail, straggle and join, generated traces, and
goodput (docs/ARCHITECTURE.md, "Workers that come and go").

Everything here is pure: a trace is parsed or generated once, then queried by the run's
position (step and/or modeled time); the goodput helpers are closed-form.

The package does not re-export the function ``goodput``: the name stays the module's, so
``lowcomm.faults.goodput`` is the module and ``lowcomm.faults.goodput.goodput`` the function.
"""

from __future__ import annotations

from lowcomm.faults.generate import TORCHFT_HEARTBEAT_TIMEOUT_S, FaultOptions, generate_trace
from lowcomm.faults.goodput import (
    Exposure,
    StepCosts,
    absent_worker_seconds,
    expected_exposure,
    expected_goodput,
    fault_free_tokens,
    worker_seconds_lost,
)
from lowcomm.faults.trace import (
    EVENT_KINDS,
    MEMBERSHIP_KINDS,
    Event,
    EventKind,
    FaultTrace,
    TraceError,
    load_trace,
    parse_trace,
)

__all__ = [
    "EVENT_KINDS",
    "MEMBERSHIP_KINDS",
    "TORCHFT_HEARTBEAT_TIMEOUT_S",
    "Event",
    "EventKind",
    "Exposure",
    "FaultOptions",
    "FaultTrace",
    "StepCosts",
    "TraceError",
    "absent_worker_seconds",
    "expected_exposure",
    "expected_goodput",
    "fault_free_tokens",
    "generate_trace",
    "load_trace",
    "parse_trace",
    "worker_seconds_lost",
]
