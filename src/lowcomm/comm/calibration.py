"""The calibrated compute model of the virtual clock: compute costs that do not move with
the machine's load.

The cost belongs to the model, the micro-batch's shape, the precision and the device, never
to the placement: before training, one standard pass measures it and every worker of every
placement charges it (:func:`calibrate`). Rank 0 of the run's bookkeeping group builds the
whole model (one rank of one worker computes a micro-batch of ``--micro-batch-size`` on all
its layers, sharded or not: FSDP's collectives are charged on the inner link, never here),
and times, on its thread alone while every other worker waits in a collective, a
forward-backward pass of a fixed micro-batch and an AdamW update over a flat tensor of the
model's parameter count, in a fixed heap setting (:func:`standard_heap`: workers that share a
process map their large blocks, and the kernel's work for it would be charged as compute),
pinned to one CPU (a loaded machine's scheduler would otherwise move it between cores, each
move refilling its caches); then it broadcasts the result. Timings are the calling thread's
CPU time (the pass runs one intra-op thread), and the statistic is the **minimum**:
interference (another process, a cache flush, a page fault) only ever adds time, so the
least-interfered timing is the most repeatable estimate of the work's own cost. Many timed
passes (TIMED_REPEATS, more when a pass is cheap) give the minimum many chances to catch an
undisturbed one, and where the process may raise its priority the pass runs at a higher one
(TURN_NICENESS), so a competing process on its CPU seldom preempts it.

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
import ctypes
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

#: Timed repeats of the standard pass after its warm-up (more when a pass is cheap). Spread
#: over several seconds, so that a transient slowdown of the host (seen on a shared VM: every
#: one of 4 timings 20% slow) does not set the minimum.
TIMED_REPEATS = 24
#: Untimed warm-up passes (the last one's timing sizes the repeats).
WARMUP = 1
#: The timed repeats last about this long when a pass is cheap (up to MAX_REPEATS).
TURN_S = 0.4
MAX_REPEATS = 80
#: Niceness of the measuring thread, where the process may raise its priority (root or
#: CAP_SYS_NICE; elsewhere it keeps its priority): a competing process on the same CPU then
#: preempts a timed pass far less often, and each preemption refills the pass's caches.
TURN_NICENESS = -10
#: glibc's mallopt parameters (malloc.h), and the heap setting the standard pass runs in:
#: glibc's ceiling for its dynamic mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX),
#: the trim threshold it then sets (twice that), and its default trim threshold.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STANDARD_MMAP_THRESHOLD = 32 << 20
STANDARD_TRIM_THRESHOLD = 2 * STANDARD_MMAP_THRESHOLD
DEFAULT_TRIM_THRESHOLD = 128 << 10


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
) -> Callable[[], None]:
    """One forward-backward pass of a copy of ``model`` on a fixed micro-batch (under bfloat16 autocast with ``bf16``, as the training loop runs
    it): ``loss(copy)``, or without it a language model's loss on random tokens."""
    replica = copy.deepcopy(model)
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


