"""The calibrated compute model of the virtual clock: compute costs that do not move with
the machine's load.

Before training, every worker times a forward-backward pass of its own model on its own
micro-batch shape, and an AdamW update over a flat tensor of its parameter count. The workers
take turns (barriers on the bookkeeping group), so the processes of one run never compete for
cores while they are timed, and a worker's turn keeps its thread on one CPU (a loaded
machine's scheduler would otherwise move it between cores, each move refilling its caches);
all the timings of all the workers are then gathered and every worker takes the same
statistic of them, so they agree on one number without a further exchange. Timings are the
calling thread's CPU time (workers run one intra-op thread), and the statistic is the
**minimum**: interference (another process, a cache flush, a page fault) only ever adds time,
so the least-interfered timing is the most repeatable estimate of the work's own cost. Many
timed passes (TIMED_REPEATS in all, more when a pass is cheap) give the minimum many chances
to catch an undisturbed one, and where the process may raise its priority a worker's turn
runs at a higher one (TURN_NICENESS), so a competing process on its CPU seldom preempts it.

Two figures come out:

* ``seconds_per_microbatch``: the cost charged for every micro-batch (times the worker's
  straggler speed factor), whatever the machine is doing while the run trains.
* ``seconds_per_element``: the cost of touching one tensor element, charged for all the
  compute outside micro-batches (inner and outer optimizer steps, delay compensation,
  quantization, averaging arithmetic): an :class:`ElementCounter` sees every ATen operation
  the worker's thread runs there and counts the elements it writes (views are free); a
  helper thread's work for the worker (ACCO's chain: averaging, the sharded optimizer step)
  is counted on that thread by an :class:`ElementMeter` and folded in when it is joined. The
  same counter counts the calibration's AdamW update, so the per-element cost is the one of
  the update arithmetic every method runs. Python overhead and communication calls are not
  charged (the clock charges communication from the network model).

A :class:`Calibration` is saved to and loaded from a JSON file (``--calibration FILE``) and
travels in the clock's checkpoint state, so a resumed run charges exactly what it charged
before.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lowcomm.atomic import atomic_write_text
from lowcomm.comm.base import Comm, Role
from lowcomm.comm.clock import VirtualClock
from lowcomm.comm.overlap import HelperMeter
from lowcomm.dispatch import PlainDispatchMode

#: Timed repeats in all (split over the workers, at least one each) after the warm-up. Spread
#: over several seconds, so that a transient slowdown of the host (seen on a shared VM: every
#: one of 4 timings 20% slow) does not set the minimum.
TIMED_REPEATS = 24
#: Warm-up passes per worker (all workers at once; the last one's timing sizes the turns).
#: Every turn also starts with one untimed pass.
WARMUP = 1
#: A worker's turn lasts about this long when its passes are cheap (up to MAX_REPEATS each).
TURN_S = 0.4
MAX_REPEATS = 80
#: Niceness of a worker's thread during its turn, where the process may raise its priority
#: (root or CAP_SYS_NICE; elsewhere the turn keeps its priority): a competing process on
#: the same CPU then preempts a timed pass far less often, and each preemption refills the
#: pass's caches.
TURN_NICENESS = -10


def robust_cost(samples: Sequence[float]) -> float:
    """The agreed cost of a set of timings: their minimum (interference only adds time).

    Non-finite and non-positive timings are ignored; with none left this raises."""
    valid = [s for s in samples if math.isfinite(s) and s > 0]
    if not valid:
        raise ValueError(f"calibration: no positive finite timing among {list(samples)}")
    return min(valid)


@dataclass(frozen=True)
class Calibration:
    """Calibrated compute costs (see the module docstring)."""

    seconds_per_microbatch: float
    seconds_per_element: float
    micro_batch_size: int
    block_size: int
    num_params: int
    bf16: bool = False
    """Measured under bfloat16 autocast (--precision bf16-mixed)."""
    microbatch_samples: tuple[float, ...] = ()
    element_samples: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"compute_model": "calibrated", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        return cls(
            seconds_per_microbatch=float(data["seconds_per_microbatch"]),
            seconds_per_element=float(data["seconds_per_element"]),
            micro_batch_size=int(data["micro_batch_size"]),
            block_size=int(data["block_size"]),
            num_params=int(data["num_params"]),
            bf16=bool(data.get("bf16", False)),
            microbatch_samples=tuple(float(s) for s in data.get("microbatch_samples", ())),
            element_samples=tuple(float(s) for s in data.get("element_samples", ())),
        )

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        return cls.from_dict(json.loads(path.read_text()))


def check_calibration_file(
    path: Path, *, micro_batch_size: int, block_size: int, bf16: bool = False
) -> str | None:
    """Why the calibration file at ``path`` cannot serve a run of these shapes (None: it can,
    or it does not exist yet and the run will write it)."""
    if not path.exists():
        return None
    try:
        calibration = Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"is not a calibration file ({type(error).__name__}: {error})"
    shapes = (calibration.micro_batch_size, calibration.block_size)
    if shapes != (micro_batch_size, block_size):
        return (
            f"was measured on micro-batches of {shapes[0]} x {shapes[1]} tokens, this run uses "
            f"{micro_batch_size} x {block_size}"
        )
    if calibration.bf16 != bf16:
        measured = "bf16-mixed" if calibration.bf16 else "fp32"
        return f"was measured at --precision {measured}, this run uses the other precision"
    return None


class ElementCounter(PlainDispatchMode):
    """Counts the tensor elements the ATen operations of this thread write while counting.

    Thread-local (a dispatch mode); views and non-ATen operations (communication) count
    nothing; an operation with no tensor result counts its first tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.counting = True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.counting and func.namespace == "aten" and not func.is_view:
            written = _numel(out)
            self.elements += written if written else _numel(args[0] if args else None)
        return out

    @contextmanager
    def paused(self) -> Iterator[None]:
        was = self.counting
        self.counting = False
        try:
            yield
        finally:
            self.counting = was

    @contextmanager
    def off(self) -> Iterator[None]:
        """Count nothing, and when this counter is the innermost dispatch mode, leave the mode
        for the duration: its Python hook on every operation costs a forward-backward pass
        3-4% of its time on a CPU. (Under another mode entered later, it only pauses.)"""
        if _get_current_dispatch_mode() is not self:
            with self.paused():
                yield
            return
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        try:
            yield
        finally:
            self.__enter__()  # type: ignore[no-untyped-call]


