"""The CUDA/NCCL path, checked on a machine without a GPU.

A stand-in accelerator: parameters live on PyTorch's ``meta`` device, which carries shapes and
dtypes but no data, and which PyTorch keeps apart from the CPU exactly as it keeps a GPU apart:
an operation that mixes a ``meta`` tensor with a CPU tensor (other than a 0-dim scalar) raises
"Tensor on device cpu is not on the expected device meta". (Fake CUDA tensors from
``FakeTensorMode`` would be the literal choice, but on a CPU-only build of PyTorch even
indexing one raises "not linked with support for cuda devices", so they cannot carry a
strategy through a step; ``meta`` can, backward included.) A checking communicator asserts
that every tensor handed to a strategy's collectives is on the parameters' device (what NCCL
requires), and reads of a stand-in tensor's value on the host (``float(t)``, ``t.item()``,
``bool(t)``, ``t.cpu()``) are counted instead of failing, which bounds the host
synchronisations of a step.

What this cannot check (kernels, streams, NCCL itself, timings) is listed in docs/clusters.md as
checked only by ``lowcomm selftest --device cuda``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import TINY
from lowcomm.comm.base import CollectiveKind, Handle, ReduceOp, Role, Segments
from lowcomm.comm.fake import RecordingComm
from lowcomm.comm.torch_comm import TorchComm
from lowcomm.config import CommConfig, PlacementConfig, RunConfig, TrainConfig
from lowcomm.data import DataConfig
from lowcomm.launch import spawn_workers
from lowcomm.models import ModelConfig
from lowcomm.models.gpt import GPT
from lowcomm.optim.quantize import decode, encode
from lowcomm.strategies import (
    STRATEGIES,
    MicroBatchResult,
    StrategyContext,
    build_strategy,
    strategy_class,
)
from lowcomm.train import loop

GPU = torch.device("meta")  # the stand-in accelerator


class HostReads:
    """Counts reads of stand-in tensors' values on the host (each a device sync on a GPU)."""

    def __init__(self) -> None:
        self.count = 0


