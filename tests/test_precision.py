"""--precision bf16-mixed and --comm-dtype bf16: what each casts, what refuses them, and
checkpoints across the settings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import SMALL, lowcomm
from lowcomm.comm.base import CollectiveKind, Role
from lowcomm.comm.clock import make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.fake import RecordingComm
from lowcomm.comm.network import NetworkProfile
from lowcomm.config import CommConfig, ConfigError, PlacementConfig, TrainConfig, with_options
from lowcomm.models import ModelConfig, build_model
from lowcomm.strategies import MicroBatchResult, build_strategy
from lowcomm.train.context import strategy_context


def _network(wire: torch.dtype) -> tuple[NetworkComm, RecordingComm]:
    recording = RecordingComm(rank=0, world_size=2)
    clock = make_clock("virtual", seconds_per_microbatch=0.01)
    comm = NetworkComm(recording, NetworkProfile.from_preset("wan"), clock, wire_dtype=wire)
    return comm, recording


def _ddp_step(wire: torch.dtype) -> tuple[NetworkComm, RecordingComm, int]:
    """One ddp step of a small GPT on a recording communicator; the gradient's elements."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16), 300)
    comm, recording = _network(wire)
    config = TrainConfig(placement=PlacementConfig(workers=2))
    context = replace(strategy_context(config), runtime=comm.runtime())
    strategy = build_strategy("ddp", model, comm, context, config)
    tokens = torch.randint(0, 300, (2, 17))

    def closure() -> MicroBatchResult:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        assert loss is not None
        loss.backward()
        comm.clock.microbatch_done()
        return MicroBatchResult(loss=float(loss.detach()), samples=2, tokens=32)

    strategy.step(closure)
    return comm, recording, sum(p.numel() for p in model.parameters())


def test_bf16_gradients_travel_as_bf16_and_halve_the_bytes() -> None:
    sent: dict[torch.dtype, NetworkComm] = {}
    for wire in (torch.float32, torch.bfloat16):
        comm, recording, numel = _ddp_step(wire)
        gradients = [call for call in recording.calls if call.role == Role.GRADIENT]
        assert [call.kind for call in gradients] == [CollectiveKind.ALL_REDUCE]
        assert gradients[0].dtype == wire  # the tensor handed to the wire
        assert gradients[0].numel == numel
        assert gradients[0].payload_bytes == numel * (4 if wire == torch.float32 else 2)
        sent[wire] = comm
    fp32, bf16 = sent[torch.float32], sent[torch.bfloat16]
    assert bf16.bytes_by_role[Role.GRADIENT] * 2 == fp32.bytes_by_role[Role.GRADIENT]
    assert bf16.modeled_comm_s < fp32.modeled_comm_s


def test_a_cast_collective_writes_the_bf16_result_into_the_fp32_tensor() -> None:
    comm, recording = _network(torch.bfloat16)
    values = torch.linspace(-1.0, 1.0, 1001) * (1 + 2**-12)  # not all representable in bf16
    tensor = values.clone()
    comm.all_reduce(tensor, op="mean", role=Role.PSEUDO_GRADIENT).wait()
    assert tensor.dtype == torch.float32
    assert torch.equal(tensor, values.to(torch.bfloat16).float())
    assert not torch.equal(tensor, values)
    parameters = values.clone()  # other roles travel as they are
    comm.all_reduce(parameters, op="mean", role=Role.PARAMETER).wait()
    assert torch.equal(parameters, values)
    assert [call.dtype for call in recording.calls if call.role is not Role.OTHER] == [
        torch.bfloat16,
        torch.float32,
    ]


@pytest.mark.parametrize("method", ["acco", "dpu", "wp"])
def test_comm_dtype_bf16_with_the_acco_family_is_refused(method: str) -> None:
    """DPU and WP run ACCO's communication thread, which does not cast."""
    with pytest.raises(ConfigError, match=f"--comm-dtype: bf16 with --method {method}: its"):
        TrainConfig(
            method=method,
            comm=CommConfig(comm_dtype="bf16"),
        ).validate()


