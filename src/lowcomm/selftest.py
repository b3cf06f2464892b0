"""``lowcomm selftest``: the battery to run first on your own hardware (about a minute).

    lowcomm selftest                 # 2 Gloo processes on the CPU
    lowcomm selftest --device cuda   # one process per visible GPU, NCCL

Every process runs the same checks; a check passes when it passes on every rank. The report
names the backend, NCCL version and devices, the link bandwidth measured with a real
all-reduce, and pass or fail per check with the fix for each failure; the exit code is 1 when
any check failed.

The checks:

* **device binding**: every process drives its own GPU.
* **collectives**: all-reduce (sum, mean, max), reduce-scatter, all-gather, broadcast and
  barrier, each launched asynchronously with compute running on the device while it is in
  flight, results compared exactly.
* **bookkeeping group**: a small gather on the separate Gloo group completes while a large
  all-reduce is in flight on the strategy's group (metrics never queue behind training).
* **bandwidth**: a timed all-reduce (report only).
* **real clock**: compute queued on the GPU is charged to compute when the clock reads time.
* **methods**: a few steps of every registered method (with the options its declaration gives
  for a short run, ``Strategy.quick_options``: the DiLoCo family with an int4-quantized
  exchange, ACCO with its communication thread and, on a GPU, its side stream, ...) on the
  device, compared with the same run on the CPU over the Gloo group (on the CPU the two runs
  must agree exactly).
* **variants**: CO2 and streaming DiLoCo on the real clock (nothing emulated), DDP with bf16
  on the wire, DiLoCo with an fp8 two-step exchange, and DDP on a Hugging Face GPT-2 (when
  transformers is installed), each compared with the same run on the CPU.
* **hierarchical group**: DiLoCo with an fp8 exchange on workers of two ranks each; the
  replicas of a worker must agree.
* **checkpoint**: a run stopped mid-period, saved to disk, restored into fresh objects and
  resumed equals the run straight through.

Under ``torchrun`` (``torchrun --nnodes N --nproc-per-node G ... -m lowcomm selftest --device
cuda``) the battery runs as torchrun's world, every node's ranks together, instead of
starting its own processes; rank 0 prints the report. The report ends with a short block to
paste into a bug report.
"""

from __future__ import annotations

import functools
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

_STEPS = 4
# Relative L2 distance allowed between a run on the GPU and the same run on the CPU (kernels
# differ in summation order; AdamW amplifies sign flips of tiny gradients to +-lr).
_GPU_TOLERANCE = 2e-3


@dataclass
class Check:
    """One check's result on one rank."""

    name: str
    passed: bool
    detail: str
    fix: str = ""


@dataclass
class RankReport:
    rank: int
    environment: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)


@dataclass
class SelftestConfig:
    """Options of ``lowcomm selftest``."""

    device: Literal["cpu", "cuda"] = "cpu"
    """cpu (Gloo, 2 processes) or cuda (NCCL, one process per GPU)."""
    workers: int | None = None
    """Processes to start (default: 2 on cpu, every visible GPU on cuda)."""
    timeout_s: float = 120.0
    """A collective that takes longer fails its check."""


# --- the worker ---------------------------------------------------------------------------


def _run_check(report: RankReport, name: str, fix: str, body: Callable[[], str]) -> None:
    try:
        detail = body()
        report.checks.append(Check(name, True, detail))
    except Exception as error:  # a check's failure is its report, not the battery's end
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        message = lines[0] if lines else type(error).__name__
        if not isinstance(error, AssertionError):
            message = f"{type(error).__name__}: {message}"
        report.checks.append(Check(name, False, message, fix))
        traceback.print_exc(file=sys.stderr)


def selftest_worker(config: SelftestConfig) -> RankReport:
    """The battery, on one rank of an initialised process group."""
    import torch.distributed as dist

    from lowcomm.comm.torch_comm import TorchComm

    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if config.device == "cuda"
        else torch.device("cpu")
    )
    report = RankReport(rank=rank, environment=_environment(device))
    strategy_group = TorchComm(timeout_s=config.timeout_s)
    bookkeeping = strategy_group.cpu_side_group()
    _communication_checks(report, strategy_group, bookkeeping, device)
    _method_checks(report, config, strategy_group, bookkeeping, device)
    bookkeeping.barrier().wait()
    return report