@contextmanager
def stand_in_gpu() -> Iterator[HostReads]:
    """Count host reads of ``meta`` tensors instead of failing (a read returns 1, a copy to
    the host returns zeros)."""
    reads = HostReads()
    names = ("item", "__float__", "__bool__", "__int__", "cpu")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def patched(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.device.type != "meta":
                return original(self, *args, **kwargs)
            reads.count += 1
            if name == "cpu":
                return torch.zeros(self.shape, dtype=self.dtype)
            return {"item": 1.0, "__float__": 1.0, "__bool__": True, "__int__": 1}[name]

        return read

    try:
        for name in names:
            setattr(torch.Tensor, name, patched(name))
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class DeviceCheckingComm(RecordingComm):
    """A :class:`RecordingComm` that asserts every tensor it is handed is on ``device``."""

    def __init__(self, device: torch.device, *, rank: int = 0, world_size: int = 2) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self.device = device
        self.devices: list[torch.device] = []

    def _check(self, what: str, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self.devices.append(tensor.device)
            assert tensor.device == self.device, (
                f"{what} was handed a tensor on {tensor.device}; this group moves tensors on "
                f"{self.device} only"
            )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        self._check("all_reduce", tensor)
        return super().all_reduce(tensor, op=op, role=role, segments=segments)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        self._check("reduce_scatter", output, input)
        return super().reduce_scatter(output, input, op=op, role=role)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        self._check("all_gather", output, input)
        return super().all_gather(output, input, role=role)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        self._check("all_to_all", output, input)
        return super().all_to_all(output, input, role=role)

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        self._check("broadcast", tensor)
        return super().broadcast(tensor, src=src, role=role)


# --- evaluation on a worker without validation batches ----------------------------------


def _tiny_gpt_on_gpu() -> GPT:
    with GPU:
        return GPT(TINY)


def test_evaluation_sum_is_on_one_device_whether_or_not_the_worker_has_batches() -> None:
    """With more workers than validation batches a worker has none, and every worker must
    still hand the evaluation group a tensor it carries. That group is the Gloo bookkeeping
    group, so the sum is a CPU tensor on every worker, with or without batches (an NCCL group
    refuses a CPU tensor, and a mix of devices across workers would not match)."""
    bookkeeping = DeviceCheckingComm(torch.device("cpu"))
    with stand_in_gpu():
        model = _tiny_gpt_on_gpu()
        batch = torch.zeros(2, TINY.block_size, dtype=torch.long, device=GPU)
        loop._evaluate(model, [], bookkeeping)  # a worker without a validation batch
        loop._evaluate(model, [(batch, batch)], bookkeeping)  # a worker with one
    assert bookkeeping.devices == [torch.device("cpu")] * 2


# --- quantized outer gradients stay on the parameters' device --------------------------


@pytest.mark.parametrize("fmt", ["none", "bf16", "fp8", "int4"])
def test_quantization_round_trip_stays_on_the_device(fmt: str) -> None:
    with stand_in_gpu() as reads:
        values = torch.zeros(1000, device=GPU)
        payload = encode(values, fmt, 64)  # type: ignore[arg-type]
        assert payload.device == GPU
        assert decode(payload, 1000, fmt, 64).device == GPU  # type: ignore[arg-type]
    assert reads.count == 0


@pytest.mark.parametrize("method", ["diloco", "streaming_diloco", "eager", "cocodc"])
@pytest.mark.parametrize("fmt", ["none", "int4"])
def test_diloco_family_exchange_is_on_the_parameters_device(method: str, fmt: str) -> None:
    """Every tensor of a (quantized) outer-gradient exchange is on the GPU."""
    comm = _run_on_stand_in(method, quantization=fmt)
    # (Quantized: the two-step exchange's first step counts as a reduce-scatter.)
    kind = CollectiveKind.ALL_REDUCE if fmt == "none" else CollectiveKind.REDUCE_SCATTER
    assert comm.count(kind, Role.PSEUDO_GRADIENT) > 0
    assert set(comm.devices) == {GPU}


# --- every strategy's communication and update paths on the stand-in device -------------


def _options(quantization: str) -> TrainConfig:
    config = TrainConfig()
    return dataclasses.replace(
        config,
        diloco=dataclasses.replace(
            config.diloco,
            sync_every=2,
            quantization=quantization,
            quantization_row_size=64,  # type: ignore[arg-type]
        ),
        local=dataclasses.replace(config.local, sync_every=2),
        desloc=dataclasses.replace(config.desloc, param_period=2),
        # Rounds within the few steps run here (the defaults, H = 15 and 100, have none).
        sparseloco=dataclasses.replace(config.sparseloco, sync_every=2),
        sparta=dataclasses.replace(config.sparta, sync_every=2),
        decoupled=dataclasses.replace(config.decoupled, sync_every=2),  # type: ignore[attr-defined]
    )


def _run_on_stand_in(
    method: str, *, steps: int = 4, quantization: str = "none", world_size: int = 2
) -> DeviceCheckingComm:
    """``steps`` steps of ``method`` (forward, backward, communication, update, a state dict
    round trip, evaluation's deployed model) with parameters on the stand-in device."""
    context = StrategyContext(total_steps=steps, max_grad_norm=1.0)
    with stand_in_gpu():
        model = _tiny_gpt_on_gpu()
        comm = DeviceCheckingComm(GPU, world_size=world_size)
        strategy = build_strategy(method, model, comm, context, _options(quantization))
        batch = torch.zeros(2, TINY.block_size, dtype=torch.long, device=GPU)

        def closure() -> MicroBatchResult:
            _, loss = model(batch, batch)
            assert loss is not None
            loss.backward()
            return MicroBatchResult(loss=float(loss.detach()), samples=2, tokens=batch.numel())

        for _ in range(steps):
            strategy.step(closure)
        strategy.load_state_dict(strategy.state_dict())
        with strategy.deployed() as deployed, torch.no_grad():
            deployed(batch, batch)
        strategy.finish()
    return comm


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_every_strategy_hands_its_collectives_tensors_on_the_parameters_device(method: str) -> None:
    comm = _run_on_stand_in(method)
    if strategy_class(method).one_process_refusal is not None:
        # Its workers may reach each other in shared memory, not through the comm: it hands
        # the comm no tensor, only the charges of its messages.
        assert comm.calls and not comm.devices, method
        return
    assert comm.devices, f"{method} made no collective"
    assert set(comm.devices) == {GPU}


# --- bookkeeping never travels on the strategy's group ---------------------------------


class _GroupRecordingComm(TorchComm):
    """The strategy's group, recording every collective handed to it."""

    def __init__(self, *, timeout_s: float | None = None) -> None:
        super().__init__(timeout_s=timeout_s)
        self.calls: list[tuple[str, str]] = []

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        self.calls.append(("all_reduce", role.value))
        return super().all_reduce(tensor, op=op, role=role, segments=segments)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        self.calls.append(("reduce_scatter", role.value))
        return super().reduce_scatter(output, input, op=op, role=role)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        self.calls.append(("all_gather", role.value))
        return super().all_gather(output, input, role=role)

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        self.calls.append(("broadcast", role.value))
        return super().broadcast(tensor, src=src, role=role)

    def barrier(self) -> Handle:
        self.calls.append(("barrier", "-"))
        return super().barrier()


def _record_strategy_group(config: TrainConfig) -> list[tuple[str, str]]:
    raw = _GroupRecordingComm(timeout_s=60.0)
    loop.train_worker(config, raw)  # the loop makes its own bookkeeping group
    return raw.calls


def test_metrics_evaluation_and_checkpoint_barriers_never_use_the_strategys_group(
    tmp_path: Path,
) -> None:
    """On NCCL one group is one stream, so a metrics gather on the strategy's group
    waits behind its in-flight all-reduce. Two Gloo workers train co2 (an all-reduce in
    flight across steps) with per-step metrics, evaluation and checkpoints; the strategy's
    group must see only the method's own traffic and the initial parameter broadcast. (The
    real clock; the virtual clock's launch-time agreements are checked below.)"""
    config = TrainConfig(
        method="co2",
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        placement=PlacementConfig(workers=2),
        run=RunConfig(
            steps=4,
            eval_every=2,
            eval_batches=1,  # one worker has no validation batch
            checkpoint_every=2,
            progress=False,
            plot=False,
            out=str(tmp_path / "run"),
        ),
        comm=CommConfig(clock="real"),
    )
    calls = spawn_workers(_record_strategy_group, 2, (config,), timeout_s=120.0)
    for rank_calls in calls:
        assert ("barrier", "-") not in rank_calls
        others = [call for call in rank_calls if call[1] == Role.OTHER.value]
        assert others == [], f"bookkeeping on the strategy's group: {others}"
        strategy_traffic = [call for call in rank_calls if call[1] != Role.PARAMETER.value]
        assert strategy_traffic, "the strategy made no collective"


class _HostGroupRecordingComm(TorchComm):
    """A host group of the world, recording each all-reduce's (op, dtype, elements)."""

    def __init__(self, group: Any, *, timeout_s: float) -> None:
        super().__init__(group, timeout_s=timeout_s)
        self.reductions: list[tuple[str, torch.dtype, int]] = []

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        self.reductions.append((op, tensor.dtype, tensor.numel()))
        return super().all_reduce(tensor, op=op, role=role, segments=segments)


def _record_strategy_and_host_groups(
    config: TrainConfig,
) -> tuple[list[tuple[str, str]], list[tuple[str, torch.dtype, int]]]:
    import torch.distributed as dist

    raw = _GroupRecordingComm(timeout_s=60.0)
    books = _HostGroupRecordingComm(dist.new_group(backend="gloo"), timeout_s=60.0)
    loop.train_worker(config, raw, bookkeeping=books)
    return raw.calls, books.reductions


def test_the_virtual_clock_agrees_launch_times_on_the_host_group(tmp_path: Path) -> None:
    """On the virtual clock every collective of a group of two or more agrees on its launch
    time (the latest of the ranks'). A flat worker does it on the world's host (Gloo) group as
    a float64 max of one element: on NCCL the strategy's group would carry a device
    all-reduce and a host read of it per collective. Two Gloo workers train ddp on the virtual
    clock: the strategy's group carries only the method's payloads (one a step) and the
    initial broadcast, and the host group one agreement per payload."""
    config = TrainConfig(
        method="ddp",
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        placement=PlacementConfig(workers=2),
        run=RunConfig(steps=4, progress=False, plot=False, out=str(tmp_path / "run")),
    )
    assert config.comm.clock == "virtual"
    results = spawn_workers(_record_strategy_and_host_groups, 2, (config,), timeout_s=120.0)
    for strategy_calls, host_reductions in results:
        assert [call for call in strategy_calls if call[1] == Role.OTHER.value] == []
        payloads = [call for call in strategy_calls if call[1] != Role.PARAMETER.value]
        agreements = [r for r in host_reductions if r == ("max", torch.float64, 1)]
        assert len(payloads) == config.run.steps
        assert len(agreements) == len(payloads), host_reductions


class _LevelRecordingComm(TorchComm):
    """A level group (a worker's ranks, or one local index's ranks across workers),
    recording each collective's (kind, role, op, dtype, elements)."""

    def __init__(self, made: TorchComm) -> None:
        super().__init__(made._group, timeout_s=60.0)
        self.calls: list[tuple[str, str, str, torch.dtype, int]] = []

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        self.calls.append(("all_reduce", role.value, op, tensor.dtype, tensor.numel()))
        return super().all_reduce(tensor, op=op, role=role, segments=segments)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        self.calls.append(("reduce_scatter", role.value, op, input.dtype, input.numel()))
        return super().reduce_scatter(output, input, op=op, role=role)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        self.calls.append(("all_gather", role.value, "-", input.dtype, input.numel()))
        return super().all_gather(output, input, role=role)


def _record_level_groups(
    config: TrainConfig,
) -> list[tuple[str | None, list[list[tuple[str, str, str, torch.dtype, int]]]]]:
    from lowcomm.launch import groups

    made: list[tuple[str | None, tuple[_LevelRecordingComm, _LevelRecordingComm]]] = []
    level_comms = groups.level_comms

    def recording(
        ranks_per_worker: int, timeout_s: float | None = None, *, backend: str | None = None
    ) -> tuple[_LevelRecordingComm, _LevelRecordingComm]:
        replica, outer = level_comms(ranks_per_worker, timeout_s, backend=backend)
        pair = (_LevelRecordingComm(replica), _LevelRecordingComm(outer))
        made.append((backend, pair))
        return pair

    groups.level_comms = recording  # type: ignore[assignment]
    loop.train_worker(config, TorchComm(timeout_s=60.0))
    return [(backend, [level.calls for level in pair]) for backend, pair in made]


def test_hierarchical_workers_agree_launch_times_on_host_groups_of_their_levels(
    tmp_path: Path,
) -> None:
    """With two ranks per worker the method's collectives run on two level groups (a worker's
    ranks; one local index across workers), each made with a host (Gloo) group of the same
    ranks, on which the virtual clock agrees on each launch time: the level groups carry only
    payloads, their host groups one float64 max of one element per payload. Two workers of
    two Gloo ranks train ddp on the virtual clock."""
    config = TrainConfig(
        method="ddp",
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        placement=PlacementConfig(workers=2, ranks_per_worker=2),
        run=RunConfig(steps=3, progress=False, plot=False, out=str(tmp_path / "run")),
    )
    assert config.comm.clock == "virtual"
    for made in spawn_workers(_record_level_groups, 4, (config,), timeout_s=180.0):
        assert [backend for backend, _ in made] == [None, "gloo"]
        (_, levels), (_, hosts) = made
        for level, host in zip(levels, hosts, strict=True):
            assert level and all(call[1] != Role.OTHER.value for call in level), level
            assert host == [("all_reduce", "other", "max", torch.float64, 1)] * len(level)


# --- no host synchronisation in a step outside the closure ----------------------------

# Host reads a step may make, by method: the ACCO family reads the global micro-batch count
# (and acco the clipping norm) on its communication thread, where it blocks no queued
# compute; co2 and cocodc read a few diagnostics once per synchronisation; decoupled_diloco's
# learners in processes read the tick's gathered clocks and send counters (the replicas'
# merges are decided on the host).
_ALLOWED_HOST_READS = {"acco": 2, "dpu": 1, "wp": 1, "co2": 2, "cocodc": 7, "decoupled_diloco": 1}


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_a_step_reads_nothing_back_to_the_host(method: str) -> None:
    """Every read of a device value on the host waits for all queued kernels.
    Clipping computes its factor on the device, so a step reads nothing back (beyond the
    listed exceptions)."""
    context = StrategyContext(total_steps=4, max_grad_norm=1.0)
    per_step: list[int] = []
    with stand_in_gpu() as reads:
        model = _tiny_gpt_on_gpu()
        strategy = build_strategy(method, model, DeviceCheckingComm(GPU), context, _options("none"))
        batch = torch.zeros(2, TINY.block_size, dtype=torch.long, device=GPU)

        def closure() -> MicroBatchResult:
            _, loss = model(batch, batch)
            assert loss is not None
            loss.backward()
            return MicroBatchResult(loss=1.0, samples=2, tokens=batch.numel())

        for _ in range(4):
            before = reads.count
            strategy.step(closure)
            per_step.append(reads.count - before)
        strategy.finish()
    assert max(per_step) <= _ALLOWED_HOST_READS.get(method, 0), per_step


# --- device binding, GPU count, timeouts, the ACCO thread's device --------------------


def test_more_processes_than_gpus_is_refused_with_the_fix() -> None:
    from lowcomm.launch.devices import check_gpu_count

    check_gpu_count(8, available=8)
    with pytest.raises(ValueError, match="9 processes on this node but 8 GPU"):
        check_gpu_count(9, available=8)
    with pytest.raises(ValueError, match="no GPU is visible"):
        check_gpu_count(1, available=0)


def test_a_process_given_its_own_gpu_by_its_launcher_is_accepted() -> None:
    from lowcomm.launch.devices import given_own_gpu

    assert given_own_gpu(1, "3")  # SLURM --gpus-per-task=1: one device, named by the launcher
    assert given_own_gpu(1, "GPU-5f3c")
    assert not given_own_gpu(1, None)  # one GPU on the node: local rank 1 has none of its own
    assert not given_own_gpu(2, "0,1")
    assert not given_own_gpu(1, "")


def test_two_ranks_on_one_physical_gpu_are_named() -> None:
    from lowcomm.launch.devices import shared_gpus

    assert shared_gpus([("a", "u0"), ("a", "u1"), ("b", "u0"), ("b", "u1")]) == []
    assert shared_gpus([("a", "u0"), ("a", "u1"), ("a", "u0")]) == ["a GPU u0: ranks 0, 2"]


def test_spawning_more_cuda_workers_than_gpus_fails_before_starting_any() -> None:
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match="--device cuda"):
        spawn_workers(_record_strategy_group, too_many, (None,), device="cuda")


def test_nccl_init_gets_the_bound_device_and_a_timeout_beyond_the_waits() -> None:
    from lowcomm.launch.devices import init_options

    options = init_options(torch.device("cuda", 3), 300.0)
    assert options["backend"] == "nccl"
    assert options["device_id"] == torch.device("cuda", 3)
    assert options["timeout"].total_seconds() > 300.0
    cpu = init_options(torch.device("cpu"), 30.0)
    assert cpu["backend"] == "gloo" and "device_id" not in cpu
    assert cpu["timeout"].total_seconds() >= 30.0 + 60.0


@pytest.mark.parametrize(
    "message",
    [
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
        "OpType=ALLREDUCE, NumelIn=1024, Timeout(ms)=600000) ran for 600012 milliseconds "
        "before timing out.",
        "Work WorkNCCL(SeqNum=3, OpType=ALLGATHER) timed out in blocking wait",
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "5000ms for recv operation to complete",
    ],
)
def test_nccl_and_gloo_timeouts_become_collective_timeout(message: str) -> None:
    from lowcomm.comm.base import CollectiveTimeout
    from lowcomm.comm.torch_comm import _WorkHandle

    class TimingOut:
        def wait(self, timeout: object = None) -> None:
            raise RuntimeError(message)

        def is_completed(self) -> bool:
            return False

    with pytest.raises(CollectiveTimeout, match="did not complete"):
        _WorkHandle(TimingOut(), what="all_reduce", timeout_s=5.0).wait()


def test_the_communication_thread_binds_the_strategys_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The current CUDA device is per thread; ACCO's communication thread must make
    the parameters' GPU current before its kernels and NCCL calls."""
    import threading

    from lowcomm.comm.overlap import CommThread

    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: bound.append((threading.current_thread().name, device)),
    )
    thread = CommThread(device=torch.device("cuda", 5))
    thread.submit(lambda: None).wait()
    thread.close()
    assert len(bound) == 1
    name, device = bound[0]
    assert name.startswith("lowcomm-comm") and device == torch.device("cuda", 5)


