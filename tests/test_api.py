"""The own-loop API: connect() without a launcher, make_strategy with family options."""

from __future__ import annotations

import pytest
import torch

import lowcomm
from lowcomm.strategies.diloco import DiLoCoOptions


def test_connect_without_a_launcher_is_a_single_worker() -> None:
    comm = lowcomm.connect(network="wan")
    assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.profile.name == "wan"


def test_make_strategy_passes_family_options() -> None:
    model = torch.nn.Linear(3, 1)
    strategy = lowcomm.make_strategy(
        "diloco", model, lowcomm.connect(), options=DiLoCoOptions(sync_every=4)
    )
    assert strategy.options.sync_every == 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="takes no options"):
        lowcomm.make_strategy(
            "ddp", torch.nn.Linear(3, 1), lowcomm.connect(), options=DiLoCoOptions()
        )
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        lowcomm.make_strategy("nope", torch.nn.Linear(3, 1), lowcomm.connect())


def test_connect_takes_the_groups_gpu_or_local_rank_not_cuda_0_on_every_rank() -> None:
    """On a group the caller made without set_device, every rank's current device is 0:
    connect() takes the group's bound device, else LOCAL_RANK's GPU (0 where the launcher gave
    the process a GPU of its own), else the device the caller set."""
    from lowcomm.api import connect_gpu

    env = {"LOCAL_RANK": "3"}
    assert connect_gpu(None, 0, env) == 3
    assert connect_gpu(torch.device("cuda", 5), 0, env) == 5
    assert connect_gpu(None, 2, env) == 2  # the caller's set_device
    assert connect_gpu(None, 0, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "6"}) == 0
    assert connect_gpu(None, 0, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 3
    assert connect_gpu(None, 0, {}) == 0  # one process, no launcher