def current_counter() -> ElementCounter | None:
    """This thread's element counter (the calibrated clock's), when it is the innermost
    dispatch mode; else None."""
    mode = _get_current_dispatch_mode()
    return mode if isinstance(mode, ElementCounter) else None


@contextmanager
def uncounted() -> Iterator[None]:
    """Work that is no worker's step though a step may run it: building a constant that a
    process-wide cache then keeps (a DCT matrix). This thread's element counter, if one is
    counting, counts none of it: in one process of several workers only the first to need the
    constant builds it, and a worker process builds it for itself, so charging it would make
    the two placements' modeled times differ."""
    counter = current_counter()
    with nullcontext() if counter is None else counter.paused():
        yield


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _current_cpu() -> int | None:
    """The CPU this thread runs on (Linux; None where it cannot be read)."""
    try:
        fields = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 of proc(5), "processor"; fields[0] is field 3
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def raised_priority(niceness: int = TURN_NICENESS) -> Iterator[bool]:
    """Run the calling thread at ``niceness`` for the duration where that is permitted
    (yields whether it was); its priority is restored on exit."""
    import threading

    if not hasattr(os, "setpriority"):
        yield False
        return
    thread = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, thread)
        if niceness >= before:
            yield False
            return
        os.setpriority(os.PRIO_PROCESS, thread, niceness)
    except OSError:  # not permitted: time at the thread's own priority
        yield False
        return
    try:
        yield True
    finally:
        os.setpriority(os.PRIO_PROCESS, thread, before)