def test_acco_gives_its_thread_the_parameters_device() -> None:
    from lowcomm.comm.overlap import CommThread
    from lowcomm.strategies.acco import ACCO

    with stand_in_gpu():
        model = _tiny_gpt_on_gpu()
        strategy = build_strategy(
            "acco", model, DeviceCheckingComm(GPU), StrategyContext(total_steps=2), _options("none")
        )
        assert isinstance(strategy, ACCO)
        batch = torch.zeros(2, TINY.block_size, dtype=torch.long, device=GPU)

        def closure() -> MicroBatchResult:
            _, loss = model(batch, batch)
            assert loss is not None
            loss.backward()
            return MicroBatchResult(loss=1.0, samples=2, tokens=batch.numel())

        strategy.step(closure)
        assert isinstance(strategy.runner, CommThread) and strategy.runner.device == GPU
        strategy.finish()


def test_connect_without_a_launcher_is_one_worker_on_the_cpu() -> None:
    import lowcomm

    comm = lowcomm.connect(device="cpu", timeout_s=30.0)
    assert comm.world_size == 1 and comm.device == torch.device("cpu")


# --- the CUDA random state is checkpointed ---------------------------------------------


def test_the_cuda_random_state_is_saved_and_restored() -> None:
    """Dropout on a GPU draws from the worker's device generator; an exact resume
    needs it (a second CPU generator stands in for the CUDA one: same get/set_state)."""
    worker_generator = torch.Generator().manual_seed(3)
    device_generator = torch.Generator().manual_seed(7)
    state = loop._rng_state(worker_generator, device_generator)
    assert torch.equal(state["cuda"], device_generator.get_state())
    expected = torch.rand(4, generator=worker_generator)
    expected_device = torch.rand(4, generator=device_generator)
    loop._restore_rng(state, worker_generator, device_generator)
    assert torch.equal(torch.rand(4, generator=worker_generator), expected)  # the CPU one too
    assert torch.equal(torch.rand(4, generator=device_generator), expected_device)
    cpu_state = loop._rng_state(worker_generator, worker_generator)  # on a CPU: one generator
    assert "cuda" not in cpu_state
    before = device_generator.get_state()
    loop._restore_rng(cpu_state, worker_generator, device_generator)  # a CPU checkpoint on a GPU
    assert torch.equal(device_generator.get_state(), before)


