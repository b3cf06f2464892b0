"""Generated fault traces: the same events for every method, from options and a seed.

Each worker slot k draws its own events from generators seeded by ``(seed, k)`` alone, so
worker k's events do not change when M grows, and every method run with the same options
replays the same trace.

* **Crashes.** Slot k's worker fails after an exponential time with mean
  ``mtbf_s`` (a per-worker failure rate ``1 / mtbf_s``); a replacement joins the slot
  ``replace_after_s`` seconds after the crash, and its own failure clock starts then. Events
  past ``duration_s`` are not written. The crash draws come from ``SeedSequence(seed,
  spawn_key=(k, 0))``.
* **Stragglers.** Slot k is slow with probability ``slow_fraction`` (one draw from
  ``SeedSequence(seed, spawn_key=(k, 1))``, so changing the slowdown options leaves the crashes
  alone). Slowness is *permanent*: a slow slot's compute takes ``slow_factor`` times as long for
  the whole run, whoever fills the slot. Permanent stragglers are the case that separates the
  methods (a synchronous method pays on every step); episodic slowdowns are written by hand
  with ``slow factor=F for=D``.
* **Detection** is not an event: the clock and the planner charge ``detection_s`` after each
  crash before the survivors go on without the dead worker.

All times are modeled seconds on the run's clock; the trace places every event with ``t=``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from lowcomm.faults.trace import Event, FaultTrace

__all__ = ["TORCHFT_HEARTBEAT_TIMEOUT_S", "FaultOptions", "generate_trace"]

#: torchft's lighthouse declares a replica dead after ``heartbeat_timeout_ms`` without a
#: heartbeat; its default is 5000 ms (``LighthouseOpt.heartbeat_timeout_ms``,
#: ``default_value = "5000"``, in torchft's src/lighthouse.rs).
TORCHFT_HEARTBEAT_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class FaultOptions:
    """The options of a generated fault trace.

    Attributes:
        duration_s: the run's length in modeled seconds; no event is generated after it.
        mtbf_s: each worker's mean time between failures in seconds (``math.inf``: no crash).
        replace_after_s: seconds from a crash until a replacement joins the slot
            (``math.inf``: never).
        slow_fraction: the probability that a worker slot is a straggler (0 to 1).
        slow_factor: how many times longer a straggler's compute takes (>= 1).
        detection_s: seconds from a crash until the survivors learn of it; torchft's
            heartbeat timeout by default.
        seed: the seed every draw derives from.
    """

    duration_s: float
    mtbf_s: float = math.inf
    replace_after_s: float = math.inf
    slow_fraction: float = 0.0
    slow_factor: float = 1.0
    detection_s: float = TORCHFT_HEARTBEAT_TIMEOUT_S
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str, fix: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {rule}; {fix}")

        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise bad("duration_s", "a run lasts a finite time > 0", "give its modeled seconds")
        if not self.mtbf_s > 0:
            raise bad("mtbf_s", "a mean time between failures is > 0", "use math.inf for none")
        if not self.replace_after_s >= 0:
            raise bad("replace_after_s", "a replacement cannot join before the crash", "use >= 0")
        if not 0 <= self.slow_fraction <= 1:
            raise bad("slow_fraction", "a fraction of workers is in [0, 1]", "e.g. 0.1")
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1):
            raise bad("slow_factor", "a slowdown is >= 1", "write 3 for three times slower")
        if not (math.isfinite(self.detection_s) and self.detection_s >= 0):
            raise bad("detection_s", "detection takes a finite time >= 0", "e.g. 5")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad("seed", "a seed is a whole number >= 0", "e.g. seed=0")

    @classmethod
    def given(
        cls,
        *,
        duration_s: float,
        detection_s: float,
        mtbf_s: float | None = None,
        replace_after_s: float | None = None,
        slow_fraction: float | None = None,
        slow_factor: float | None = None,
        seed: int | None = None,
    ) -> FaultOptions:
        """The options as the command line's ``--fault-*`` flags give them: one left unset
        (None) means no fault of its kind (no crash, no replacement, no straggler, seed 0)."""
        return cls(
            duration_s=duration_s,
            mtbf_s=math.inf if mtbf_s is None else mtbf_s,
            replace_after_s=math.inf if replace_after_s is None else replace_after_s,
            slow_fraction=0.0 if slow_fraction is None else slow_fraction,
            slow_factor=1.0 if slow_factor is None else slow_factor,
            detection_s=detection_s,
            seed=0 if seed is None else seed,
        )

    @property
    def failure_rate(self) -> float:
        """lambda: each live worker's failures per second."""
        return 0.0 if math.isinf(self.mtbf_s) else 1.0 / self.mtbf_s

    def describe(self) -> str:
        """The options in one line, as a generated trace's source names them."""
        return (
            f"<generated seed={self.seed} duration_s={self.duration_s:g} mtbf_s={self.mtbf_s:g} "
            f"replace_after_s={self.replace_after_s:g} slow_fraction={self.slow_fraction:g} "
            f"slow_factor={self.slow_factor:g}>"
        )


def _worker_events(options: FaultOptions, worker: int) -> list[Event]:
    events: list[Event] = []
    slow_draw = np.random.default_rng(np.random.SeedSequence(options.seed, spawn_key=(worker, 1)))
    if options.slow_factor > 1 and slow_draw.random() < options.slow_fraction:
        events.append(Event(kind="slow", worker=worker, at_time=0.0, factor=options.slow_factor))
    if math.isinf(options.mtbf_s):
        return events
    crash_draw = np.random.default_rng(np.random.SeedSequence(options.seed, spawn_key=(worker, 0)))
    start = 0.0
    while True:
        crash = start + float(crash_draw.exponential(options.mtbf_s))
        if crash >= options.duration_s:
            return events
        events.append(Event(kind="crash", worker=worker, at_time=crash))
        start = crash + options.replace_after_s
        if start >= options.duration_s:
            return events
        events.append(Event(kind="join", worker=worker, at_time=start))


def generate_trace(options: FaultOptions, *, workers: int) -> FaultTrace:
    """The trace these options give a run of ``workers`` workers.

    Args:
        options: what fails, how often and for how long.
        workers: M, the run's number of worker slots.

    Returns:
        A validated trace; :meth:`FaultTrace.to_text` writes it for ``--faults``.

    Raises:
        ValueError: when ``workers`` is not a positive whole number.
        TraceError: when the draws leave no worker alive at some moment (then raise
            ``mtbf_s``, lower ``replace_after_s``, or add workers).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: a run has at least one worker; pass M >= 1")
    events = [event for worker in range(workers) for event in _worker_events(options, worker)]
    # Every event is placed by time, so this is the trace's own (stable) order; numbering the
    # events as the lines of to_text (after its header) lets a message point into that text.
    events.sort(key=lambda event: event.at)
    numbered = tuple(replace(event, line=index) for index, event in enumerate(events, start=2))
    return FaultTrace(workers=workers, events=numbered, source=options.describe())
