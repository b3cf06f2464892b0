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