@contextmanager
def pinned_to_current_cpu() -> Iterator[int | None]:
    """Keep the calling thread on the CPU it is on for the duration (yields it; None and no
    pinning where affinity cannot be set). A busy machine's scheduler otherwise moves a timed
    thread between cores, and every move refills its caches: on 2 cores with 4 spinning
    processes that added 2-5% to a pass's minimum CPU time (see docs/results/clock.md)."""
    cpu = _current_cpu()
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # a restricted cpuset: time unpinned
        yield None
        return
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, allowed)


def _thread_cpu_timing(work: Callable[[], None], device: torch.device | None = None) -> float:
    """Seconds ``work`` takes: this thread's CPU time, or on a GPU the device time between
    two timing events around it (the host's CPU time would see only the launches)."""
    if device is not None and device.type == "cuda":
        return _cuda_event_timing(work, device)
    begin = time.thread_time()
    work()
    return time.thread_time() - begin


def _cuda_event_timing(work: Callable[[], None], device: torch.device, cuda: Any = None) -> float:
    """The device time of the kernels ``work`` queues on the current stream (waits for
    them: calibration runs before training). ``cuda``: ``torch.cuda`` (a stand-in in tests)."""
    cuda = torch.cuda if cuda is None else cuda
    stream = cuda.current_stream(device)
    begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    begin.record(stream)
    work()
    end.record(stream)
    end.synchronize()
    return float(begin.elapsed_time(end)) / 1000.0


def _forward_backward(
    model: torch.nn.Module,
    vocab_size: int,
    micro_batch_size: int,
    block_size: int,
    bf16: bool,
    loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    in_place: bool = False,
) -> Callable[[], None]:
    """One forward-backward pass of a copy of ``model`` (``in_place``: of ``model`` itself)
    on a fixed micro-batch (under bfloat16 autocast with ``bf16``, as the training loop runs
    it): ``loss(copy)``, or without it a language model's loss on random tokens."""
    replica = model if in_place else copy.deepcopy(model)
    if loss is None:
        generator = torch.Generator().manual_seed(0)
        shape = (micro_batch_size, block_size)
        device = next(replica.parameters()).device
        inputs = torch.randint(0, vocab_size, shape, generator=generator).to(device)
        targets = torch.randint(0, vocab_size, shape, generator=generator).to(device)

        def loss(model: torch.nn.Module) -> torch.Tensor:
            return model(inputs, targets)[1]  # type: ignore[no-any-return]

    timed_loss = loss
    device_type = next(replica.parameters()).device.type

    def run() -> None:
        replica.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            value = timed_loss(replica)
        value.backward()  # type: ignore[no-untyped-call]

    return run


def _timed_turns(
    forward_backward: Callable[[], None],
    update: Callable[[], None],
    counter: ElementCounter,
    bookkeeping: Comm,
    device: torch.device | None = None,
) -> tuple[int, torch.Tensor]:
    """Time the passes and updates, one process at a time, the others waiting: (repeats,
    this process's pass seconds then per-element update seconds)."""
    warmup_s = 0.0
    for _ in range(WARMUP):  # all workers at once: only sizes the turns
        warmup_s = _thread_cpu_timing(forward_backward, device)
        update()
    rank, world = bookkeeping.rank, bookkeeping.world_size
    repeats = _repeats(warmup_s, bookkeeping)
    mine = torch.zeros(2 * repeats, dtype=torch.float64)
    for turn in range(world):
        bookkeeping.barrier().wait()
        if turn == rank:
            with pinned_to_current_cpu(), raised_priority():
                # The first pass after the wait finds caches the other workers' turns filled
                # (measured 15-20% slower than the next ones): untimed.
                forward_backward()
                update()
                for index in range(repeats):
                    mine[index] = _thread_cpu_timing(forward_backward, device)
                    counter.elements = 0
                    update_s = _thread_cpu_timing(update, device)
                    mine[repeats + index] = update_s / max(counter.elements, 1)
    return repeats, mine


