"""Clocks: every timing lowcomm reports is on one of these, and says which.

Time is split into *compute* (everything a worker does outside a blocking wait) and *exposed
communication* (time spent blocked in ``Handle.wait()``). Compute is folded in lazily: the
communication layer calls :meth:`Clock.mark` at every collective launch and before every
wait, so strategies never have to bracket their compute by hand.

* :class:`RealClock` measures wall time. A straggler's speed factor is emulated by sleeping
  ``(factor - 1) x`` its measured compute, charged to compute. On a GPU, compute and exposed
  communication are the device times between timing events recorded at the region
  boundaries on the worker's stream (:mod:`lowcomm.comm.device_timing`), never a
  device-wide synchronisation, which would drain NCCL's streams and undo every overlap; its
  readings (``now``, the launch times of the network model) are the host's wall time.
* :class:`VirtualClock` keeps a modeled time per worker (:class:`~lowcomm.comm.calibration.CalibratedClock`,
  the training default, charges calibrated costs instead). Compute advances it by the CPU time
  of the calling thread times the worker's speed factor (so four workers sharing two cores
  do not see their compute inflate), or by a declared number of seconds per micro-batch for a
  target device. Waiting moves it to the modeled completion of the collective.

Compute that a helper thread does for a worker (ACCO's chain runs the sharded optimizer step on
a communication thread) is measured on that thread by a :class:`HelperMeter` from
:meth:`Clock.helper_meter` and folded into the worker's compute by the clock's own thread
(:meth:`Clock.fold`): the helper shares the worker's device, so its work takes the worker's
time (the real clock pays it in wall time already).
"""

from __future__ import annotations

import statistics
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from lowcomm.comm.device_timing import DeviceTimeline
from lowcomm.comm.overlap import HelperMeter

ClockKind = Literal["real", "virtual"]


class CpuTimeMeter(HelperMeter):
    """The helper thread's CPU time (the cpu-time model's charge)."""

    def __init__(self) -> None:
        self._seconds = 0.0

    @contextmanager
    def measuring(self) -> Iterator[None]:
        begin = time.thread_time()
        try:
            yield
        finally:
            self._seconds += time.thread_time() - begin

    def seconds(self) -> float:
        return self._seconds


def _spread(samples: array[float]) -> dict[str, float]:
    """Count, minimum, median and mean of a set of timings."""
    return {
        "count": len(samples),
        "min": min(samples),
        "median": statistics.median(samples),
        "mean": statistics.fmean(samples),
    }


class _OwnerCpu:
    """The CPU time of the thread that built it, readable from any thread (through its
    CPU-time clock; ``time.thread_time`` of the caller where that clock is unavailable)."""

    def __init__(self) -> None:
        self._clock: int | None = None
        if hasattr(time, "pthread_getcpuclockid"):
            self._clock = time.pthread_getcpuclockid(threading.get_ident())

    def read(self) -> float:
        if self._clock is None:
            return time.thread_time()
        return time.clock_gettime(self._clock)