# --- peak device memory in summary.json ------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_summary_reports_peak_device_memory_on_cuda(tmp_path: Path, device: str) -> None:
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.train.metrics import RunWriter

    config = TrainConfig(
        placement=PlacementConfig(device=device),
        comm=CommConfig(clock="real"),
        run=RunConfig(progress=False, plot=False, out=str(tmp_path / "run")),
    )  # type: ignore[arg-type]
    writer = RunWriter(config)
    writer.close_steps()
    from lowcomm.train.records import ProcessTotals

    columns = [1.0, 0.0, 1.0, 0.0, 1000.0, 64.0, 0.0, 0.0, 0.0, 0.0]
    summary = writer.finish(
        per_process=[
            ProcessTotals(*columns, peak_memory=5e9),
            ProcessTotals(*columns, peak_memory=6e9),
        ],
        bytes_by_role={},
        num_params=10,
        final_val_loss=1.0,
        wall_clock_s=1.0,
        clock_kind="real",
        network=NetworkProfile.from_preset("none"),
    )
    if device == "cuda":
        assert summary["peak_device_memory_bytes_per_worker"] == 6_000_000_000
        assert summary["per_worker"]["peak_device_memory_bytes"] == [5_000_000_000, 6_000_000_000]
    else:
        assert "peak_device_memory_bytes_per_worker" not in summary