def _summary(out: Path, *flags: str) -> dict[str, Any]:
    done = lowcomm(
        "train", *SMALL, "--steps", "20", "--optim.lr", "3e-3", "--eval-every", "100",
        # A declared compute cost: the modeled times differ by the communication alone (a
        # calibration per run moved them by more than bf16's saving on a loaded machine).
        "--seconds-per-microbatch", "0.01", "--out", str(out), *flags,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


#: bf16-mixed against fp32 after 20 steps of the small GPT: final validation loss within this
#: many nats (seen: about 1e-4; the loss falls by about 1.2 over these steps).
BF16_TOLERANCE = 0.02


@pytest.mark.slow
def test_bf16_mixed_trains_like_fp32_and_bf16_comm_halves_gradient_bytes(
    tmp_path: Path,
) -> None:
    fp32 = _summary(tmp_path / "fp32")
    mixed = _summary(tmp_path / "mixed", "--precision", "bf16-mixed")
    wire = _summary(tmp_path / "wire", "--comm-dtype", "bf16")
    fp32_loss, mixed_loss = float(fp32["final_val_loss"]), float(mixed["final_val_loss"])
    assert abs(mixed_loss - fp32_loss) < BF16_TOLERANCE
    assert mixed_loss != fp32_loss  # the autocast region really ran in bf16
    assert mixed["state_bytes_per_worker"] == fp32["state_bytes_per_worker"]  # fp32 masters
    gradient = {
        name: s["bytes_by_role"]["gradient"] for name, s in (("fp32", fp32), ("wire", wire))
    }
    assert gradient["wire"] * 2 == gradient["fp32"]
    assert float(wire["modeled_time_s"]) < float(fp32["modeled_time_s"])
    assert wire["state_bytes_per_worker"] == fp32["state_bytes_per_worker"]


def test_plan_takes_the_same_options_with_the_same_defaults() -> None:
    from lowcomm.plan import PlanConfig, make_plan

    assert (PlanConfig().precision, PlanConfig().comm_dtype) == (
        TrainConfig().numerics.precision,
        TrainConfig().comm.comm_dtype,
    )
    fp32 = make_plan(PlanConfig(method="ddp"))
    bf16 = make_plan(PlanConfig(method="ddp", comm_dtype="bf16"))
    assert bf16.comm_bytes_per_worker * 2 == pytest.approx(fp32.comm_bytes_per_worker)
    assert bf16.comm_total_s < fp32.comm_total_s


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [({}, {"precision": "bf16-mixed"}), ({"comm_dtype": "bf16"}, {}), ({}, {"comm_dtype": "bf16"})],
)
def test_a_resume_with_another_precision_or_comm_dtype_is_refused(
    tmp_path: Path, saved: dict[str, str], resumed: dict[str, str]
) -> None:
    """An exact resume needs the precision and wire dtype the checkpoint was written with, in
    either direction, and a checkpoint written before these settings existed reads as fp32."""
    from lowcomm.train.checkpoint import (
        CheckpointError,
        commit_checkpoint,
        find_resumable,
        fingerprint,
        write_rank_state,
    )

    base = TrainConfig(
        method="ddp",
        placement=PlacementConfig(workers=1),
    )
    written = fingerprint(with_options(base, **saved))
    if not saved:  # as written before the two keys existed
        del written["precision"], written["comm_dtype"]
    write_rank_state(tmp_path, 2, 0, {"step": 2})
    commit_checkpoint(tmp_path, 2, 1, written)
    assert find_resumable(tmp_path, 1, fingerprint(with_options(base, **saved))) is not None
    key = next(iter(resumed or saved))
    with pytest.raises(CheckpointError, match=f"written with {key}="):
        find_resumable(tmp_path, 1, fingerprint(with_options(base, **resumed)))