class Clock(ABC):
    """A worker's clock. Not thread-safe: one thread at a time may call it."""

    kind: ClockKind

    def __init__(self, *, speed_factor: float = 1.0) -> None:
        if not speed_factor > 0:
            raise ValueError(f"speed_factor: {speed_factor} must be positive")
        self.speed_factor = speed_factor
        self.compute_s = 0.0
        self.exposed_comm_s = 0.0

    @abstractmethod
    def mark(self) -> None:
        """Fold the compute done since the previous mark into the clock."""

    @abstractmethod
    def now(self) -> float:
        """Seconds since the clock started, on this clock (folds pending compute first)."""

    @abstractmethod
    def wait_until(self, deadline: float) -> None:
        """Block (real) or jump (virtual) until ``deadline``; the time counts as exposed."""

    @abstractmethod
    @contextmanager
    def blocked(self) -> Iterator[None]:
        """A region where the worker is blocked on communication: counted as exposed time
        on the real clock, free on the virtual clock (only ``wait_until`` moves it)."""
        yield

    @abstractmethod
    @contextmanager
    def excluded(self) -> Iterator[None]:
        """A region charged to neither compute nor communication (evaluation, metrics)."""
        yield

    def marker(self) -> object:
        """A point of this clock's compute and exposed totals, read by :meth:`totals_at`
        (later: on a GPU the totals are known once the device has reached the point)."""
        return (self.compute_s, self.exposed_comm_s)

    def totals_at(self, marker: object) -> tuple[float, float]:
        """(compute_s, exposed_comm_s) at ``marker`` (from :meth:`marker`)."""
        assert isinstance(marker, tuple)
        return float(marker[0]), float(marker[1])

    def settle_timing(self) -> None:
        """Make ``compute_s`` and ``exposed_comm_s`` exact now (a GPU clock waits for its
        timing events; others are exact already)."""
        return None

    def microbatch_done(self) -> None:
        """Called after each forward/backward micro-batch; only a declared cost uses it."""
        return None

    @contextmanager
    def microbatch(self) -> Iterator[None]:
        """A forward/backward micro-batch (the training loop's closure runs in it); ends with
        :meth:`microbatch_done`."""
        yield
        self.microbatch_done()

    @contextmanager
    def training(self) -> Iterator[None]:
        """The worker's training, entered on the thread that owns the clock (the calibrated
        model counts the work done in it)."""
        yield

    def helper_meter(self) -> HelperMeter:
        """A meter for compute a helper thread will do for this worker (see the module
        docstring); pass it to :meth:`fold` once the helper is done."""
        return HelperMeter()

    def fold(self, meter: HelperMeter) -> None:
        """Charge the compute ``meter`` measured on a helper thread to this worker (times the
        speed factor), now. Call on the clock's thread, after the helper is done."""
        return None

    @property
    def compute_model(self) -> str:
        """How compute is charged: wall (real clock), cpu-time, declared or calibrated."""
        return "wall"

    def describe_compute(self) -> dict[str, object]:
        """The compute model and its figures (for the run's summary)."""
        return {"model": self.compute_model}

    def state_dict(self) -> dict[str, float | str]:
        """The clock's readings (for a checkpoint)."""
        return {
            "kind": self.kind,
            "compute_model": self.compute_model,
            "now": self.now(),
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
        }

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        """Continue from saved readings: the clock reads ``state["now"]`` from here on."""
        if state["kind"] != self.kind:
            raise ValueError(
                f"--clock: the checkpoint was taken on the {state['kind']} clock, this run uses "
                f"{self.kind}; resume with --clock {state['kind']}"
            )
        saved_model = state.get("compute_model", self.compute_model)
        if saved_model != self.compute_model:
            raise ValueError(
                f"--compute-model: the checkpoint was taken with the {saved_model} compute model, "
                f"this run uses {self.compute_model}; resume with the same compute model"
            )
        self.compute_s = float(state["compute_s"])
        self.exposed_comm_s = float(state["exposed_comm_s"])
        self._restart_at(float(state["now"]))

    @abstractmethod
    def _restart_at(self, now: float) -> None:
        """Make :meth:`now` read ``now`` at this instant, with no pending compute."""

    @property
    def utilization(self) -> float:
        total = self.compute_s + self.exposed_comm_s
        return self.compute_s / total if total > 0 else 1.0


#: Excluded regions a real clock remembers for reading past instants (``RealClock.at``): a
#: collective's arrival is read a few steps after it at most, each step has one or two.
EXCLUSIONS_KEPT = 64