class _FakeTime:
    """A host clock that moves only when slept on (``time.perf_counter`` and ``time.sleep``
    for :mod:`lowcomm.comm.cuda_arrival`): the fake GPU below reads it too, so a conversion
    between the two clocks is exact whatever else the machine is doing."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class _FakeCuda:
    """A stand-in for ``torch.cuda``'s streams and timing events: the GPU's clock is the
    host's (a :class:`_FakeTime`) plus an offset; a stream made to wait for a work is ready
    when the work's data arrives; an event records when its stream is ready."""

    OFFSET = 5000.0  # GPU time - host time

    def __init__(self, clock: _FakeTime) -> None:
        self.clock = clock
        self.current: Any = "default"
        self.streams: list[Any] = []

    def gpu_now(self) -> float:
        return self.clock.perf_counter() + self.OFFSET

    def Stream(self, device: torch.device) -> Any:
        stream = _FakeStream(device)
        self.streams.append(stream)
        return stream

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def Event(self, enable_timing: bool = False) -> Any:
        assert enable_timing, "elapsed_time needs timing events"
        return _FakeEvent(self)


@dataclasses.dataclass
class _FakeStream:
    device: torch.device
    ready_at: float = 0.0  # GPU time


class _FakeEvent:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda
        self.at: float | None = None

    def record(self, stream: _FakeStream) -> None:
        self.at = max(stream.ready_at, self.cuda.gpu_now())

    def synchronize(self) -> None:
        assert self.at is not None
        self.cuda.clock.sleep(self.at - self.cuda.gpu_now())

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0


