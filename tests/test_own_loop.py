"""The own-loop path is right for every method: the example draws a fresh
batch on every closure call, make_strategy takes only the method family's options class and
exposes schedule, epsilon and clipping, and the public names are importable from lowcomm."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lowcomm
from lowcomm.optim.schedule import learning_rate


def _load_example(repo_root: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "own_loop_example", repo_root / "examples" / "own_loop.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method", ["acco", "dpu", "wp", "ddp"])
def test_own_loop_example_sees_a_distinct_batch_on_every_closure_call(
    repo_root: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """ACCO, DPU and WP call the closure several times per step; each call must get a new
    micro-batch (the model's forward sees every input once)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen: list[bytes] = []
    make_strategy = lowcomm.make_strategy

    def recording(
        method: str, model: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> lowcomm.Strategy:
        model.register_forward_pre_hook(
            lambda _module, inputs: seen.append(inputs[0].numpy().tobytes())
        )
        return make_strategy(method, model, *args, **kwargs)

    monkeypatch.setattr(lowcomm, "make_strategy", recording)
    monkeypatch.setattr(sys, "argv", ["own_loop.py", "--method", method, "--steps", "6"])
    _load_example(repo_root).main()
    assert len(seen) >= 6
    if method != "ddp":
        assert len(seen) > 6, "the method should take several micro-batches per step"
    repeated = len(seen) - len(set(seen))
    assert repeated == 0, f"{repeated} of {len(seen)} closure calls reused a batch"


def test_make_strategy_takes_only_its_familys_options_class() -> None:
    model = torch.nn.Linear(3, 1)
    strategy = lowcomm.make_strategy(
        "co2", model, lowcomm.connect(), options=lowcomm.LocalOptions(sync_every=3)
    )
    assert strategy.options.sync_every == 3  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as caught:
        lowcomm.make_strategy(
            "co2", torch.nn.Linear(3, 1), lowcomm.connect(), options=lowcomm.DiLoCoOptions()
        )
    message = str(caught.value)
    assert "DiLoCoOptions" in message and "LocalOptions" in message and "co2" in message
    with pytest.raises(ValueError, match="AccoOptions"):
        lowcomm.make_strategy("wp", torch.nn.Linear(3, 1), lowcomm.connect(), options={"x": 1})
    with pytest.raises(ValueError, match="takes no options"):
        lowcomm.make_strategy(
            "zero1", torch.nn.Linear(3, 1), lowcomm.connect(), options=lowcomm.AccoOptions()
        )


def test_make_strategy_exposes_schedule_epsilon_and_clipping() -> None:
    strategy = lowcomm.make_strategy(
        "ddp", torch.nn.Linear(3, 1), lowcomm.connect(), lr=0.01, schedule="constant",
        warmup_steps=0, eps=1e-6, max_grad_norm=None, total_steps=50,
    )  # fmt: skip
    context = strategy.context
    assert isinstance(context, lowcomm.StrategyContext)
    assert context.schedule.kind == "constant" and context.schedule.warmup_steps == 0
    assert [learning_rate(context.schedule, 0.01, step, 50) for step in (0, 25, 49)] == [0.01] * 3
    assert context.optim.eps == 1e-6 and context.max_grad_norm is None
    cosine = lowcomm.make_strategy("ddp", torch.nn.Linear(3, 1), lowcomm.connect(), schedule="cosine",
                                   warmup_steps=5, min_lr_ratio=0.2)  # fmt: skip
    assert cosine.context.schedule == lowcomm.ScheduleConfig(
        kind="cosine", warmup_steps=5, min_lr_ratio=0.2
    )
    with pytest.raises(ValueError, match="schedule"):
        lowcomm.make_strategy("ddp", torch.nn.Linear(3, 1), lowcomm.connect(), schedule="linear")  # type: ignore[arg-type]


def test_public_names_are_importable_from_lowcomm() -> None:
    from lowcomm import (  # noqa: F401
        AccoOptions,
        AdamWConfig,
        DeslocOptions,
        DiLoCoOptions,
        LocalOptions,
        ScheduleConfig,
        StrategyContext,
    )

    assert {
        "AccoOptions",
        "LocalOptions",
        "DiLoCoOptions",
        "DeslocOptions",
        "StrategyContext",
    } <= set(lowcomm.__all__)
