"""The local-update core: each method's defaults, its inner optimizer and the shared rules."""

from __future__ import annotations

from typing import Any

import pytest

from _dist import tiny_gpt
from lowcomm.comm import LocalComm
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.optim.sgd import FlatSGD
from lowcomm.strategies import StrategyContext, options_class, strategy_class
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.local_update import LocalUpdate, RoundOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
)

#: Every method on the core: its period, inner optimizer and (outer lr, outer momentum,
#: Nesterov) when built with its default options. None: the method has no outer step.
DEFAULTS: dict[str, tuple[int, str, tuple[float, float, bool] | None]] = {
    "local_sgd": (6, "sgd", None),
    "local_adamw": (6, "adamw", None),
    "overlap_local_sgd": (6, "adamw", None),
    "slowmo": (6, "adamw", (1.0, 0.5, False)),
    "co2": (6, "adamw", (1.0, 0.5, False)),
    # DiLoCo's scaled defaults at H = 16: eta_out = 1 - 0.3 t, mu = 0.9 t^2, t = 1/2.
    "diloco": (16, "adamw", (0.85, 0.225, True)),
    "streaming_diloco": (16, "adamw", (0.85, 0.225, True)),
    "diloco_delayed": (16, "adamw", (0.85, 0.225, True)),
    "eager": (16, "adamw", (0.85, 0.225, True)),
    "cocodc": (16, "adamw", (0.85, 0.225, True)),
    "decoupled_diloco": (16, "adamw", (0.85, 0.225, True)),
    "sparseloco": (15, "adamw", (1.0, 0.0, True)),
    "sparta": (100, "adamw", None),
    "sparta_diloco": (100, "adamw", (0.7, 0.9, True)),
}


def _outer(strategy: Any) -> tuple[float, float, bool]:
    if hasattr(strategy, "outer"):  # the DiLoCo family's per-fragment outer optimizers
        outer = strategy.outer[0]
        return outer.lr, outer.momentum, outer.nesterov
    options = strategy.options
    return options.outer_lr, options.outer_momentum, options.outer_nesterov


@pytest.mark.parametrize("method", sorted(DEFAULTS))
def test_each_method_builds_with_its_own_defaults(method: str) -> None:
    cls = strategy_class(method)
    assert issubclass(cls, LocalUpdate)
    kind = options_class(cls)
    assert kind is not None and issubclass(kind, RoundOptions)
    strategy: Any = cls(tiny_gpt(), LocalComm(), CONTEXT, kind())  # type: ignore[call-arg]
    period, inner, outer = DEFAULTS[method]
    assert strategy.options.sync_every == period
    assert strategy.inner_kind == inner
    assert isinstance(strategy.inner, FlatSGD) == (inner == "sgd")
    if outer is not None:
        assert _outer(strategy) == pytest.approx(outer)


def test_diloco_outer_defaults_scale_with_h_and_the_paper_keeps_them() -> None:
    scaled = {h: DiLoCoOptions(sync_every=h).outer() for h in (1, 16, 256, 1024)}
    assert scaled[1] == (1.0, 0.0)
    assert scaled[16] == pytest.approx((0.85, 0.225))
    assert scaled[256] == pytest.approx((0.7, 0.9))
    assert scaled[1024] == pytest.approx((0.7, 0.9))
    paper = DiLoCoOptions(sync_every=16, outer_defaults="paper").outer()
    assert paper == (0.7, 0.9)
    # A given value wins over either default.
    assert DiLoCoOptions(outer_lr=0.5, outer_momentum=0.0).outer() == (0.5, 0.0)