def _update(
    num_params: int, counter: ElementCounter, device: torch.device | None = None
) -> Callable[[], None]:
    """One AdamW update (the library's own arithmetic) over ``num_params`` elements, on
    ``device`` (the CPU by default)."""
    from lowcomm.optim.adamw import AdamWConfig, _adamw_update

    generator = torch.Generator().manual_seed(0)
    master = torch.randn(num_params, generator=generator).to(device or "cpu")
    grad = torch.randn(num_params, generator=generator).to(device or "cpu")
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    config = AdamWConfig()

    def run() -> None:
        with counter:
            _adamw_update(master, grad, exp_avg, exp_avg_sq, (1, 1), config, 1e-3)

    return run


def _repeats(pass_s: float, bookkeeping: Comm) -> int:
    """Timed repeats per worker, the same on all: enough for TIMED_REPEATS in all, more
    when a pass is cheap (a turn of about TURN_S), at most MAX_REPEATS."""
    slowest = torch.tensor([pass_s], dtype=torch.float64)
    bookkeeping.all_reduce(slowest, op="max", role=Role.OTHER).wait()
    enough = math.ceil(TIMED_REPEATS / bookkeeping.world_size)
    cheap = math.ceil(TURN_S / max(float(slowest), 1e-6))
    return max(1, min(MAX_REPEATS, max(enough, cheap)))


def calibrate(
    model: torch.nn.Module,
    *,
    vocab_size: int,
    micro_batch_size: int,
    block_size: int,
    bookkeeping: Comm,
    bf16: bool = False,
    loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    local_elements: int | None = None,
) -> Calibration:
    """Measure this run's compute costs on every worker in turn and agree on them (every
    process of the run calls this at the same point). Leaves ``model`` and the global random
    state as they were. The timed pass is ``loss(copy of model)``'s forward and backward (the
    run's loss on a fixed micro-batch), or without ``loss`` a language model's on random
    tokens of ``vocab_size``.

    ``local_elements``: ``model`` is sharded and this process holds that many of its
    elements; its own pass is timed (no whole copy is made; the caller makes its collectives
    local, so a process still times alone: :func:`lowcomm.train.sharding.local_collectives`)
    and the AdamW update runs over that many elements."""
    rng = torch.get_rng_state()
    num_params = sum(p.numel() for p in model.parameters())
    in_place = local_elements is not None
    forward_backward = _forward_backward(
        model, vocab_size, micro_batch_size, block_size, bf16, loss, in_place
    )
    counter = ElementCounter()
    device = next(model.parameters()).device  # (on a GPU the passes are timed by events)
    update = _update(num_params if local_elements is None else local_elements, counter, device)
    try:
        repeats, mine = _timed_turns(forward_backward, update, counter, bookkeeping, device)
    finally:
        if in_place:
            model.zero_grad(set_to_none=True)
    world = bookkeeping.world_size
    everyone = torch.zeros(world * 2 * repeats, dtype=torch.float64)
    bookkeeping.all_gather(everyone, mine, role=Role.OTHER).wait()
    rows = everyone.view(world, 2, repeats)
    microbatch = tuple(float(s) for s in rows[:, 0].flatten())
    element = tuple(float(s) for s in rows[:, 1].flatten())
    torch.set_rng_state(rng)
    return Calibration(
        seconds_per_microbatch=robust_cost(microbatch),
        seconds_per_element=robust_cost(element),
        micro_batch_size=micro_batch_size,
        block_size=block_size,
        num_params=num_params,
        bf16=bf16,
        microbatch_samples=microbatch,
        element_samples=element,
    )


class ElementMeter(HelperMeter):
    """The elements a helper thread's ATen operations write, at the calibrated cost per
    element (the calibrated model's charge for a helper's work)."""

    def __init__(self, seconds_per_element: float) -> None:
        self.seconds_per_element = seconds_per_element
        self.counter = ElementCounter()

    @contextmanager
    def measuring(self) -> Iterator[None]:
        with self.counter:
            yield

    def seconds(self) -> float:
        return self.counter.elements * self.seconds_per_element


