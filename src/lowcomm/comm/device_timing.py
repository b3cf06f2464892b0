"""The real clock's compute and exposed communication on a GPU, timed by CUDA events.

Kernels are queued: the host runs ahead of the device, so the host's clock cannot say which
region a kernel ran in. Reading the time after ``torch.cuda.synchronize`` would, but a
device-wide synchronisation also drains the streams NCCL works on, so a collective launched
to overlap compute finishes before compute resumes (the method's overlap is lost, and the
transfer is booked as compute). Instead, every boundary between the worker's regions
(compute, blocked on communication, excluded) records a timing event on the current stream
(the one the worker's kernels and its waits for collectives are ordered on), and a region's
time is the device time between its two events: a region that waits for a collective on the
device (``work.wait()`` orders the stream after it) shows that wait as exposed time, and a
collective that overlaps compute shows none.

Nothing waits for the events while the worker steps: completed ones are folded in when the
clock is marked (``Event.query`` does not block), and a reading that must be exact (the
step metrics, read every ``--log-every`` steps; a checkpoint; the summary) waits for the
events up to that point, on the compute stream only.

``cuda`` is ``torch.cuda`` in use; tests pass a stand-in.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

#: The regions a boundary ends ("slowdown": a straggler's emulated extra compute).
REGIONS = ("compute", "exposed", "excluded", "slowdown")

#: Cycles of the spin kernel that measures the device's cycles per second, once per run.
PROBE_CYCLES = 10_000_000


class DeviceTimeline:
    """Region boundaries of one worker as timing events on its compute stream (the current
    stream when the timeline is made).

    Args:
        device: the worker's GPU.
        cuda: ``torch.cuda`` (a stand-in in tests).
    """

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self._cuda = torch.cuda if cuda is None else cuda
        self._device = device
        # The compute stream, captured now: a boundary crossed inside another stream's block
        # (FSDP's all-gather and reduce-scatter streams, a side stream of a method) would
        # otherwise record on that stream, and an elapsed time between events on two streams
        # is no region's time (it can even come out negative).
        self._stream = self._cuda.current_stream(device)
        self.totals = dict.fromkeys(REGIONS, 0.0)
        self._pending: deque[tuple[int, Any, str]] = deque()
        self._recorded = 0  # boundaries recorded (the next one's index)
        self._previous = self._record()
        self._wanted: dict[int, dict[str, float] | None] = {}
        self._cycles_per_s: float | None = None
        self._links: dict[int, Any] = {}  # a link's stream, by the link's id

    def _record(self) -> Any:
        event = self._cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def boundary(self, ended: str, keep: bool = False) -> int:
        """Record the end of a region of kind ``ended`` (and the start of the next); return
        the boundary's index. With ``keep``, the totals at this boundary are kept for
        :meth:`totals_at` (asked for before the completed boundaries are folded in: on an idle
        device this one may already be complete). Folds in the completed ones."""
        assert ended in REGIONS, ended
        index = self._recorded
        if keep:
            self._wanted[index] = None
        self._pending.append((index, self._record(), ended))
        self._recorded += 1
        self.resolve(until=None)
        return index

    def resolve(self, until: int | None) -> None:
        """Fold in the completed boundaries; with ``until``, wait for the boundaries up to
        that index first (a wait on the worker's stream, not on the device)."""
        waited = -1  # the boundaries up to this index are known complete
        if until is not None:
            last = [entry for entry in self._pending if entry[0] <= until]
            if last:  # one wait: the stream runs its events in order
                last[-1][1].synchronize()
                waited = last[-1][0]
        while self._pending:
            index, event, ended = self._pending[0]
            if index > waited and not event.query():
                return
            self.totals[ended] += self._previous.elapsed_time(event) / 1000.0
            self._previous = event
            self._pending.popleft()
            if index in self._wanted:
                self._wanted[index] = dict(self.totals)

    def totals_at(self, index: int) -> dict[str, float]:
        """The region totals at boundary ``index`` (from :meth:`boundary` with ``keep``);
        waits for the boundaries up to it."""
        self.resolve(until=index)
        totals = self._wanted.pop(index)
        assert totals is not None, f"boundary {index} not resolved"
        return totals

    def settle(self) -> None:
        """Fold in every recorded boundary (waits for them)."""
        self.resolve(until=self._recorded)

    def delay(self, seconds: float, stream: Any = None) -> None:
        """Queue ``seconds`` of device time on ``stream`` (None: the compute stream) as a
        spin kernel (``torch.cuda._sleep``): a delay that the device serves after the work
        queued before it, where a sleep of the host is absorbed by the work the device still
        has queued. The device's cycles per second are measured the first time (one wait for
        the device, once per run; the probe's time is excluded)."""
        if seconds <= 0:
            return
        cycles = int(seconds * self._cycles_per_second())
        if cycles > 0:
            target = self._stream if stream is None else stream
            with self._cuda.stream(target):
                self._cuda._sleep(cycles)

    def _cycles_per_second(self) -> float:
        if self._cycles_per_s is None:
            self.boundary("compute")  # (the region so far; the probe's is excluded)
            begin = self._cuda.Event(enable_timing=True)
            end = self._cuda.Event(enable_timing=True)
            with self._cuda.stream(self._stream):
                begin.record(self._stream)
                self._cuda._sleep(PROBE_CYCLES)
                end.record(self._stream)
            end.synchronize()
            self._cycles_per_s = PROBE_CYCLES / max(begin.elapsed_time(end) / 1000.0, 1e-9)
            self.boundary("excluded")
        return self._cycles_per_s

    def link_delay(self, link: object, seconds: float) -> Any:
        """Queue a transfer of ``seconds`` on ``link``'s own stream, from this point of the
        compute stream and behind the link's earlier transfers (a link carries one at a
        time); return the event of its end, for :meth:`wait_on`. The transfer then runs on
        the device's timeline, from when the device reached its launch, not the host.
        None for no time (nothing to queue)."""
        if seconds <= 0:
            return None
        launched = self._cuda.Event()
        launched.record(self._stream)
        stream = self._links.get(id(link))
        if stream is None:
            stream = self._links[id(link)] = self._cuda.Stream(device=self._device)
        stream.wait_event(launched)
        self.delay(seconds, stream)
        done = self._cuda.Event()
        done.record(stream)
        return done

    def wait_on(self, event: Any) -> None:
        """Order the compute stream after ``event`` (the host does not wait)."""
        self._stream.wait_event(event)
