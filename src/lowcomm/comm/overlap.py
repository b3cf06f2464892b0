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

A chain is written once, as a generator (:class:`Chain`): it issues a collective, yields its
handle, and is resumed once that handle is done. Two runners drive it, under the rules above:

* :class:`CommThread`: a thread of the worker's own that runs its chains start to end, waiting
  on each collective (a worker process: the thread blocks in Gloo or NCCL while the main thread
  computes).
* :class:`ChainScheduler`: one thread for every worker of an in-process group (``--workers-per-
  process K``), which advances whichever chains can proceed. The K members' collectives block
  until every member has posted, so one thread running the chains one after another would wait
  on chain 0's reduce-scatter forever; resuming each chain only when its collective is done
  (posting never blocks) lets one thread carry all K, as K threads did. A worker's chain is
  still the only issuer of its collectives while in flight, so each member posts in its own
  program order and every member sees the same collective order; the chain's compute is
  measured per resumption by the worker's own meter, so each worker is charged its own chain.
  :func:`chain_runner` picks the runner from the channel the chain is issued on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from lowcomm.comm.base import Comm, Handle, Role, Settled
from lowcomm.comm.turns import settle, wait_for

T = TypeVar("T")

#: A chain's collectives, as a generator: it issues one, yields its handle and, resumed once the
#: handle is done, calls the handle's ``wait()`` (which returns at once, or raises the
#: collective's error) before going on; it returns the chain's result.
Steps = Generator[Handle, None, T]


class FutureHandle(Generic[T]):
    """A :class:`~lowcomm.comm.base.Handle` over work running on a :class:`CommThread`.

    ``wait()`` blocks until the work returned and re-raises its exception, if any;
    ``done()`` never blocks.
    """

    def __init__(self, future: Future[T]) -> None:
        self._future = future

    def wait(self) -> None:
        settle(self._future)
        self._future.result()

    def done(self) -> bool:
        return self._future.done()

    def settle(self) -> Settled:
        self.wait()
        return Settled()

    def result(self) -> T:
        """Wait, then return what the work returned."""
        self.wait()
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


@dataclass
class Chain(Generic[T]):
    """A communication chain ready to run on a :class:`ChainRunner`.

    Attributes:
        steps: the chain (:data:`Steps`); every resumption runs in ``scope()`` and
            ``meter.measuring()``, and, like the whole chain, under ``torch.no_grad()``.
        meter: measures the chain's compute for the worker's clock.
        prelude: collectives to run first, unmeasured and outside ``scope`` (the launch-time
            agreement, :meth:`LaunchAgreement.agree`).
        scope: entered around every resumption of ``steps`` (a CUDA side stream).
    """

    steps: Steps[T]
    meter: HelperMeter = field(default_factory=HelperMeter)
    prelude: Steps[None] | None = None
    scope: Callable[[], AbstractContextManager[object]] = nullcontext


def run_to_end(chain: Chain[T]) -> T:
    """Run ``chain`` on this thread, blocking in each collective's wait; return its result."""
    with torch.no_grad():
        if chain.prelude is not None:
            for _ in chain.prelude:
                pass  # (the generator waits for each collective when resumed)
        with chain.scope(), chain.meter.measuring():
            while True:
                try:
                    chain.steps.send(None)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]


class ChainRunner(Protocol):
    """Runs a worker's communication chains beside its compute, one at a time
    (:class:`CommThread`, or a :class:`ChainScheduler`'s lane)."""

    def submit_chain(self, chain: Chain[T]) -> FutureHandle[T]:
        """Start ``chain``; the handle completes with its result.

        Raises:
            RuntimeError: the previous chain has not completed (two chains of one worker in
                flight could issue collectives in an order that differs between members).
        """
        ...

    @property
    def busy(self) -> bool:
        """Whether a submitted chain is still running."""
        ...

    def close(self) -> None:
        """Wait for the running chain (if any); submit nothing afterwards."""
        ...