class RealClock(Clock):
    """Wall-clock time, measured with ``time.perf_counter``.

    Args:
        speed_factor: emulated slowdown of this worker's compute.
        device: the worker's device; on a GPU, compute and exposed communication are the
            device times between timing events at the region boundaries
            (:mod:`lowcomm.comm.device_timing`): known once the device has run them (read a
            step's through :meth:`marker`), never by synchronising the device.
        cuda: ``torch.cuda`` (a stand-in in tests).
    """

    kind: ClockKind = "real"

    def __init__(
        self,
        *,
        speed_factor: float = 1.0,
        device: torch.device | None = None,
        cuda: Any = None,
    ) -> None:
        self._timeline: DeviceTimeline | None = None
        self._compute_base = 0.0
        self._exposed_base = 0.0
        super().__init__(speed_factor=speed_factor)
        self._device = device if device is not None and device.type == "cuda" else None
        if self._device is not None:
            self._timeline = DeviceTimeline(self._device, cuda)
        self._start = time.perf_counter()
        self._excluded_s = 0.0
        self._last_mark = self._start
        # On a CPU: the CPU time the worker's thread spent in its compute regions, so the
        # summary can say how much of the measured compute waited for a core.
        self._owner_cpu = _OwnerCpu() if self._device is None else None
        self._last_cpu = self._owner_cpu.read() if self._owner_cpu is not None else 0.0
        self.compute_cpu_s = 0.0
        self.slowdown_s = 0.0  # the straggler's sleeps: compute, but not a wait for a core
        self._slowed_compute_s = 0.0  # the timeline's compute a slowdown was queued for
        self._cpu_known = True
        # On a CPU: every micro-batch's wall and thread CPU seconds in this process, for the
        # summary's statistics of the passes the real clock paid (not checkpointed: after a
        # resume they cover the resumed part, and say so).
        self.pass_wall_s: array[float] = array("d")
        self.pass_cpu_s: array[float] = array("d")
        self._resumed = False
        # The latest excluded regions, (begin, end) perf_counter values, for at().
        self._exclusions: deque[tuple[float, float]] = deque(maxlen=EXCLUSIONS_KEPT)

    # On a GPU, compute and exposed time are the timeline's device times (plus what a
    # checkpoint restored); on a CPU, plain host seconds.
    @property
    def compute_s(self) -> float:
        return self._compute_base + self._device_compute()

    @compute_s.setter
    def compute_s(self, value: float) -> None:
        self._compute_base = value - self._device_compute()

    def _device_compute(self) -> float:
        """The timeline's compute, a straggler's emulated slowdown included (0 on a CPU)."""
        if self._timeline is None:
            return 0.0
        return self._timeline.totals["compute"] + self._timeline.totals["slowdown"]

    @property
    def exposed_comm_s(self) -> float:
        extra = 0.0 if self._timeline is None else self._timeline.totals["exposed"]
        return self._exposed_base + extra

    @exposed_comm_s.setter
    def exposed_comm_s(self, value: float) -> None:
        extra = 0.0 if self._timeline is None else self._timeline.totals["exposed"]
        self._exposed_base = value - extra

    def _boundary(self, ended: str) -> None:
        if self._timeline is not None:
            self._timeline.boundary(ended)

    def marker(self) -> object:
        if self._timeline is None:
            return super().marker()
        self.mark()
        index = self._timeline.boundary("compute", keep=True)
        return ("event", index, self._compute_base, self._exposed_base)

    def totals_at(self, marker: object) -> tuple[float, float]:
        if self._timeline is None or not (isinstance(marker, tuple) and marker[0] == "event"):
            return super().totals_at(marker)
        _, index, compute_base, exposed_base = marker
        totals = self._timeline.totals_at(index)
        compute = totals["compute"] + totals["slowdown"]
        return compute_base + compute, exposed_base + totals["exposed"]

    def settle_timing(self) -> None:
        if self._timeline is not None:
            self._timeline.settle()

    def _time(self) -> float:
        """The host's ``perf_counter`` (on a GPU the device's times come from the timeline)."""
        return time.perf_counter()

    def _wall(self) -> float:
        return time.perf_counter() - self._start - self._excluded_s

    def mark(self) -> None:
        now = self._time()
        elapsed = now - self._last_mark
        if self._timeline is not None:
            # The device time of the region's kernels; a straggler's slowdown is queued on
            # the device, in proportion to the device's compute (the host's time is its
            # launches: a host sleep is absorbed while the device has work queued).
            self._timeline.boundary("compute")
            if self.speed_factor > 1.0:
                self._slow_down_device()
            self._last_mark = now
            return
        if self.speed_factor != 1.0 and elapsed > 0:
            # Emulate a slower device: the extra time sits on compute, never on the wire.
            extra = (self.speed_factor - 1.0) * elapsed
            if extra > 0:
                time.sleep(extra)
                self.slowdown_s += extra
            now = time.perf_counter()  # the sleep queued nothing on the device
            elapsed = now - self._last_mark
        self.compute_s += elapsed
        self._last_mark = now
        if self._owner_cpu is not None:
            cpu = self._owner_cpu.read()
            self.compute_cpu_s += cpu - self._last_cpu
            self._last_cpu = cpu

    def link_delay(self, link: object, seconds: float) -> Any:
        """On a GPU: queue a modeled transfer of ``seconds`` on ``link`` on the device's
        timeline (:meth:`DeviceTimeline.link_delay`) and return the event of its end, for
        :meth:`wait_on_device`; None on a CPU (the host's :meth:`wait_until` serves it)."""
        if self._timeline is None:
            return None
        return self._timeline.link_delay(link, seconds)

    def wait_on_device(self, event: Any) -> None:
        """Order the worker's stream after a transfer of :meth:`link_delay` (no host wait)."""
        assert self._timeline is not None
        self._timeline.wait_on(event)

    def _slow_down_device(self) -> None:
        """Queue (speed_factor - 1) x the device compute finished since the last slowdown as
        a region of its own on the device (compute, but not the worker's kernels)."""
        assert self._timeline is not None
        done = self._timeline.totals["compute"]
        owed = (self.speed_factor - 1.0) * (done - self._slowed_compute_s)
        if owed <= 0:
            return
        self._slowed_compute_s = done
        self._timeline.delay(owed)
        self._timeline.boundary("slowdown")
        self.slowdown_s += owed

    def _skip_cpu(self) -> None:
        """The owner thread's CPU time since the last mark is not compute."""
        if self._owner_cpu is not None:
            self._last_cpu = self._owner_cpu.read()

    def state_dict(self) -> dict[str, float | str]:
        self.settle_timing()  # (a checkpoint, outside the steps: exact totals)
        state = super().state_dict()
        if self._owner_cpu is not None and self._cpu_known:
            state["compute_cpu_s"] = self.compute_cpu_s
            state["slowdown_s"] = self.slowdown_s
        return state

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        super().load_state_dict(state)
        self._resumed = True
        # A checkpoint without it (a GPU run's, an older one's): the share stays unknown.
        self._cpu_known = "compute_cpu_s" in state
        self.compute_cpu_s = float(state.get("compute_cpu_s", 0.0))
        self.slowdown_s = float(state.get("slowdown_s", 0.0))

    @contextmanager
    def microbatch(self) -> Iterator[None]:
        if self._owner_cpu is None:
            yield
            self.microbatch_done()
            return
        wall, cpu = time.perf_counter(), self._owner_cpu.read()
        yield
        self.pass_wall_s.append(time.perf_counter() - wall)
        self.pass_cpu_s.append(self._owner_cpu.read() - cpu)
        self.microbatch_done()

    def describe_compute(self) -> dict[str, object]:
        description: dict[str, object] = {"model": "wall"}
        if self._owner_cpu is None:
            return description
        if self.pass_wall_s:
            description["microbatch_wall_s"] = _spread(self.pass_wall_s)
            description["microbatch_cpu_s"] = _spread(self.pass_cpu_s)
            description["microbatches_since_resume"] = self._resumed
        if self._cpu_known:
            # The straggler's emulated slowdown is compute the thread sleeps through by design.
            measured = self.compute_s - self.slowdown_s
            description.update(
                compute_s=self.compute_s,
                thread_cpu_s=self.compute_cpu_s,
                slowdown_s=self.slowdown_s,
                waiting_s=max(0.0, measured - self.compute_cpu_s),
                on_core=min(1.0, self.compute_cpu_s / measured) if measured > 0 else 1.0,
            )
        return description

    def now(self) -> float:
        self.mark()
        return self._wall()

    def at(self, instant: float) -> float:
        """The reading at ``instant``, a past ``time.perf_counter()`` value, without folding
        compute: only the excluded time before ``instant`` is subtracted (an instant inside an
        excluded region reads as the region's start). Exact for an instant at most
        ``EXCLUSIONS_KEPT`` excluded regions back, early by the older ones' time before that."""
        excluded = self._excluded_s
        for begin, end in reversed(self._exclusions):
            if end <= instant:
                break
            excluded -= end - max(begin, instant)
        return instant - self._start - excluded

    def _restart_at(self, now: float) -> None:
        self._last_mark = self._time()
        self._skip_cpu()
        self._start = self._last_mark - now
        self._excluded_s = 0.0
        self._exclusions.clear()

    def wait_until(self, deadline: float) -> None:
        remaining = deadline - self._wall()
        if remaining > 0:
            time.sleep(remaining)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        self.mark()
        begin = time.perf_counter()
        try:
            yield
        finally:
            # On a GPU the wait may only order streams: the timeline's event after it
            # completes when the transfer does, and the region's device time is the exposure.
            end = self._time()
            if self._timeline is None:
                self.exposed_comm_s += end - begin
            else:
                self._timeline.boundary("exposed")
            self._last_mark = end
            self._skip_cpu()

    @contextmanager
    def excluded(self) -> Iterator[None]:
        self.mark()
        begin = time.perf_counter()
        try:
            yield
        finally:
            end = self._time()
            self._boundary("excluded")  # (on a GPU its kernels' device time stays excluded)
            self._excluded_s += end - begin
            self._exclusions.append((begin, end))
            self._last_mark = end
            self._skip_cpu()


