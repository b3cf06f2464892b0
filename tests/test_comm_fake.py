"""The recording fake and the single-worker communicator behave like a real group would."""

from __future__ import annotations

import pytest
import torch

from lowcomm.comm import CollectiveKind, LocalComm, RecordingComm, Role


def test_recording_comm_identical_replica_semantics() -> None:
    comm = RecordingComm(rank=1, world_size=3)
    x = torch.arange(6.0)
    comm.all_reduce(x, op="mean", role=Role.GRADIENT).wait()
    assert torch.equal(x, torch.arange(6.0))
    comm.all_reduce(x, op="sum", role=Role.GRADIENT).wait()
    assert torch.equal(x, 3 * torch.arange(6.0))
    shard = torch.empty(2)
    comm.reduce_scatter(shard, torch.arange(6.0), op="sum", role=Role.GRADIENT).wait()
    assert torch.equal(shard, 3 * torch.tensor([2.0, 3.0]))
    full = torch.empty(6)
    comm.all_gather(full, torch.tensor([7.0, 8.0]), role=Role.PARAMETER).wait()
    assert torch.equal(full, torch.tensor([7.0, 8.0] * 3))
    assert comm.count(CollectiveKind.ALL_REDUCE) == 2
    assert comm.count(CollectiveKind.ALL_GATHER, Role.PARAMETER) == 1
    assert comm.calls[2].payload_bytes == 6 * 4


def test_shape_mismatch_is_a_clear_error() -> None:
    comm = RecordingComm(world_size=4)
    with pytest.raises(ValueError, match="pad the flat tensor"):
        comm.reduce_scatter(torch.empty(2), torch.empty(7), role=Role.GRADIENT)


def test_local_comm_is_the_identity() -> None:
    comm = LocalComm()
    x = torch.randn(5)
    y = x.clone()
    handle = comm.all_reduce(x, role=Role.GRADIENT)
    assert handle.done()
    handle.wait()
    assert torch.equal(x, y)
    out = torch.empty(5)
    comm.all_gather(out, x, role=Role.PARAMETER).wait()
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match="group of one"):
        comm.broadcast(x, src=1, role=Role.PARAMETER)
