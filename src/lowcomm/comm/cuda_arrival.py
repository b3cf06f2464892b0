"""When an NCCL collective's data arrived, on the host's ``time.perf_counter`` scale.

Gloo's completion future fires on its own thread when the data is in, so its callback's time
is the arrival. NCCL's future fires when the collective is queued on its stream, long before
the data moves, and waiting on the work only makes the *current* stream wait; neither tells
the host when the transfer ended. So at launch a side stream is made to wait for the work
through its completion future (``work.get_future().wait()`` under that stream: NCCL's future
is complete at the launch, so the host does not block, and the future's wait only makes the
side stream wait for the events NCCL recorded at the collective's end; the compute stream is
not touched) and a timing event is recorded on it: the event completes when the collective
does.

Not ``work.wait()``: where PyTorch does not record streams for NCCL's tensors
(``TORCH_NCCL_AVOID_RECORD_STREAMS``, the default in recent releases), ``work.wait()`` also
drops the references the process group keeps to the collective's tensors, and the caching
allocator may then hand their memory to the compute stream while NCCL still reads it. The
work is waited for only by the method, when it asks (``_WorkHandle.wait``), and the handle
keeps the tensors referenced until then.
When the arrival is asked for, the event is waited for, and a second event recorded on an
idle stream completes at once; the host time right after it, less the GPU time between the
two events, is the arrival.

The real clock needs the arrival to time a settled collective (``EmulatedComm``'s settle: a
collective completes when its data arrived, if that is after the modeled completion). Without
it, CoCoDC on an NCCL cluster with ``--network none`` timed its fragment syncs at zero and
synchronised every step.

``cuda`` is ``torch.cuda`` in use; tests pass a stand-in (no GPU here), and
``lowcomm selftest --device cuda`` checks the real one against a late peer.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

#: torch.distributed's switch that makes an NCCL ``work.wait()`` block the host; under it the
#: side stream's wait would stall the launch, so no arrival is taken.
BLOCKING_WAIT_VARIABLES = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def blocking_wait() -> bool:
    """Whether NCCL waits block the host in this process (``TORCH_NCCL_BLOCKING_WAIT=1``)."""
    return any(
        os.environ.get(name, "0").strip().lower() in ("1", "true", "yes")
        for name in BLOCKING_WAIT_VARIABLES
    )


class _Streams:
    """The side and reference streams of each device (one pair per device per process: the
    collectives of one group complete in order, so one side stream keeps each event at its
    own collective's completion)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_device: dict[tuple[Any, int], tuple[Any, Any]] = {}

    def get(self, cuda: Any, device: torch.device) -> tuple[Any, Any]:
        key = (cuda, -1 if device.index is None else device.index)
        with self._lock:
            pair = self._by_device.get(key)
            if pair is None:
                pair = (cuda.Stream(device=device), cuda.Stream(device=device))
                self._by_device[key] = pair
            return pair


_STREAMS = _Streams()


class EventArrival:
    """The arrival of one collective's ``work`` on ``device`` (see the module docstring)."""

    def __init__(self, work: Any, device: torch.device, cuda: Any = None) -> None:
        self._cuda = torch.cuda if cuda is None else cuda
        self._side, self._reference = _STREAMS.get(self._cuda, device)
        self._arrived_at: float | None = None
        with self._cuda.stream(self._side):
            # The side stream waits for the collective; the host goes on (see above: not
            # work.wait(), which would release the collective's tensors to the allocator).
            work.get_future().wait()
            self._event = self._cuda.Event(enable_timing=True)
            self._event.record(self._side)

    def completed_at(self) -> float:
        """When the data arrived (``time.perf_counter``); waits for it if it has not."""
        if self._arrived_at is None:
            self._event.synchronize()
            now = self._cuda.Event(enable_timing=True)
            now.record(self._reference)
            now.synchronize()
            host = time.perf_counter()
            self._arrived_at = host - self._event.elapsed_time(now) / 1000.0
        return self._arrived_at