class VirtualClock(Clock):
    """Modeled time: compute from thread CPU time (or a declared cost), waits from the model.

    Args:
        speed_factor: multiplies this worker's compute time.
        seconds_per_microbatch: if given, each micro-batch costs exactly this much compute
            (times the speed factor) and measured CPU time is ignored; use it to model a
            target device.
    """

    kind: ClockKind = "virtual"

    def __init__(
        self, *, speed_factor: float = 1.0, seconds_per_microbatch: float | None = None
    ) -> None:
        super().__init__(speed_factor=speed_factor)
        if seconds_per_microbatch is not None and not seconds_per_microbatch > 0:
            raise ValueError(
                f"seconds_per_microbatch: {seconds_per_microbatch} must be positive or None"
            )
        self.seconds_per_microbatch = seconds_per_microbatch
        self._time = 0.0
        # Compute is the CPU time of the thread that owns the clock (the worker's main
        # thread), read through its CPU-time clock so the reading is right from any thread
        # (a communication thread may mark the clock too).
        self._owner_cpu = _OwnerCpu()
        self._last_cpu = self._cpu()

    def _cpu(self) -> float:
        return self._owner_cpu.read()

    def mark(self) -> None:
        cpu = self._cpu()
        if self.seconds_per_microbatch is None:
            elapsed = (cpu - self._last_cpu) * self.speed_factor
            self._time += elapsed
            self.compute_s += elapsed
        self._last_cpu = cpu

    def helper_meter(self) -> HelperMeter:
        return CpuTimeMeter() if self.seconds_per_microbatch is None else HelperMeter()

    def fold(self, meter: HelperMeter) -> None:
        seconds = meter.seconds() * self.speed_factor
        if seconds > 0:
            self.mark()
            self._time += seconds
            self.compute_s += seconds

    @property
    def compute_model(self) -> str:
        return "cpu-time" if self.seconds_per_microbatch is None else "declared"

    def describe_compute(self) -> dict[str, object]:
        if self.seconds_per_microbatch is None:
            return {"model": "cpu-time"}
        return {"model": "declared", "seconds_per_microbatch": self.seconds_per_microbatch}

    def microbatch_done(self) -> None:
        if self.seconds_per_microbatch is not None:
            cost = self.seconds_per_microbatch * self.speed_factor
            self._time += cost
            self.compute_s += cost

    def now(self) -> float:
        self.mark()
        return self._time

    def _restart_at(self, now: float) -> None:
        self._time = now
        self._last_cpu = self._cpu()

    def wait_until(self, deadline: float) -> None:
        if deadline > self._time:
            self.exposed_comm_s += deadline - self._time
            self._time = deadline

    @contextmanager
    def blocked(self) -> Iterator[None]:
        self.mark()
        try:
            yield
        finally:
            # CPU this thread burned while blocked (e.g. polling) is not compute.
            self._last_cpu = self._cpu()

    @contextmanager
    def excluded(self) -> Iterator[None]:
        self.mark()
        try:
            yield
        finally:
            self._last_cpu = self._cpu()


def make_clock(
    kind: ClockKind,
    *,
    speed_factor: float = 1.0,
    seconds_per_microbatch: float | None = None,
    device: torch.device | None = None,
) -> Clock:
    """Build a clock by name (``device``: the worker's device, which a real clock
    synchronises on a GPU)."""
    if kind == "real":
        if seconds_per_microbatch is not None:
            raise ValueError(
                "--seconds-per-microbatch models a target device and needs --clock virtual"
            )
        return RealClock(speed_factor=speed_factor, device=device)
    if kind == "virtual":
        return VirtualClock(
            speed_factor=speed_factor, seconds_per_microbatch=seconds_per_microbatch
        )
    raise ValueError(f"--clock: unknown clock {kind!r}; choose real or virtual")
