"""A communication thread, for methods whose communication chain includes compute.

ACCO, DPU and weight prediction (docs/ALGORITHMS.md §2) run reduce-scatter -> sharded optimizer
step -> all-gather *beside* the gradient computation. The chain has a data dependency in the
middle (the optimizer step needs the reduced gradient), so it cannot be expressed as a few
async collectives launched up front: it runs as a Python function on a :class:`CommThread`
while the main thread keeps calling the closure.

Rules that keep this safe (the hazards of docs/ARCHITECTURE.md):

* **One thread issues collectives.** While a chain is in flight, every collective of the
  strategy is issued by the communication thread, and none by the main thread, so the order
  on the process group is the same on every rank. Callers wait for the chain before issuing
  anything else on the group.
* **The clock stays on the main thread.** The thread never touches the :class:`Clock`. Under
  emulation, the main thread accounts for the chain's collectives with
  :meth:`NetworkComm.record` (bytes, modeled cost, completion time) and decides "done" by its
  own clock; the thread only performs the real transfers on the *inner* communicator. The
  chain's compute (averaging, the optimizer step) is measured on the thread by a
  :class:`HelperMeter` the main thread hands it, and folded into the clock by the main thread
  once the chain is joined.
* **The virtual start is agreed on the thread.** A :class:`LaunchAgreement` carries this
  worker's launch time; the thread all-reduces (max) it as the chain's first collective, so
  every rank computes the same modeled start without the main thread issuing anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, TypeVar

import torch

from lowcomm.comm.base import Comm, Role, Settled

T = TypeVar("T")


class FutureHandle(Generic[T]):
    """A :class:`~lowcomm.comm.base.Handle` over work running on a :class:`CommThread`.

    ``wait()`` blocks until the work returned and re-raises its exception, if any;
    ``done()`` never blocks.
    """

    def __init__(self, future: Future[T]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def done(self) -> bool:
        return self._future.done()

    def settle(self) -> Settled:
        self.wait()
        return Settled()

    def result(self) -> T:
        """Wait, then return what the work returned."""
        return self._future.result()


class HelperMeter:
    """Compute a helper thread does for a worker, measured on that thread (:meth:`measuring`,
    any number of times) and read by the clock's thread once the helper is done
    (:meth:`seconds`, before the speed factor). This base measures nothing: the real clock
    pays the helper's work in wall time, and a declared cost charges micro-batches only."""

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """The helper's work runs in this (on the helper thread)."""
        yield

    def seconds(self) -> float:
        """The compute measured so far."""
        return 0.0


class CommThread:
    """One long-lived worker thread that runs communication chains one at a time.

    Args:
        name: thread name (shows up in stack dumps of a hung run).
        device: the device the chains compute on. On a GPU it is made the thread's current
            device when the thread starts (the current device is per thread: a new thread
            starts on ``cuda:0``, where its kernels, streams and NCCL calls would go).
    """

    def __init__(self, name: str = "lowcomm-comm", *, device: torch.device | None = None) -> None:
        self.device = device
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=self._bind_device
        )
        self._in_flight: FutureHandle[object] | None = None

    def _bind_device(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def submit(self, work: Callable[[], T]) -> FutureHandle[T]:
        """Start ``work`` on the thread.

        Raises:
            RuntimeError: if a previous chain has not been waited for (two chains in flight
                could issue collectives in an order that differs between ranks), or after
                :meth:`close`.
        """
        if self._executor is None:
            raise RuntimeError("CommThread.submit after close(); build a new CommThread")
        if self._in_flight is not None and not self._in_flight.done():
            raise RuntimeError(
                "CommThread.submit while the previous chain is still running; wait() for it "
                "first so that every rank issues its collectives in the same order"
            )

        def run() -> T:
            # Gradients are never needed on the communication thread (grad mode is
            # per-thread, so this does not affect the main thread's backward).
            with torch.no_grad():
                return work()

        handle: FutureHandle[T] = FutureHandle(self._executor.submit(run))
        self._in_flight = handle  # type: ignore[assignment]
        return handle

    @property
    def busy(self) -> bool:
        """Whether a submitted chain is still running."""
        return self._in_flight is not None and not self._in_flight.done()

    def close(self) -> None:
        """Wait for the running chain (if any) and stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class LaunchAgreement:
    """The modeled launch of a group of collectives that another thread will issue.

    Built on the main thread by :meth:`lowcomm.comm.emulated.NetworkComm.offload` with this
    worker's launch time; the communication thread calls :meth:`run` first, before any
    collective of the chain, which (on the virtual clock with several workers) all-reduces
    the launch times with ``max`` so every rank agrees on the start. It is also the
    :class:`~lowcomm.comm.base.Handle` the emulation waits on to read the agreed start.

    Args:
        launch_time: this worker's clock reading when it launched the chain.
        exchange: whether the launch times must be exchanged (virtual clock, group > 1).
        device: where the exchanged tensor lives (the group's device; NCCL needs cuda).
    """

    def __init__(self, launch_time: float, *, exchange: bool, device: torch.device) -> None:
        self.launch_time = launch_time
        self.exchange = exchange
        # A fill kernel, not a blocking host-to-device copy of a list (see NetworkComm).
        self.times = torch.full((1,), launch_time, dtype=torch.float64, device=device)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def run(self, inner: Comm) -> None:
        """On the communication thread: agree on the start (uncharged, like NetworkComm's own
        launch-time exchange)."""
        try:
            if self.exchange:
                inner.all_reduce(self.times, op="max", role=Role.OTHER).wait()
        except BaseException as error:
            self.abort(error)
            raise
        self._ready.set()

    def abort(self, error: BaseException) -> None:
        """Release a main thread waiting on the start: the chain failed before agreeing."""
        self._error = error
        self._ready.set()

    def wait(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(
                "the communication thread failed before agreeing on a launch time"
            ) from self._error

    def done(self) -> bool:
        return self._ready.is_set()

    def settle(self) -> Settled:
        self.wait()
        return Settled()