class CalibratedClock(VirtualClock):
    """The virtual clock on the calibrated compute model: every micro-batch costs
    ``calibration.seconds_per_microbatch`` and every element written outside micro-batches
    ``calibration.seconds_per_element`` (both times the speed factor); CPU time is never read.

    The elements are counted on the thread that enters :meth:`training`; blocked and
    excluded regions count nothing.

    Built with ``measure`` instead of a calibration, the clock is *pending*: a resume's
    :meth:`load_state_dict` gives it the checkpoint's calibration, and otherwise
    :meth:`finish_calibration` (at the latest on entering :meth:`training`; every process of
    the run at the same point) measures one. So a resumed run does not time passes only to
    throw the result away."""

    def __init__(
        self,
        calibration: Calibration | None = None,
        *,
        speed_factor: float = 1.0,
        measure: Callable[[], Calibration] | None = None,
    ) -> None:
        if (calibration is None) == (measure is None):
            raise ValueError("CalibratedClock: pass a calibration or a way to measure one")
        cost = 1.0 if calibration is None else calibration.seconds_per_microbatch
        super().__init__(speed_factor=speed_factor, seconds_per_microbatch=cost)
        self._calibration = calibration
        self._measure = measure
        self.counter = ElementCounter()
        self._charged_elements = 0

    @property
    def pending(self) -> bool:
        """No calibration yet (neither measured nor read from a checkpoint)."""
        return self._calibration is None

    @property
    def calibration(self) -> Calibration:
        if self._calibration is None:
            raise RuntimeError("CalibratedClock: no calibration yet; call finish_calibration()")
        return self._calibration

    @calibration.setter
    def calibration(self, calibration: Calibration) -> None:
        self._calibration = calibration
        self.seconds_per_microbatch = calibration.seconds_per_microbatch

    def finish_calibration(self) -> None:
        """Measure the calibration if neither the constructor nor a checkpoint gave one."""
        if self._calibration is None:
            assert self._measure is not None
            self.calibration = self._measure()

    @property
    def compute_model(self) -> str:
        return "calibrated"

    def describe_compute(self) -> dict[str, object]:
        c = self.calibration
        return {
            "model": "calibrated",
            "seconds_per_microbatch": c.seconds_per_microbatch,
            "seconds_per_element": c.seconds_per_element,
            "statistic": "minimum of the thread CPU time of all workers' timed repeats",
            "microbatch_samples": list(c.microbatch_samples),
            "element_samples": list(c.element_samples),
        }

    def helper_meter(self) -> HelperMeter:
        return ElementMeter(self.calibration.seconds_per_element)

    def mark(self) -> None:
        elements = self.counter.elements
        if elements > self._charged_elements:
            cost = (elements - self._charged_elements) * self.calibration.seconds_per_element
            self._time += cost * self.speed_factor
            self.compute_s += cost * self.speed_factor
        self._charged_elements = elements

    def _restart_at(self, now: float) -> None:
        self._time = now
        self._charged_elements = self.counter.elements

    @contextmanager
    def training(self) -> Iterator[None]:
        self.finish_calibration()
        with self.counter:
            yield

    @contextmanager
    def microbatch(self) -> Iterator[None]:
        self.mark()
        with self.counter.off():  # charged as a whole: no hook on its operations
            yield
        self.microbatch_done()

    @contextmanager
    def blocked(self) -> Iterator[None]:
        self.mark()
        with self.counter.off():  # (counts nothing, and no hook: see ElementCounter.off)
            yield

    @contextmanager
    def excluded(self) -> Iterator[None]:
        # Off, not paused: the hook on each operation cost 256 in-process workers a quarter
        # of their step (every parameter's finiteness check, the metrics) counting nothing.
        self.mark()
        with self.counter.off():
            yield

    def state_dict(self) -> dict[str, float | str]:
        return {**super().state_dict(), "calibration": json.dumps(self.calibration.to_dict())}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        """Continue from saved readings with the saved calibration (a resume charges what the
        first part of the run charged)."""
        super().load_state_dict(state)
        saved = state.get("calibration")
        if isinstance(saved, str):
            self.calibration = Calibration.from_dict(json.loads(saved))