def standard_repeats(pass_s: float) -> int:
    """Timed repeats of the standard pass, from its warm-up's seconds: TIMED_REPEATS, more
    when a pass is cheap (about TURN_S in all), at most MAX_REPEATS."""
    cheap = math.ceil(TURN_S / max(pass_s, 1e-6))
    return max(TIMED_REPEATS, min(MAX_REPEATS, cheap))


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` (None under another C library: its parameter numbers are glibc's)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def _malloc_trim() -> None:
    """Return the heaps' free memory to the system (glibc's ``malloc_trim(0)``)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)


@contextmanager
def standard_heap(fixed_threshold: int | None = None) -> Iterator[None]:
    """For the duration, glibc serves blocks under STANDARD_MMAP_THRESHOLD from its heaps
    (trimmed past STANDARD_TRIM_THRESHOLD), as it does in a process of one worker once each
    size has been freed: its dynamic threshold rises to the largest freed mapped block, up to
    that same ceiling, and the trim threshold to twice it. A process that fixed a lower
    threshold (``fixed_threshold``: in-process workers and sharded CPU workers map every
    block of a megabyte or more, to give freed activations back) would otherwise charge the
    kernel's mapping of fresh pages for every activation of every timed pass as compute:
    1.6x the per-micro-batch cost of the same model in a process of its own. On exit the
    process's ``fixed_threshold`` is set again and the heaps' free memory is returned (None:
    nothing was fixed, and nothing is set: glibc's dynamic threshold is left as it was)."""
    mallopt = _mallopt() if fixed_threshold is not None else None
    if mallopt is None:
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, STANDARD_MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, STANDARD_TRIM_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        assert fixed_threshold is not None
        mallopt(_M_MMAP_THRESHOLD, fixed_threshold)
        _malloc_trim()  # (the pass's freed blocks, kept by the heaps meanwhile, go back)


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the duration (the timing is the calling
    thread's CPU time, which would miss the work of other threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_standard(
    model: torch.nn.Module,
    *,
    vocab_size: int,
    micro_batch_size: int,
    block_size: int,
    bf16: bool = False,
    loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    fixed_threshold: int | None = None,
) -> Calibration:
    """The standard pass, on this thread alone: a copy of ``model`` (whole, as one rank of
    one worker computes it) timed on one micro-batch, then the AdamW update over its
    parameter count; one warm-up, then :func:`standard_repeats` timed repeats, under
    :func:`standard_heap`, pinned to one CPU at a raised priority where permitted. Its
    inputs are the model, the micro-batch's shape, the precision and the device: nothing of
    the placement, so every placement of a run measures the same work in the same setting.
    Leaves ``model`` and the global random state as they were."""
    rng = torch.get_rng_state()
    num_params = sum(p.numel() for p in model.parameters())
    forward_backward = _forward_backward(
        model, vocab_size, micro_batch_size, block_size, bf16, loss
    )
    counter = ElementCounter()
    device = next(model.parameters()).device  # (on a GPU the passes are timed by events)
    update = _update(num_params, counter, device)
    with (
        one_intra_op_thread(),
        standard_heap(fixed_threshold),
        pinned_to_current_cpu(),
        raised_priority(),
    ):
        warmup_s = 0.0
        for _ in range(WARMUP):
            warmup_s = _thread_cpu_timing(forward_backward, device)
            update()
        repeats = standard_repeats(warmup_s)
        microbatch: list[float] = []
        element: list[float] = []
        for _ in range(repeats):
            microbatch.append(_thread_cpu_timing(forward_backward, device))
            counter.elements = 0
            update_s = _thread_cpu_timing(update, device)
            element.append(update_s / max(counter.elements, 1))
    torch.set_rng_state(rng)
    return Calibration(
        seconds_per_microbatch=robust_cost(microbatch),
        seconds_per_element=robust_cost(element),
        micro_batch_size=micro_batch_size,
        block_size=block_size,
        num_params=num_params,
        bf16=bf16,
        microbatch_samples=tuple(microbatch),
        element_samples=tuple(element),
    )


def calibrate(
    build: Callable[[], torch.nn.Module],
    *,
    vocab_size: int,
    micro_batch_size: int,
    block_size: int,
    bookkeeping: Comm,
    bf16: bool = False,
    loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    fixed_threshold: int | None = None,
) -> Calibration:
    """One calibration for every worker of the run (every process and worker thread of the
    run calls this at the same point): rank 0 of ``bookkeeping`` builds the model
    (``build()``, the whole model) and measures :func:`measure_standard` while every other
    rank waits in a collective, then broadcasts it. So the workers neither compete for the
    cores nor run beside the timed pass, in any placement, and they agree bit for bit. The
    global random state is left as it was."""
    buffer = torch.zeros(4 + 2 * MAX_REPEATS, dtype=torch.float64)
    bookkeeping.barrier().wait()  # (every worker has finished its set-up: none runs beside it)
    if bookkeeping.rank == 0:
        with torch.random.fork_rng(devices=[]):  # (building the model draws from it)
            model = build()
        measured = measure_standard(
            model, vocab_size=vocab_size, micro_batch_size=micro_batch_size,
            block_size=block_size, bf16=bf16, loss=loss, fixed_threshold=fixed_threshold,
        )  # fmt: skip
        count = len(measured.microbatch_samples)
        buffer[:4] = torch.tensor(
            [measured.seconds_per_microbatch, measured.seconds_per_element,
             measured.num_params, count], dtype=torch.float64,
        )  # fmt: skip
        buffer[4 : 4 + count] = torch.tensor(measured.microbatch_samples, dtype=torch.float64)
        buffer[4 + MAX_REPEATS : 4 + MAX_REPEATS + count] = torch.tensor(
            measured.element_samples, dtype=torch.float64
        )
    bookkeeping.broadcast(buffer, src=0, role=Role.OTHER).wait()
    values = buffer.tolist()
    count = int(values[3])
    return Calibration(
        seconds_per_microbatch=values[0],
        seconds_per_element=values[1],
        micro_batch_size=micro_batch_size,
        block_size=block_size,
        num_params=int(values[2]),
        bf16=bf16,
        microbatch_samples=tuple(values[4 : 4 + count]),
        element_samples=tuple(values[4 + MAX_REPEATS : 4 + MAX_REPEATS + count]),
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
            "statistic": "minimum of the thread CPU time of the standard pass's timed repeats",
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
