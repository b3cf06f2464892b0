"""The CUDA/NCCL path, checked on a machine without a GPU (issue 19).

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

What this cannot check (kernels, streams, NCCL itself, timings) is listed in the README as
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
from lowcomm.config import TrainConfig
from lowcomm.data import DataConfig
from lowcomm.launch import spawn_workers
from lowcomm.models import ModelConfig
from lowcomm.models.gpt import GPT
from lowcomm.optim.quantize import decode, encode
from lowcomm.strategies import STRATEGIES, MicroBatchResult, StrategyContext, build_strategy
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

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        self._check("broadcast", tensor)
        return super().broadcast(tensor, src=src, role=role)


# --- item 1: evaluation on a worker without validation batches ---------------------------


def _tiny_gpt_on_gpu() -> GPT:
    with GPU:
        return GPT(TINY)


def test_evaluation_sum_is_on_one_device_whether_or_not_the_worker_has_batches() -> None:
    """Item 1: with more workers than validation batches a worker has none, and every worker
    must still hand the evaluation group a tensor it carries. That group is the Gloo
    bookkeeping group, so the sum is a CPU tensor on every worker. (Before the fix it was a
    CPU tensor on a worker without batches and a GPU tensor elsewhere, all on the NCCL group,
    which rejects CPU tensors: the final evaluation of any run with more than 8 workers
    crashed.)"""
    bookkeeping = DeviceCheckingComm(torch.device("cpu"))
    with stand_in_gpu():
        model = _tiny_gpt_on_gpu()
        batch = torch.zeros(2, TINY.block_size, dtype=torch.long, device=GPU)
        loop._evaluate(model, [], bookkeeping)  # a worker without a validation batch
        loop._evaluate(model, [(batch, batch)], bookkeeping)  # a worker with one
    assert bookkeeping.devices == [torch.device("cpu")] * 2


# --- item 2: quantized outer gradients stay on the parameters' device -------------------


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
    """Item 2: every tensor of a (quantized) outer-gradient exchange is on the GPU."""
    comm = _run_on_stand_in(method, quantization=fmt)
    kind = CollectiveKind.ALL_REDUCE if fmt == "none" else CollectiveKind.ALL_GATHER
    assert comm.count(kind, Role.PSEUDO_GRADIENT) > 0
    assert set(comm.devices) == {GPU}


# --- every strategy's communication and update paths on the stand-in device -------------


def _options(quantization: str) -> TrainConfig:
    config = TrainConfig()
    return dataclasses.replace(
        config,
        diloco=dataclasses.replace(
            config.diloco, sync_every=2, quantization=quantization, quantization_row_size=64  # type: ignore[arg-type]
        ),
        local=dataclasses.replace(config.local, sync_every=2),
        desloc=dataclasses.replace(config.desloc, param_period=2),
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
    assert comm.devices, f"{method} made no collective"
    assert set(comm.devices) == {GPU}


# --- item 3: bookkeeping never travels on the strategy's group --------------------------


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
    """Item 3: on NCCL one group is one stream, so a metrics gather on the strategy's group
    waits behind its in-flight all-reduce. Two Gloo workers train co2 (an all-reduce in
    flight across steps) with per-step metrics, evaluation and checkpoints; the strategy's
    group must see only the method's own traffic and the initial parameter broadcast. (The
    real clock: on the virtual clock each collective's launch-time agreement rides the
    strategy's group on purpose, ordered with its payload.)"""
    config = TrainConfig(
        method="co2",
        workers=2,
        steps=4,
        clock="real",
        eval_every=2,
        eval_batches=1,  # one worker has no validation batch (item 1's situation)
        checkpoint_every=2,
        progress=False,
        out=str(tmp_path / "run"),
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
    )
    calls = spawn_workers(_record_strategy_group, 2, (config,), timeout_s=120.0)
    for rank_calls in calls:
        assert ("barrier", "-") not in rank_calls
        others = [call for call in rank_calls if call[1] == Role.OTHER.value]
        assert others == [], f"bookkeeping on the strategy's group: {others}"
        strategy_traffic = [call for call in rank_calls if call[1] != Role.PARAMETER.value]
        assert strategy_traffic, "the strategy made no collective"