def _communication_checks(
    report: RankReport, strategy_group: Any, bookkeeping: Any, device: torch.device
) -> None:
    """The checks of the process groups, the link and the clock, into ``report``."""
    nccl_fix = (
        "rerun with NCCL_DEBUG=INFO to see the transport NCCL chose; try NCCL_P2P_DISABLE=1 or "
        "NCCL_IB_DISABLE=1 to isolate a broken link, and check every process sees its own GPU"
        if device.type == "cuda"
        else "check that the loopback interface works (GLOO_SOCKET_IFNAME=lo) and that no "
        "firewall blocks local ports"
    )
    _run_check(
        report,
        "device binding",
        "each process must drive its own GPU: launch at most one process per GPU (torchrun "
        "--nproc-per-node <= GPUs) and do not remap CUDA_VISIBLE_DEVICES per process",
        lambda: _check_binding(bookkeeping, device),
    )
    _run_check(report, "collectives", nccl_fix, lambda: _check_collectives(strategy_group, device))
    _run_check(
        report,
        "bookkeeping group",
        "metrics waited for the training all-reduce: the bookkeeping group must be a separate "
        "Gloo group (lowcomm.comm.torch_comm.TorchComm.cpu_side_group); report this as a bug",
        lambda: _check_bookkeeping(strategy_group, bookkeeping, device),
    )
    _run_check(
        report,
        "bandwidth",
        nccl_fix,
        lambda: _measure_bandwidth(strategy_group, device, report.environment),
    )
    _run_check(
        report,
        "arrival time",
        "the real clock times a settled collective from its data's arrival "
        "(lowcomm.comm.cuda_arrival on NCCL, the completion future on Gloo); without it CoCoDC "
        "with --network none synchronises every step: report this as a bug with the output",
        lambda: _check_arrival(strategy_group, device),
    )
    _run_check(
        report,
        "real clock",
        "the real clock must wait for queued kernels before reading the time "
        "(lowcomm.comm.clock.RealClock with device=cuda); report this as a bug",
        lambda: _check_clock(device),
    )


def _method_checks(
    report: RankReport,
    config: SelftestConfig,
    strategy_group: Any,
    bookkeeping: Any,
    device: torch.device,
) -> None:
    """Every registered method, the variants, a hierarchical group and a checkpoint."""
    for method in methods_to_check():
        _run_check(
            report,
            f"method {method}",
            f"{method} on {device.type} differs from the same run on the CPU or failed: rerun "
            f"with CUBLAS_WORKSPACE_CONFIG=:4096:8 and NVIDIA_TF32_OVERRIDE=0 to rule out "
            f"nondeterministic or TF32 kernels, then report the output as a bug"
            if device.type == "cuda"
            else f"{method} gave different results on two Gloo groups: report this as a bug",
            lambda method=method: _check_method(method, strategy_group, bookkeeping, device),  # type: ignore[misc]
        )
    for name, method, variant in _variants():
        _run_check(
            report,
            name,
            f"{name} differs from the same run on the CPU or failed: report the output as a bug",
            lambda method=method, variant=variant: _check_method(  # type: ignore[misc]
                method, strategy_group, bookkeeping, device, variant
            ),
        )
    _run_check(
        report,
        "hierarchical group",
        "workers of two ranks each (--ranks-per-worker 2) failed: check that every rank can "
        "create sub-groups of the world, then report the output as a bug",
        lambda: _check_hierarchical(bookkeeping, device, config.timeout_s),
    )
    _run_check(
        report,
        "checkpoint and resume",
        "a resumed run must continue the uninterrupted one: report this as a bug with the "
        "output (and check the disk is writable)",
        lambda: _check_resume(strategy_group, device),
    )