class _FakeNcclWork:
    """An NCCL work whose data arrives ``delay`` after the launch: its completion future is
    complete at once, and the future's wait() makes the current stream wait for the data,
    without blocking the host. The work's own wait() (which on NCCL also releases the
    collective's tensors to the allocator) is recorded apart."""

    def __init__(self, cuda: _FakeCuda, delay: float) -> None:
        self.cuda = cuda
        self.arrives = cuda.gpu_now() + delay
        self.waited_on: list[Any] = []
        self.work_waits = 0

    def get_future(self) -> _FakeNcclFuture:
        return _FakeNcclFuture(self)

    def wait(self) -> bool:
        self.work_waits += 1
        return True


class _FakeNcclFuture:
    def __init__(self, work: _FakeNcclWork) -> None:
        self.work = work

    def wait(self) -> None:
        stream = self.work.cuda.current
        self.work.waited_on.append(stream)
        if isinstance(stream, _FakeStream):
            stream.ready_at = max(stream.ready_at, self.work.arrives)


def test_an_nccl_collectives_arrival_is_timed_on_a_side_stream_without_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL's completion future fires at the launch; the arrival comes from a timing event
    on a side stream that waits for the work: the launch does not block the host or touch
    the compute stream, and the arrival converts back to the host's clock."""
    import lowcomm.comm.cuda_arrival as cuda_arrival
    from lowcomm.comm.cuda_arrival import EventArrival
    from lowcomm.comm.torch_comm import _WorkHandle

    clock = _FakeTime()
    monkeypatch.setattr(cuda_arrival, "time", clock)
    cuda = _FakeCuda(clock)
    device = torch.device("cuda", 0)
    work = _FakeNcclWork(cuda, delay=0.15)
    begin = clock.perf_counter()
    arrival = EventArrival(work, device, cuda=cuda)
    assert clock.perf_counter() == begin  # the launch did not wait for the data
    assert work.waited_on == [cuda.streams[0]]  # the side stream waits, not "default"
    assert work.work_waits == 0  # not work.wait(): the collective's tensors stay held
    assert cuda.current == "default"
    handle = _WorkHandle(None, arrival=arrival)
    arrived = handle.completed_at()  # asked early: waits for the data
    assert arrived == pytest.approx(work.arrives - cuda.OFFSET, abs=1e-9)
    assert clock.perf_counter() == pytest.approx(begin + 0.15, abs=1e-9)  # it waited for it
    assert handle.completed_at() == arrived  # read once
    # A second collective of the same device uses the same side stream; one arrived long
    # before it is asked for still reads as its arrival, not as the time it was asked.
    early = _FakeNcclWork(cuda, delay=0.0)
    second = EventArrival(early, device, cuda=cuda)
    clock.sleep(0.1)
    assert second.completed_at() == pytest.approx(early.arrives - cuda.OFFSET, abs=1e-9)
    assert len(cuda.streams) == 2  # one side and one reference stream per device