def test_the_option_classes_set_their_own_defaults() -> None:
    local, diloco, sparta, sparse = (
        LocalOptions(),
        DiLoCoOptions(),
        SpartaOptions(),
        SparseLoCoOptions(),
    )
    assert (local.sync_every, local.outer_lr, local.outer_momentum) == (6, 1.0, 0.5)
    assert (local.pull, local.clip_threshold, local.gap_penalty) == (0.5, 1.0, True)
    assert (diloco.sync_every, diloco.outer_lr, diloco.outer_momentum) == (16, None, None)
    assert (diloco.fragments, diloco.overlap_steps, diloco.mixing) == (None, 1, 0.5)
    assert (sparta.sync_every, sparta.outer_lr, sparta.outer_momentum) == (100, 0.7, 0.9)
    assert sparta.fraction == 0.005
    assert (sparse.sync_every, sparse.outer_lr, sparse.outer_momentum) == (15, 1.0, 0.0)
    assert (sparse.chunk, sparse.topk, sparse.error_decay, sparse.quantization_bits) == (
        4096, 64, 0.95, 2,
    )  # fmt: skip
    for options in (local, diloco, sparta, sparse):
        assert (options.inner_optimizer, options.sgd_momentum) == ("adamw", 0.0)


@pytest.mark.parametrize(
    ("kind", "field", "value", "flag"),
    [
        (LocalOptions, "sync_every", 0, "--local.sync-every"),
        (DiLoCoOptions, "sync_every", True, "--diloco.sync-every"),
        (SpartaOptions, "inner_optimizer", "lion", "--sparta.inner-optimizer"),
        (SparseLoCoOptions, "sgd_momentum", 1.0, "--sparseloco.sgd-momentum"),
        (SparseLoCoOptions, "outer_momentum", 1.0, "--sparseloco.outer-momentum"),
        (SpartaOptions, "outer_lr", float("nan"), "--sparta.outer-lr"),
        # slowmo and co2 need a moving anchor: an outer lr of 0 is refused there only.
        (LocalOptions, "outer_lr", 0.0, "--local.outer-lr"),
    ],
)
def test_the_shared_rules_name_the_family_flag(
    kind: type[RoundOptions], field: str, value: Any, flag: str
) -> None:
    with pytest.raises(ValueError, match=f"^{flag}: "):
        kind(**dict.fromkeys([field], value))


def test_an_outer_lr_of_zero_is_allowed_outside_the_local_family() -> None:
    for kind in (DiLoCoOptions, SpartaOptions, SparseLoCoOptions):
        assert kind(outer_lr=0.0).outer_lr == 0.0


@pytest.mark.parametrize("method", ["slowmo", "co2"])
def test_heavy_ball_methods_refuse_nesterov(method: str) -> None:
    with pytest.raises(ValueError, match=r"^--local\.outer-nesterov: True with --method"):
        strategy_class(method)(  # type: ignore[call-arg]
            tiny_gpt(), LocalComm(), CONTEXT, LocalOptions(outer_nesterov=True)
        )


def test_sgd_momentum_reaches_the_one_inner_sgd_of_every_family() -> None:
    for method, kind in (
        ("overlap_local_sgd", LocalOptions),
        ("diloco", DiLoCoOptions),
        ("sparta", SpartaOptions),
        ("sparseloco", SparseLoCoOptions),
    ):
        options = kind(inner_optimizer="sgd", sgd_momentum=0.9)
        strategy: Any = strategy_class(method)(  # type: ignore[call-arg]
            tiny_gpt(), LocalComm(), CONTEXT, options
        )
        assert isinstance(strategy.inner, FlatSGD) and strategy.inner.momentum == 0.9


def test_a_checkpoint_written_before_an_option_existed_resumes_at_its_default() -> None:
    from lowcomm.config import TrainConfig
    from lowcomm.train.checkpoint import _options_added_later, fingerprint

    for method, group, added, other in (
        ("diloco", "diloco", "sgd_momentum", 0.5),
        ("co2", "local", "outer_nesterov", True),
        ("sparseloco", "sparseloco", "outer_momentum", 0.5),
    ):
        now = fingerprint(TrainConfig(method=method))
        before = {**now, "options": {k: v for k, v in now["options"].items() if k != added}}
        assert _options_added_later(before, method) == now
        # Set away from its default, the new option still has to match what was saved.
        kind = type(getattr(TrainConfig(), group))
        changed = TrainConfig(method=method, **{group: kind(**{added: other})})
        assert _options_added_later(before, method) != fingerprint(changed)