_SUBMIT_WHILE_BUSY = (
    "a chain was submitted while the previous one is still running; wait() for it first so "
    "that every member issues its collectives in the same order"
)


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
            raise RuntimeError(f"CommThread: {_SUBMIT_WHILE_BUSY}")

        def run() -> T:
            # Gradients are never needed on the communication thread (grad mode is
            # per-thread, so this does not affect the main thread's backward).
            with torch.no_grad():
                return work()

        handle: FutureHandle[T] = FutureHandle(self._executor.submit(run))
        self._in_flight = handle  # type: ignore[assignment]
        return handle

    def submit_chain(self, chain: Chain[T]) -> FutureHandle[T]:
        """Run ``chain`` on the thread, start to end (:func:`run_to_end`)."""
        return self.submit(lambda: run_to_end(chain))

    @property
    def busy(self) -> bool:
        """Whether a submitted chain is still running."""
        return self._in_flight is not None and not self._in_flight.done()

    def close(self) -> None:
        """Wait for the running chain (if any) and stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


@runtime_checkable
class Notifying(Protocol):
    """A handle that can say when it is done (an in-process collective's)."""

    def notify_when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on any thread, once) when the handle is done; now if it is."""
        ...


class _Running:
    """One submitted chain inside a :class:`ChainScheduler`: where it stands."""

    def __init__(self, chain: Chain[object], future: Future[object]) -> None:
        self.chain = chain
        self.future = future
        self.handle: Handle | None = None
        self.blocked_since = 0.0
        self.listening = False
        self._prelude = chain.prelude

    def ready(self) -> bool:
        return self.handle is None or self.handle.done()

    def advance(self) -> bool:
        """Resume the chain up to its next collective; False once it ended (its future set)."""
        try:
            with torch.no_grad():
                self.handle = self._resume()
        except StopIteration as stop:
            self.future.set_result(stop.value)
            return False
        except BaseException as error:
            self.fail(error)
            return False
        self.blocked_since = time.monotonic()
        self.listening = False
        return True

    def _resume(self) -> Handle:
        if self._prelude is not None:
            try:
                return self._prelude.send(None)
            except StopIteration:
                self._prelude = None
        with self.chain.scope(), self.chain.meter.measuring():
            return self.chain.steps.send(None)

    def fail(self, error: BaseException) -> None:
        """End the chain with ``error`` (closing its generators: an agreement not reached is
        aborted, so the worker's main thread does not wait for it)."""
        for steps in (self._prelude, self.chain.steps):
            if steps is not None:
                with suppress(Exception):  # (its own clean-up failed: it is over anyway)
                    steps.close()
        if not self.future.done():
            self.future.set_exception(error)


class ChainScheduler:
    """One thread that runs the communication chains of every worker of an in-process group,
    cooperatively (see the module docstring); each worker submits through its own
    :meth:`lane`.

    The thread starts with the first chain and ends after :data:`IDLE_S` without one (a later
    chain starts it again), so a finished or failed run leaves no thread behind.

    Args:
        name: the thread's name.
        timeout_s: a chain whose collective has not completed after this long is resumed
            anyway: its wait then raises the group's timeout error (None: no limit).
    """

    #: Seconds without a chain before the thread ends.
    IDLE_S = 2.0
    #: How often to look at a collective that cannot say when it is done (:class:`Notifying`).
    POLL_S = 0.005

    def __init__(self, name: str = "lowcomm-chains", *, timeout_s: float | None = None) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._changed = threading.Condition()
        self._incoming: list[_Running] = []
        self._kicked = False
        self._thread: threading.Thread | None = None

    def lane(self) -> ChainLane:
        """A worker's runner on this scheduler."""
        return ChainLane(self)

    def submit(self, chain: Chain[T]) -> Future[T]:
        """Queue ``chain``; start the thread if it is not running."""
        future: Future[T] = Future()
        with self._changed:
            self._incoming.append(_Running(chain, future))  # type: ignore[arg-type]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._changed.notify()
        return future

    def _kick(self) -> None:
        with self._changed:
            self._kicked = True
            self._changed.notify()

    def _loop(self) -> None:
        active: list[_Running] = []
        try:
            while self._take(active):
                progressed = False
                for running in list(active):
                    while running.ready():
                        progressed = True
                        if not running.advance():
                            active.remove(running)
                            break
                if not progressed:
                    self._sleep(active)
        except BaseException as error:  # a bug here: no chain may wait forever
            with self._changed:
                stranded, self._incoming = active + self._incoming, []
                self._thread = None  # (the next submit starts a new thread)
            for running in stranded:
                running.fail(error)
            raise

    def _take(self, active: list[_Running]) -> bool:
        """Move new chains in (waiting up to IDLE_S when there is none); False: stop."""
        with self._changed:
            self._kicked = False
            if not active and not self._incoming:
                self._changed.wait(self.IDLE_S)
            active.extend(self._incoming)
            self._incoming.clear()
            if not active:
                self._thread = None  # (the next submit starts a new one)
                return False
            return True

    def _sleep(self, active: list[_Running]) -> None:
        """Every chain waits on a collective: sleep until one completes or a chain arrives
        (a collective that cannot notify is looked at every POLL_S); a chain blocked for
        longer than ``timeout_s`` is resumed, so that its wait raises the timeout."""
        now = time.monotonic()
        timeout: float | None = None
        for running in active:
            notify = getattr(running.handle, "notify_when_done", None)  # (Notifying)
            if notify is not None:
                if not running.listening:
                    running.listening = True
                    notify(self._kick)
            else:
                timeout = self.POLL_S
            if self.timeout_s is not None:
                left = running.blocked_since + self.timeout_s - now
                if left <= 0:
                    running.handle = None  # resumed next round; its wait() raises
                    return
                timeout = left if timeout is None else min(timeout, left)
        with self._changed:
            if not self._kicked and not self._incoming:
                self._changed.wait(timeout)


class ChainLane:
    """One worker's :class:`ChainRunner` on a shared :class:`ChainScheduler`."""

    def __init__(self, scheduler: ChainScheduler) -> None:
        self._scheduler = scheduler
        self._in_flight: Future[object] | None = None
        self._closed = False

    def submit_chain(self, chain: Chain[T]) -> FutureHandle[T]:
        if self._closed:
            raise RuntimeError("ChainLane.submit_chain after close(); build a new lane")
        if self.busy:
            raise RuntimeError(f"ChainLane: {_SUBMIT_WHILE_BUSY}")
        future = self._scheduler.submit(chain)
        self._in_flight = future  # type: ignore[assignment]
        return FutureHandle(future)

    @property
    def busy(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def close(self) -> None:
        if self._in_flight is not None:
            settle(self._in_flight)  # (its error went to whoever waited on it)
        self._closed = True


@runtime_checkable
class SharesChains(Protocol):
    """A communicator whose group runs its members' chains on one shared scheduler."""

    def chain_scheduler(self) -> ChainScheduler: ...


def chain_runner(
    channel: Comm, *, name: str = "lowcomm-comm", device: torch.device | None = None
) -> ChainRunner:
    """The runner for chains a worker issues on ``channel``: the group's shared
    :class:`ChainScheduler` when its members live in this process, else a :class:`CommThread`
    of the worker's own (``name``, ``device``: see :class:`CommThread`)."""
    if isinstance(channel, SharesChains):
        return channel.chain_scheduler().lane()
    return CommThread(name, device=device)


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
        cuda: ``torch.cuda`` (a stand-in in tests); its events order the tensor between the
            two threads' streams when ``device`` is a GPU.
    """

    def __init__(
        self, launch_time: float, *, exchange: bool, device: torch.device, cuda: Any = None
    ) -> None:
        self.launch_time = launch_time
        self.exchange = exchange
        # A fill kernel, not a blocking host-to-device copy of a list (see NetworkComm).
        self.times = torch.full((1,), launch_time, dtype=torch.float64, device=device)
        # The tensor is filled on the main thread's stream, all-reduced on the communication
        # thread's and read on the main thread's: events order each hand-over (the threads'
        # current streams need not be one stream).
        self._cuda: Any = (
            cuda if cuda is not None else (torch.cuda if device.type == "cuda" else None)
        )
        self._filled = self._stream_event()
        self._agreed: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _stream_event(self) -> Any:
        """An event on this thread's current stream of the tensor's device (None off a GPU)."""
        if self._cuda is None:
            return None
        event = self._cuda.Event()
        event.record(self._cuda.current_stream(self.times.device))
        return event

    def _wait_on(self, event: Any) -> None:
        """Order this thread's current stream after ``event`` (no host wait)."""
        if event is not None:
            event.wait(self._cuda.current_stream(self.times.device))

    def run(self, inner: Comm) -> None:
        """On the communication thread: agree on the start (uncharged, like NetworkComm's own
        launch-time exchange)."""
        for _ in self.agree(inner):
            pass  # (the generator waits for the exchange when resumed)

    def agree(self, inner: Comm) -> Steps[None]:
        """:meth:`run` as a chain's steps (a :class:`Chain`'s ``prelude``)."""
        try:
            if self.exchange:
                self._wait_on(self._filled)
                handle = inner.all_reduce(self.times, op="max", role=Role.OTHER)
                yield handle
                handle.wait()
                self._agreed = self._stream_event()
        except BaseException as error:  # (GeneratorExit too: the chain was abandoned)
            self.abort(error)
            raise
        self._ready.set()

    def abort(self, error: BaseException) -> None:
        """Release a main thread waiting on the start: the chain failed before agreeing."""
        self._error = error
        self._ready.set()

    def wait(self) -> None:
        wait_for(self._ready, None)
        if self._error is not None:
            raise RuntimeError(
                "the communication thread failed before agreeing on a launch time"
            ) from self._error
        self._wait_on(self._agreed)

    def done(self) -> bool:
        return self._ready.is_set()

    def settle(self) -> Settled:
        self.wait()
        return Settled()