def test_nccl_blocking_wait_turns_the_arrival_events_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowcomm.comm.cuda_arrival import blocking_wait

    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    assert not blocking_wait()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert blocking_wait()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "true")
    assert blocking_wait()


# --- a handle keeps its tensors; no work.wait() at the launch --------------------------


class _RecordedWork:
    """A work that records whether it was waited for (and how)."""

    def __init__(self) -> None:
        self.waits: list[object] = []

    def wait(self, timeout: object = None) -> bool:
        self.waits.append(timeout)
        return True

    def is_completed(self) -> bool:
        return bool(self.waits)

    def get_future(self) -> Any:
        raise RuntimeError("Work::getFuture not implemented")


def test_a_handle_keeps_its_tensors_referenced_until_wait() -> None:
    """On NCCL without recorded streams the process group drops its references to a
    collective's tensors at work.wait(); a send buffer only the collective uses (a cast copy,
    a hierarchical send buffer) must stay referenced by the handle until the method waits,
    and be released then."""
    import gc
    import weakref

    from lowcomm.comm.torch_comm import _WorkHandle

    work = _RecordedWork()
    send = torch.ones(8)
    alive = weakref.ref(send)
    handle = _WorkHandle(work, keep=(send,))
    del send
    gc.collect()
    assert alive() is not None and work.waits == []  # nothing waited at the launch
    handle.wait()
    gc.collect()
    assert alive() is None and len(work.waits) == 1


