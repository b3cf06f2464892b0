"""`--methods` variants of a study: METHOD+TAG:KEY=VALUE parsing and the runs they declare."""

from __future__ import annotations

import pytest

from lowcomm.bench.compare import CompareBench
from lowcomm.bench.variants import Variant, convert, parse_methods, split_entries
from lowcomm.strategies import STRATEGIES


def test_entries_split_at_commas_and_keep_a_variants_options_together() -> None:
    assert split_entries(["ddp,zero1", "diloco+h4:diloco.sync-every=4,optim.lr=0.01", "eager"]) == [
        "ddp",
        "zero1",
        "diloco+h4:diloco.sync-every=4,optim.lr=0.01",
        "eager",
    ]


def test_one_method_twice_with_different_options_gets_its_own_label_and_run() -> None:
    bench = CompareBench(
        methods=(
            "diloco",
            "diloco+h4:diloco.sync-every=4,diloco.outer-lr=0.5",
            "streaming_diloco+int4:diloco.quantization=int4",
        )
    )
    assert bench.method_names() == ["diloco", "diloco+h4", "streaming_diloco+int4"]
    plain, h4, int4 = (bench.run_config(v, 1) for v in bench.variants())
    assert (plain.method, h4.method, int4.method) == ("diloco", "diloco", "streaming_diloco")
    assert (plain.diloco.sync_every, h4.diloco.sync_every) == (16, 4)
    assert (plain.diloco.outer_lr, h4.diloco.outer_lr) == (None, 0.5)
    assert int4.diloco.quantization == "int4" and plain.diloco.quantization == "none"
    assert str(h4.run.out).endswith("runs/diloco+h4-s1") and h4.run.seed == 1
    # Everything else is the study's: the same budget, steps and network.
    assert (
        h4.run.token_budget == plain.run.token_budget
        and h4.comm.network == plain.comm.network == "wan"
    )


def test_values_are_read_as_the_options_type() -> None:
    (variant,) = parse_methods(
        ["diloco+x:diloco.outer-nesterov=false,optim.betas=0.8 0.99,diloco.fragments=None"],
        STRATEGIES,
    )
    config = CompareBench(methods=(variant.spec(),)).run_config(variant, 0)
    assert config.diloco.outer_nesterov is False
    assert config.optim.betas == (0.8, 0.99)
    assert config.diloco.fragments is None
    assert convert("3", int | None) == 3 and convert("none", int | None) is None


@pytest.mark.parametrize(
    ("methods", "message"),
    [
        (("dilco",), "unknown method 'dilco'"),
        (("diloco:diloco.outer-lr=1",), "needs a tag"),
        (("diloco", "ddp", "diloco"), "diloco given twice"),
        (("diloco+x:diloco.outer-lr=abc",), "'abc' must be a number"),
        (("diloco+x:diloco.outerlr=1",), "names no training option"),
        (("diloco+x:diloco.sync-every=0",), "--diloco.sync-every: 0 must be an integer >= 1"),
        (("diloco+x:steps=3",), "set by the study"),
        (("diloco+x:diloco.quantization=int5",), "must be one of none, bf16, fp8, int4"),
        (("diloco+a/b:optim.lr=1",), "the tag after '+'"),
        (("ddp+x:diloco.outer-lr=0.5",), "ddp does not read the diloco.* options"),
        (("diloco+x:diloco",), "not KEY=VALUE"),
        (("diloco+x:diloco=1",), "is a group of options"),
    ],
)
def test_a_bad_entry_is_refused_in_one_line_naming_it(
    methods: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=r"^--methods: ") as error:
        CompareBench(methods=methods)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_all_is_every_method_and_a_plain_variant_is_the_method() -> None:
    assert CompareBench().method_names() == sorted(STRATEGIES)
    with_variant = CompareBench(methods=("all", "diloco+h4:diloco.sync-every=4"))
    assert with_variant.method_names() == [*sorted(STRATEGIES), "diloco+h4"]
    assert Variant("ddp").label == "ddp" and Variant("ddp", "a").spec() == "ddp+a"