def _environment(device: torch.device) -> dict[str, str]:
    import torch.distributed as dist

    environment = {
        "torch": torch.__version__,
        "backend": str(dist.get_backend()),
        "world_size": str(dist.get_world_size()),
        "device": str(device),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        environment["device_name"] = (
            f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
            f"compute capability {properties.major}.{properties.minor}"
        )
        environment["cuda"] = str(torch.version.cuda)
        nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        environment["nccl"] = (
            ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
        )
    else:
        environment["device_name"] = "CPU"
    return environment


def _check_binding(bookkeeping: Any, device: torch.device) -> str:
    from lowcomm.comm.base import Role

    index = float(device.index if device.index is not None else -1)
    mine = torch.tensor([index], dtype=torch.float64)
    everyone = torch.zeros(bookkeeping.world_size, dtype=torch.float64)
    bookkeeping.all_gather(everyone, mine, role=Role.OTHER).wait()
    if device.type != "cuda":
        return f"{bookkeeping.world_size} processes on the CPU"
    indices = [int(value) for value in everyone.tolist()]
    assert len(set(indices)) == len(indices), f"processes share GPUs: devices {indices}"
    return f"one GPU per process: cuda:{indices}"


def _check_clock(device: torch.device) -> str:
    from lowcomm.comm.clock import make_clock

    clock = make_clock("real", device=device)
    size = 2048 if device.type == "cuda" else 256
    a = torch.randn(size, size, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock.mark()
    begin = time.perf_counter()
    for _ in range(20):
        a = torch.tanh(a @ a)  # queued, not waited for, on a GPU
    clock.mark()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    kernels_s = time.perf_counter() - begin
    clock.settle_timing()
    # Timed by the host alone the clock would see only the launches (microseconds); on a GPU
    # it charges the device time between its timing events. On the CPU nothing is queued;
    # only a sanity check there (a shared CPU preempts).
    needed = 0.5 * kernels_s if device.type == "cuda" else 0.0
    assert clock.compute_s > needed, (
        f"the clock charged {clock.compute_s * 1e3:.1f} ms of compute for "
        f"{kernels_s * 1e3:.1f} ms of queued kernels"
    )
    return (
        f"{clock.compute_s * 1e3:.1f} ms of compute charged for {kernels_s * 1e3:.1f} ms of kernels"
    )


#: How late the last rank joins the arrival check's collective.
LATE_S = 0.3


def _check_arrival(comm: Any, device: torch.device) -> str:
    """A collective the last rank joins LATE_S late: on every other rank its data arrives
    that late after the launch, and the handle's arrival stamp must say so (NCCL's own
    completion future fires at the launch)."""
    from lowcomm.comm.base import Role, arrival_stamp

    comm.barrier().wait()
    late = comm.rank == comm.world_size - 1
    if late:
        time.sleep(LATE_S)
    tensor = torch.ones(1 << 10, device=device)
    launched = time.perf_counter()
    handle = comm.all_reduce(tensor, op="sum", role=Role.OTHER)
    handle.wait()
    arrived = arrival_stamp(handle)
    assert arrived is not None, "the collective's handle has no arrival time"
    after = arrived - launched
    assert after <= time.perf_counter() - launched + 1e-3, (
        f"the arrival is stamped {after:.3f} s after the launch, later than the wait's return"
    )
    if late:
        return f"stamped {after * 1e3:.1f} ms after the launch on the late rank"
    assert after >= 0.8 * LATE_S, (
        f"the data of a collective one rank joined {LATE_S:.1f} s late is stamped "
        f"{after * 1e3:.1f} ms after the launch"
    )
    return f"stamped {after * 1e3:.0f} ms after the launch, a peer {LATE_S * 1e3:.0f} ms late"


def _busy(device: torch.device) -> torch.Tensor:
    """Compute queued on the device while a collective is in flight."""
    size = 512 if device.type == "cuda" else 64
    a = torch.ones(size, size, device=device)
    for _ in range(4):
        a = (a @ a).clamp_(max=1.0)
    return a


def _check_collectives(comm: Any, device: torch.device) -> str:
    from lowcomm.comm.base import Role

    n, r = comm.world_size, comm.rank
    size = 1 << 16
    mine = torch.full((size,), float(r + 1), device=device)
    expected_sum = n * (n + 1) / 2
    results: list[str] = []

    def overlapped(launch: Callable[[], Any]) -> None:
        handle = launch()
        _busy(device)  # the device computes while the collective is in flight
        handle.wait()

    for op, want in (("sum", expected_sum), ("mean", expected_sum / n), ("max", float(n))):
        tensor = mine.clone()
        overlapped(functools.partial(comm.all_reduce, tensor, op=op, role=Role.OTHER))
        assert torch.all(tensor == want), f"all_reduce {op}: got {tensor[0].item()}, want {want}"
        results.append(f"all_reduce {op}")
    gathered = torch.empty(n * size, device=device)
    overlapped(lambda: comm.all_gather(gathered, mine, role=Role.OTHER))
    want_gather = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(size)
    assert torch.equal(gathered, want_gather), "all_gather: the pieces are not in rank order"
    results.append("all_gather")
    scattered = torch.empty(size, device=device)
    full = torch.arange(n * size, device=device, dtype=torch.float32)
    overlapped(lambda: comm.reduce_scatter(scattered, full, op="sum", role=Role.OTHER))
    want_scatter = full[r * size : (r + 1) * size] * n
    assert torch.equal(scattered, want_scatter), "reduce_scatter: wrong shard or sum"
    results.append("reduce_scatter")
    sent = torch.full((size,), float(r + 7), device=device)
    overlapped(lambda: comm.broadcast(sent, src=n - 1, role=Role.OTHER))
    assert torch.all(sent == float(n + 6)), "broadcast: the value is not the source's"
    results.append("broadcast")
    comm.barrier().wait()
    results.append("barrier")
    return ", ".join(results) + f" correct with compute in flight ({n} ranks)"


def _check_bookkeeping(strategy_group: Any, bookkeeping: Any, device: torch.device) -> str:
    from lowcomm.comm.base import Role

    big = torch.ones((256 << 20) // 4 if device.type == "cuda" else (4 << 20) // 4, device=device)
    begin = time.perf_counter()
    training = strategy_group.all_reduce(big, op="sum", role=Role.GRADIENT)
    small = torch.full((4,), float(bookkeeping.rank), dtype=torch.float64)
    gathered = torch.zeros(4 * bookkeeping.world_size, dtype=torch.float64)
    bookkeeping.all_gather(gathered, small, role=Role.OTHER).wait()
    metrics_s = time.perf_counter() - begin
    training.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    training_s = time.perf_counter() - begin
    want = torch.arange(bookkeeping.world_size, dtype=torch.float64).repeat_interleave(4)
    assert torch.equal(gathered, want), "the bookkeeping gather returned wrong values"
    assert torch.all(big == strategy_group.world_size), (
        "the training all-reduce returned wrong values"
    )
    # Timed on a GPU only: on a shared CPU both transfers compete for the same cores.
    if device.type == "cuda" and training_s > 0.05:
        assert metrics_s < 0.8 * training_s, (
            f"the metrics gather took {metrics_s * 1e3:.1f} ms, as long as the "
            f"{training_s * 1e3:.1f} ms all-reduce in flight: it waited behind it"
        )
    return (
        f"metrics gather {metrics_s * 1e3:.1f} ms beside a {big.numel() * 4 >> 20} MiB "
        f"all-reduce of {training_s * 1e3:.1f} ms (separate Gloo group)"
    )


def _measure_bandwidth(comm: Any, device: torch.device, environment: dict[str, str]) -> str:
    from lowcomm.comm.base import Role

    size_bytes = (256 << 20) if device.type == "cuda" else (16 << 20)
    tensor = torch.ones(size_bytes // 4, device=device)
    comm.all_reduce(tensor, op="sum", role=Role.OTHER).wait()  # warm-up (connections)
    repeats = 5 if device.type == "cuda" else 3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    comm.barrier().wait()
    begin = time.perf_counter()
    for _ in range(repeats):
        comm.all_reduce(tensor, op="sum", role=Role.OTHER).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - begin) / repeats
    n = comm.world_size
    # Bus bandwidth: what each rank's link carried in a ring all-reduce (NCCL-tests' busbw).
    bus_gbps = 2 * (n - 1) / n * size_bytes * 8 / seconds / 1e9 if n > 1 else math.inf
    environment["allreduce_bus_gbps"] = f"{bus_gbps:.2f}"
    return (
        f"all-reduce of {size_bytes >> 20} MiB in {seconds * 1e3:.1f} ms: bus bandwidth "
        f"{bus_gbps:.2f} Gbit/s per rank (give lowcomm plan/train --bandwidth-gbps this figure)"
    )


# --- method runs ----------------------------------------------------------------------------


def methods_to_check() -> tuple[str, ...]:
    """Every registered method that runs on this group of processes, in registry order (a
    method whose workers must be threads of one process is checked by its own tests)."""
    from lowcomm.strategies import STRATEGIES

    return tuple(name for name, cls in STRATEGIES.items() if cls.one_process_refusal is None)


def quick_options(method: str, quantization: str | None = None) -> object | None:
    """The options of ``method`` for a short run: its declared ``quick_options``, the rest
    at their defaults (None for a method without options); ``quantization`` replaces the
    format of a method that declares a quantized exchange."""
    from lowcomm.strategies import options_class, strategy_class

    cls = strategy_class(method)
    kind = options_class(cls)
    if kind is None:
        return None
    values = dict(cls.quick_options)
    if quantization is not None and cls.quantized_exchange is not None:
        values[cls.quantized_exchange.format_option] = quantization
    options: object = kind(**values)
    return options


def _strategy(
    method: str, model: torch.nn.Module, comm: Any, context: Any, quantization: str | None
) -> Any:
    from lowcomm.strategies import strategy_class

    cls, options = strategy_class(method), quick_options(method, quantization)
    if options is None:
        return cls(model, comm, context)
    return cls(model, comm, context, options=options)  # type: ignore[call-arg]


def _tiny_model(device: torch.device, family: str = "gpt") -> torch.nn.Module:
    from lowcomm.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if family != "gpt":  # a Hugging Face model through lowcomm's wrapper
        from lowcomm.models import ModelConfig, build_model

        config = ModelConfig(family=family, n_layer=1, n_head=2, n_embd=32, block_size=16)
        return build_model(config, 64).to(device)
    model = GPT(
        GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0)
    )
    return model.to(device)


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    tokens = torch.randint(0, 64, (2, 17), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


@dataclass(frozen=True)
class Variant:
    """How a method check runs besides the defaults (the virtual clock, float32 on the wire,
    the int4-quantized DiLoCo exchange, lowcomm's GPT)."""

    clock: Literal["virtual", "real"] = "virtual"
    comm_dtype: Literal["fp32", "bf16"] = "fp32"
    quantization: str = "int4"
    family: str = "gpt"


def _build(
    method: str, raw: Any, device: torch.device, variant: Variant = Variant()
) -> tuple[Any, torch.nn.Module, Any, Any]:
    """(strategy, model, network comm, clock) of a short deterministic run on ``device``:
    by default the virtual clock with a declared micro-batch cost, so clock-driven choices
    (ACCO's micro-batch counts, CoCoDC's schedule) are the same on every device; the real
    clock (``variant``) with nothing emulated, for methods that make no clock-driven choice."""
    from lowcomm.comm.cast import wire_dtype
    from lowcomm.comm.clock import make_clock
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.optim import AdamWConfig
    from lowcomm.strategies import StrategyContext

    if variant.clock == "real":
        clock = make_clock("real", device=device)
        profile = NetworkProfile.from_preset("none")
    else:
        clock = make_clock("virtual", seconds_per_microbatch=0.05, device=device)
        profile = NetworkProfile.from_preset("ethernet")
    wire = wire_dtype(variant.comm_dtype)
    comm = NetworkComm(raw, profile, clock, device=device, wire_dtype=wire)
    model = _tiny_model(device, variant.family)
    context = StrategyContext(optim=AdamWConfig(lr=1e-3), total_steps=2 * _STEPS, max_grad_norm=1.0)
    return _strategy(method, model, comm, context, variant.quantization), model, comm, clock


def _train(strategy: Any, model: torch.nn.Module, clock: Any, steps: range, rank: int) -> float:
    from lowcomm.strategies import MicroBatchResult

    device = next(model.parameters()).device
    counter = {"microbatch": 0}
    loss_total = 0.0
    for step in steps:

        def closure(step: int = step) -> MicroBatchResult:
            inputs, targets = _batch(1000 * step + counter["microbatch"], rank, device)
            counter["microbatch"] += 1
            _, loss = model(inputs, targets)
            assert loss is not None
            loss.backward()
            clock.microbatch_done()
            return MicroBatchResult(loss=float(loss.detach()), samples=2, tokens=inputs.numel())

        counter["microbatch"] = 0
        loss_total = strategy.step(closure).loss
    return loss_total


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def _check_method(
    method: str,
    strategy_group: Any,
    bookkeeping: Any,
    device: torch.device,
    variant: Variant = Variant(),
) -> str:
    strategy, model, _, clock = _build(method, strategy_group, device, variant)
    loss = _train(strategy, model, clock, range(_STEPS), strategy_group.rank)
    stream_note = ""
    # A method with a communication thread (the ACCO family) says which stream its chain ran on.
    if hasattr(strategy, "last_chain_stream") and device.type == "cuda":
        side = strategy.last_chain_stream
        assert side is not None and side != torch.cuda.default_stream(device), (
            f"{method}'s chain ran on the default stream, not its side stream"
        )
        stream_note = ", chain on the side stream"
    strategy.finish()
    # The reference: the same run on the CPU over the Gloo group, on the virtual clock (the
    # methods checked on the real clock make no clock-driven choice).
    reference, reference_model, _, reference_clock = _build(
        method,
        bookkeeping,
        torch.device("cpu"),
        Variant(
            clock="virtual",
            comm_dtype=variant.comm_dtype,
            quantization=variant.quantization,
            family=variant.family,
        ),
    )
    reference_loss = _train(
        reference, reference_model, reference_clock, range(_STEPS), bookkeeping.rank
    )
    reference.finish()
    for each in (strategy, reference):
        close = getattr(getattr(each, "thread", None), "close", None)
        if close is not None:
            close()
    ours, theirs = _flat(model), _flat(reference_model)
    distance = float((ours - theirs).norm() / theirs.norm().clamp(min=1e-12))
    assert math.isfinite(loss), f"loss {loss} is not finite"
    if device.type == "cpu":
        assert distance == 0.0, f"two identical runs differ (relative L2 {distance:.2e})"
    else:
        assert distance <= _GPU_TOLERANCE, (
            f"parameters differ from the CPU run by {distance:.2e} (relative L2; allowed "
            f"{_GPU_TOLERANCE:.0e})"
        )
    return (
        f"{_STEPS} steps, loss {loss:.4f} (CPU {reference_loss:.4f}), parameters within "
        f"{distance:.1e} of the CPU run{stream_note}"
    )


def _variants() -> list[tuple[str, str, Variant]]:
    """Method checks beyond the defaults: the real clock (methods whose overlap it times),
    bf16 on the wire, an fp8 two-step exchange, and a Hugging Face model when transformers
    is installed."""
    variants = [
        ("method co2 (real clock)", "co2", Variant(clock="real")),
        ("method streaming_diloco (real clock)", "streaming_diloco", Variant(clock="real")),
        ("method ddp (bf16 on the wire)", "ddp", Variant(comm_dtype="bf16")),
        ("method diloco (fp8 exchange)", "diloco", Variant(quantization="fp8")),
    ]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return variants
    return [*variants, ("method ddp (Hugging Face GPT-2)", "ddp", Variant(family="hf-gpt2"))]


def _check_hierarchical(bookkeeping: Any, device: torch.device, timeout_s: float) -> str:
    """DiLoCo with an fp8 exchange on workers of two ranks each: the replicas of a worker
    must end with the same parameters (their gradients are averaged every step; the
    exchange's shards cross the outer link and are reassembled inside the worker)."""
    import torch.distributed as dist

    from lowcomm.comm.clock import make_clock
    from lowcomm.comm.hierarchical import HierarchicalComm
    from lowcomm.launch.groups import level_comms
    from lowcomm.optim import AdamWConfig
    from lowcomm.strategies import StrategyContext

    world = dist.get_world_size()
    if world % 2:
        return f"skipped: {world} ranks do not split into workers of two"
    inner, outer = level_comms(2, timeout_s)  # (every rank creates the groups)
    model = _tiny_model(device)
    context = StrategyContext(optim=AdamWConfig(lr=1e-3), total_steps=2 * _STEPS, max_grad_norm=1.0)
    comm = HierarchicalComm(inner, outer)
    strategy = _strategy("diloco", model, comm, context, "fp8")
    clock = make_clock("virtual", seconds_per_microbatch=0.05)
    loss = _train(strategy, model, clock, range(2 * _STEPS), dist.get_rank())
    strategy.finish()
    mine = _flat(model)
    everyone = torch.zeros(world * mine.numel(), dtype=mine.dtype)
    bookkeeping.all_gather(everyone, mine, role=_other_role()).wait()
    rows = everyone.view(world, -1)
    for rank in range(0, world, 2):
        assert torch.equal(rows[rank], rows[rank + 1]), (
            f"ranks {rank} and {rank + 1} (one worker) hold different parameters"
        )
    assert math.isfinite(loss), f"loss {loss} is not finite"
    return f"{world // 2} workers of 2 ranks, diloco with fp8: replicas agree, loss {loss:.4f}"


def _other_role() -> Any:
    from lowcomm.comm.base import Role

    return Role.OTHER


def _check_resume(strategy_group: Any, device: torch.device) -> str:
    method, stop = "diloco", 3  # mid-period: outer state and anchors must survive
    strategy, model, _, clock = _build(method, strategy_group, device)
    _train(strategy, model, clock, range(2 * _STEPS), strategy_group.rank)
    straight = _flat(model)
    strategy, model, comm, clock = _build(method, strategy_group, device)
    _train(strategy, model, clock, range(stop), strategy_group.rank)
    with tempfile.TemporaryDirectory(prefix="lowcomm-selftest-") as directory:
        path = Path(directory) / f"rank{strategy_group.rank}.pt"  # a checkpoint on disk
        torch.save(
            {
                "strategy": strategy.state_dict(),
                "model": model.state_dict(),
                "clock": clock.state_dict(),
                "comm": comm.state_dict(),
            },
            path,
        )
        saved = torch.load(path, weights_only=True, map_location=device)
    strategy, model, comm, clock = _build(method, strategy_group, device)
    model.load_state_dict(saved["model"])
    strategy.load_state_dict(saved["strategy"])
    clock.load_state_dict(saved["clock"])
    comm.load_state_dict(saved["comm"])
    _train(strategy, model, clock, range(stop, 2 * _STEPS), strategy_group.rank)
    resumed = _flat(model)
    distance = float((resumed - straight).norm() / straight.norm())
    # Exact on the CPU; on a GPU some backward kernels (embedding) add in a varying order.
    limit = 0.0 if device.type == "cpu" else 1e-4
    assert distance <= limit, f"the resumed run differs from the straight one by {distance:.2e}"
    return (
        f"{method}: stopped at step {stop} of {2 * _STEPS}, saved to and read from disk, "
        f"resumed run equals the straight run"
    )


# --- the parent -----------------------------------------------------------------------------


def run_selftest(config: SelftestConfig) -> int:
    """Run the battery, print the report; return the exit code (0 when every check passed)."""
    from lowcomm.launch import WorkerFailed, spawn_workers

    begin = time.perf_counter()
    from lowcomm.launch import under_torchrun

    if under_torchrun():
        return _run_as_torchrun_world(config, begin)
    workers = config.workers
    if workers is None:
        workers = max(1, torch.cuda.device_count()) if config.device == "cuda" else 2
    print(f"lowcomm selftest: {workers} processes on {config.device}", flush=True)
    try:
        reports = spawn_workers(
            selftest_worker, workers, (config,), device=config.device, timeout_s=config.timeout_s
        )
    except (WorkerFailed, ValueError) as error:
        print(f"FAIL  start-up: {error}")
        print(
            "      fix: check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES and that "
            "torch.cuda.is_available() is True; or run lowcomm selftest --device cpu"
        )
        return 1
    print(format_report(reports, time.perf_counter() - begin))
    failed = any(not check.passed for report in reports for check in report.checks)
    return 1 if failed else 0


def _run_as_torchrun_world(config: SelftestConfig, begin: float) -> int:
    """Under ``torchrun``: this process is one rank of torchrun's world (every node's), joins
    it, runs the battery, and rank 0 prints the report of every rank (gathered on a Gloo
    group); every rank returns the same exit code."""
    import torch.distributed as dist

    from lowcomm.launch.spawn import init_from_env, leave_failed_rank

    init_from_env(device=config.device, timeout_s=config.timeout_s)
    try:
        if dist.get_rank() == 0:
            print(
                f"lowcomm selftest: the torchrun world, {dist.get_world_size()} ranks on "
                f"{config.device}",
                flush=True,
            )
        report = selftest_worker(config)
        gloo = dist.new_group(backend="gloo")
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report, group=gloo)
        if dist.get_rank() == 0:
            print(format_report(reports, time.perf_counter() - begin), flush=True)
        failed = any(not check.passed for each in reports for check in each.checks)
    except BaseException as error:
        leave_failed_rank(error)
    dist.destroy_process_group()
    return 1 if failed else 0


def format_report(reports: list[RankReport], seconds: float) -> str:
    first = reports[0]
    env = first.environment
    lines = [
        f"torch {env['torch']}, backend {env['backend']}, {env['world_size']} ranks",
    ]
    if "nccl" in env:
        lines.append(f"NCCL {env['nccl']}, CUDA {env['cuda']}")
    for report in reports:
        lines.append(
            f"  rank {report.rank}: {report.environment['device']} ({report.environment['device_name']})"
        )
    if "allreduce_bus_gbps" in env:
        lines.append(f"link: all-reduce bus bandwidth {env['allreduce_bus_gbps']} Gbit/s per rank")
    passed = 0
    for index, check in enumerate(first.checks):
        failures = [
            (report.rank, report.checks[index])
            for report in reports
            if index < len(report.checks) and not report.checks[index].passed
        ]
        if not failures:
            passed += 1
            lines.append(f"PASS  {check.name}: {check.detail}")
            continue
        rank, failure = failures[0]
        lines.append(f"FAIL  {check.name} (rank {rank}): {failure.detail}")
        lines.append(f"      fix: {failure.fix}")
    total = len(first.checks)
    lines.append(f"{passed}/{total} checks passed in {seconds:.0f} s")
    lines.append(_pasteable(reports, passed, total))
    return "\n".join(lines)


def _pasteable(reports: list[RankReport], passed: int, total: int) -> str:
    """One block a user can paste into a bug report: versions, world, devices, failures."""
    env = reports[0].environment
    devices = sorted({report.environment.get("device_name", "?") for report in reports})
    failed = sorted(
        {check.name for report in reports for check in report.checks if not check.passed}
    )
    versions = [f"torch {env.get('torch', '?')}"]
    if "nccl" in env:
        versions.append(f"NCCL {env['nccl']}, CUDA {env.get('cuda', '?')}")
    return "\n".join(
        [
            "--- paste into a bug report ---",
            f"lowcomm selftest: {passed}/{total} passed; {', '.join(versions)}; backend "
            f"{env.get('backend', '?')}, {len(reports)} ranks; devices: {', '.join(devices)}",
            f"failed: {', '.join(failed) if failed else 'none'}",
            "---",
        ]
    )