def test_torch_comm_hands_every_collectives_tensors_to_its_handle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each collective's handle holds the tensors the collective reads and writes
    (the input of a reduce-scatter or all-gather included), and an NCCL group waits without
    a deadline (a deadline makes the host poll the work)."""
    import torch.distributed as dist

    from lowcomm.comm import torch_comm

    issued: list[_RecordedWork] = []

    def fake(*args: Any, **kwargs: Any) -> _RecordedWork:
        issued.append(_RecordedWork())
        return issued[-1]

    monkeypatch.setattr(dist, "all_reduce", fake)
    monkeypatch.setattr(torch_comm, "_reduce_scatter", fake)
    monkeypatch.setattr(torch_comm, "_all_gather", fake)
    comm = object.__new__(TorchComm)
    comm.__dict__.update(
        _group=None,
        _rank=0,
        _world_size=2,
        _timeout_s=30.0,
        _stamp=False,
        _scatter_by_exchange=False,
        _event_arrival=False,
        _wait_timeout_s=None,
        _device=None,  # (host tensors stand in for the GPU's)
    )  # fmt: skip (an NCCL group's settings, without NCCL)
    full, shard = torch.zeros(8), torch.zeros(4)
    handles = [
        comm.all_reduce(full, role=Role.GRADIENT),
        comm.reduce_scatter(shard, full, role=Role.GRADIENT),
        comm.all_gather(full, shard, role=Role.PARAMETER),
    ]
    kept = [{id(t) for t in handle._keep} for handle in handles]  # type: ignore[attr-defined]
    assert kept == [{id(full)}, {id(full), id(shard)}, {id(full), id(shard)}]
    assert all(work.waits == [] for work in issued)
    for handle in handles:
        handle.wait()
    assert [work.waits for work in issued] == [[None]] * 3
    assert all(handle._keep == () for handle in handles)  # type: ignore[attr-defined]
