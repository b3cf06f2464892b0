"""Turns: how many of a process's worker threads run at once.

K in-process workers are K threads under one interpreter lock. Every torch operation lets go of
that lock and takes it back, so with K runnable threads each operation may wait behind up to K
others, and the operating system switches between hundreds of threads for nothing: at K = 256
on two cores a quarter of the process's CPU time went to the kernel. :class:`Turns` lets only
``slots`` worker threads (one per core) run; the others sleep until one of them blocks in a
collective (:func:`blocking`, called by every wait of the in-process comms) or ends. A worker
waiting for its peers gives its turn away, so the peers it waits for can run; nothing a worker
computes changes, only when.

A wait that is not marked :func:`blocking` while holding a turn could starve the peers it waits
for. No wait of lowcomm's is unmarked; as a guard against one, when no turn changed hands for
:attr:`Turns.STALL_S` while workers are waiting, one more slot opens (:attr:`Turns.opened`
counts them): the process then runs as it would without turns, more threads at once, rather
than hang, and says so once (:class:`TurnStall`).

Only the virtual clock uses turns: it charges compute by the calibrated cost or a declaration,
not by how long a thread ran. The real clock measures wall time, which waiting for a turn would
add to.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

_current = threading.local()


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not on Linux)
        return max(1, os.cpu_count() or 1)


class TurnStall(RuntimeWarning):
    """No turn changed hands for :attr:`Turns.STALL_S` while workers waited for one."""


class Turns:
    """At most ``slots`` worker threads run at once (see the module's docstring). A freed turn
    goes to the waiting worker of the lowest rank: after a collective releases every worker,
    they run in rank order, rank 0 (which writes the run's records) first."""

    #: Seconds without any turn changing hands, while threads wait for one, after which one
    #: more slot opens (the holders are taken to be blocked where no turn is given back).
    STALL_S = 2.0

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"Turns: slots {slots} must be 1 or more")
        self.slots = slots
        self.opened = 0
        """Slots opened after a stall (0 in a run whose every wait is marked)."""
        self.free = slots
        """Turns nobody holds or waits for (a freed turn goes straight to a waiting worker)."""
        self._waiting: list[tuple[int, int, threading.Lock]] = []  # (rank, arrival, gate)
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self._last_change = time.monotonic()

    def _take(self, rank: int) -> None:
        with self._lock:
            if self.free > 0:
                self.free -= 1
                self._last_change = time.monotonic()
                return
            gate = threading.Lock()
            gate.acquire()  # (released by whoever hands this thread its turn)
            heapq.heappush(self._waiting, (rank, next(self._arrivals), gate))
        while not gate.acquire(timeout=self.STALL_S / 4):
            with self._lock:
                if time.monotonic() - self._last_change < self.STALL_S:
                    continue
                self.opened += 1
                self.slots += 1
                self._hand_on()
                first = self.opened == 1
            if first:
                warnings.warn(
                    f"lowcomm: no worker thread gave its turn away for {self.STALL_S:g} s; "
                    f"running {self.slots} at once from now on (a wait not marked blocking(), "
                    f"or a step computing longer than that)",
                    TurnStall,
                    stacklevel=2,
                )

    def _hand_on(self) -> None:
        """A turn is free: to the waiting worker of the lowest rank, else to :attr:`free`
        (under ``_lock``)."""
        self._last_change = time.monotonic()
        if self._waiting:
            _, _, gate = heapq.heappop(self._waiting)
            gate.release()
        else:
            self.free += 1

    def _give(self) -> None:
        with self._lock:
            self._hand_on()

    @contextmanager
    def worker(self, rank: int = 0) -> Iterator[None]:
        """This thread is worker ``rank`` for the block: it runs only on its turn."""
        self._take(rank)
        _current.turns, _current.rank = self, rank
        try:
            yield
        finally:
            _current.turns = None
            self._give()


@contextmanager
def blocking() -> Iterator[None]:
    """Around a wait for other threads: a worker thread gives its turn away for the wait and
    takes one again after it (other threads: nothing happens)."""
    turns: Turns | None = getattr(_current, "turns", None)
    if turns is None:
        yield
        return
    _current.turns = None  # (a nested wait gives nothing twice)
    turns._give()
    try:
        yield
    finally:
        turns._take(_current.rank)
        _current.turns = turns


def wait_for(event: threading.Event, timeout_s: float | None) -> bool:
    """``event.wait(timeout_s)``, giving the turn away only if the event is not yet set."""
    if event.is_set():
        return True
    with blocking():
        return event.wait(timeout_s)


@contextmanager
def holding(lock: threading.Lock) -> Iterator[None]:
    """``with lock:``, giving the turn away while waiting for another thread to release it."""
    if not lock.acquire(blocking=False):
        with blocking():
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


def settle(future: futures.Future[Any]) -> None:
    """Wait until ``future`` is done (raising nothing), giving the turn away meanwhile."""
    if not future.done():
        with blocking():
            futures.wait([future])
