"""`lowcomm reproduce`: the two-sd verdict rule, the prediction functions on synthetic runs,
the declared runs of every paper, and one tiny reproduction end to end."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from lowcomm import cli
from lowcomm.config import FLAT_COMPONENTS, RunConfig, TrainConfig
from lowcomm.models import ModelConfig
from lowcomm.reproduce import PAPERS, SCALES, ReproduceConfig, papers
from lowcomm.reproduce.runner import (
    Results,
    RunData,
    RunSpec,
    Scale,
    loss_at_time,
    parse_train_flags,
    steps_to_target,
    train_flags,
)
from lowcomm.reproduce.stats import (
    FAILS,
    HOLDS,
    NOISE,
    NOT_MEASURED,
    Finding,
    Link,
    Stat,
    about_equal,
    below,
    combine,
    constant,
    derive,
    greater,
    less,
)
from lowcomm.strategies import STRATEGIES

QUICK = SCALES["quick"]

# --- the verdict rule against hand-made numbers ------------------------------------------


def test_ordering_holds_when_the_gap_exceeds_two_sd() -> None:
    a = Stat("a", (1.0, 1.1, 0.9))  # mean 1.0, sd 0.1
    b = Stat("b", (1.3, 1.4, 1.2))  # mean 1.3, sd 0.1: gap 0.3 > 2 sd = 0.2
    assert less(a, b).verdict == HOLDS
    assert greater(b, a).verdict == HOLDS


def test_ordering_reversed_beyond_two_sd_does_not_hold() -> None:
    a = Stat("a", (1.3, 1.4, 1.2))
    b = Stat("b", (1.0, 1.1, 0.9))
    assert less(a, b).verdict == FAILS
    # Non-strict "≤" also fails when reversed beyond the noise band.
    assert less(a, b, strict=False).verdict == FAILS


def test_ordering_within_two_sd_is_inconclusive() -> None:
    a = Stat("a", (1.0, 1.1, 0.9))
    b = Stat("b", (1.15, 1.25, 1.05))  # gap 0.15 < 0.2
    assert less(a, b).verdict == NOISE
    assert less(b, a).verdict == NOISE
    # "≤" is satisfied by equality within noise.
    assert less(b, a, strict=False).verdict == HOLDS


def test_the_band_is_the_larger_groups_sd() -> None:
    tight = Stat("tight", (1.0, 1.0, 1.0))
    wide = Stat("wide", (1.2, 1.5, 1.8))  # sd 0.3: band 0.6 > gap 0.5
    assert less(tight, wide).verdict == NOISE


def test_one_seed_gives_no_verdict_on_an_ordering() -> None:
    assert less(Stat("a", (1.0,)), Stat("b", (5.0,))).verdict == NOISE


def test_about_equal_with_and_without_a_claimed_bound() -> None:
    a = Stat("a", (2.00, 2.02, 1.98))
    b = Stat("b", (2.01, 2.03, 1.99))
    assert about_equal(a, b).verdict == HOLDS
    far = Stat("far", (3.0, 3.02, 2.98))
    assert about_equal(far, b).verdict == FAILS
    # A claimed bound: inside it holds even if the seeds agree closely.
    assert (
        about_equal(Stat("x", (1.005, 1.005)), Stat("y", (1.0, 1.0)), rel_tol=0.01).verdict == HOLDS
    )
    # Beyond the bound but within noise: inconclusive.
    noisy = Stat("noisy", (1.0, 1.2))
    assert about_equal(noisy, Stat("y", (1.0, 1.0)), rel_tol=0.01).verdict == NOISE
    # Beyond the bound and beyond noise: does not hold.
    assert about_equal(Stat("x", (1.5, 1.5)), Stat("y", (1.0, 1.0)), rel_tol=0.01).verdict == FAILS


def test_constants_have_zero_spread() -> None:
    ratio = Stat("ratio", (12.9, 13.1))
    assert about_equal(ratio, constant("13", 13.0), rel_tol=0.15).verdict == HOLDS
    assert (
        about_equal(Stat("ratio", (4.2, 4.3)), constant("13", 13.0), rel_tol=0.15).verdict == FAILS
    )


def test_below_a_bound() -> None:
    assert below(Stat("r", (1e-6, 2e-6)), 1e-4).verdict == HOLDS
    assert below(Stat("r", (1e-2, 2e-2)), 1e-4).verdict == FAILS
    assert below(Stat("r", (0.0, 2e-4)), 1e-4).verdict == NOISE


def test_missing_or_non_finite_measurements_are_not_measured() -> None:
    assert less(Stat("a", ()), Stat("b", (1.0, 2.0))).verdict == NOT_MEASURED
    assert less(Stat("a", (float("nan"), 1.0)), Stat("b", (1.0, 2.0))).verdict == NOT_MEASURED


def test_combine_links() -> None:
    hold, fail, noise, missing = (Link("x", v, "") for v in (HOLDS, FAILS, NOISE, NOT_MEASURED))
    assert combine([hold, hold]) == HOLDS
    assert combine([hold, noise]) == NOISE
    assert combine([hold, noise, fail]) == FAILS
    assert combine([hold, missing]) == NOISE
    assert combine([missing]) == NOT_MEASURED
    assert Finding("X", "claim", [], [hold, fail]).verdict == FAILS


def test_derive_is_per_seed() -> None:
    gap = derive("gap", lambda a, b: a - b, Stat("a", (3.0, 5.0)), Stat("b", (1.0, 2.0)))
    assert gap.values == (2.0, 3.0)


def test_curve_helpers() -> None:
    curve = [(2, 1.0, 5.0), (4, 2.0, 4.0), (6, 3.0, 3.0)]
    assert steps_to_target(curve, 4.0, censored=99) == 4.0
    assert steps_to_target(curve, 1.0, censored=99) == 99.0
    assert loss_at_time(curve, 1.5) == pytest.approx(4.5)
    assert loss_at_time(curve, 10.0) == 3.0


# --- prediction functions on synthetic runs -----------------------------------------------


def _run(label: str, seed: int, final: float, *, curve: list[tuple[int, float, float]] | None = None,
         records: list[dict[str, Any]] | None = None, **summary: Any) -> RunData:  # fmt: skip
    points = curve or [(QUICK.steps // 2, 1.0, final + 0.5), (QUICK.steps, 2.0, final)]
    return RunData(label, seed, {"final_val_loss": final, **summary}, records or [], points)


def _results(finals: Mapping[str, tuple[float, ...]], **summary: Any) -> Results:
    return Results(
        {
            label: [_run(label, seed, value, **summary) for seed, value in enumerate(values)]
            for label, values in finals.items()
        }
    )


def test_e1_holds_on_the_claimed_order_and_fails_reversed() -> None:
    h = QUICK.diloco_sync
    names = ["diloco", "streaming 1-inner", "eager N=1", "eager N=2", "delayed low lr", "delayed"]
    means = [3.00, 3.00, 3.10, 3.20, 3.30, 3.40]
    ordered = {f"{n} H={h}": (m - 0.005, m + 0.005) for n, m in zip(names, means, strict=True)}
    assert papers.e1(_results(ordered), QUICK).verdict == HOLDS
    reversed_ = {
        f"{n} H={h}": (m - 0.005, m + 0.005) for n, m in zip(names, reversed(means), strict=True)
    }
    assert papers.e1(_results(reversed_), QUICK).verdict == FAILS


def test_e2_gap_growth() -> None:
    low, h, high = papers._eager_hs(QUICK)
    finals = {
        f"eager N=1 H={low}": (3.0, 3.0), f"delayed H={low}": (3.01, 3.01),
        f"eager N=1 H={h}": (3.0, 3.0), f"delayed H={h}": (3.1, 3.1),
        f"eager N=1 H={high}": (3.0, 3.0), f"delayed H={high}": (3.3, 3.31),
    }  # fmt: skip
    assert papers.e2(_results(finals), QUICK).verdict == HOLDS


def test_missing_runs_are_reported_not_measured() -> None:
    finding = papers.d3(Results({}), QUICK)
    assert finding.verdict == NOT_MEASURED
    assert papers.f5(Results({}), QUICK).verdict == NOT_MEASURED


def test_a5_identical_curves_hold_and_diverging_ones_do_not() -> None:
    same = _results({papers.DDP2: (3.0, 3.1), papers.ZERO2: (3.0, 3.1)})
    assert papers.a5(same, QUICK).verdict == HOLDS
    apart = _results({papers.DDP2: (3.0, 3.1), papers.ZERO2: (3.2, 3.3)})
    assert papers.a5(apart, QUICK).verdict == FAILS


def test_a4_reads_the_micro_batch_ratio_from_the_records() -> None:
    acco_records = [{"microbatches_per_worker": [4, 4, 4, 1]} for _ in range(5)]
    ddp_records = [{"microbatches_per_worker": [1, 1, 1, 1]} for _ in range(5)]
    fast = [(10, 1.0, 4.0), (20, 2.0, 3.0)]
    slow = [(10, 2.0, 5.0), (20, 4.0, 4.5)]
    results = Results({
        papers.ACCO_STRAG: [RunData("a", s, {"final_val_loss": 3.0}, acco_records, fast) for s in (0, 1)],
        papers.DDP_STRAG: [RunData("d", s, {"final_val_loss": 4.5 + s / 100}, ddp_records, slow) for s in (0, 1)],
    })  # fmt: skip
    finding = papers.a4(results, QUICK)
    assert "13.0000" in finding.measured[0] and "4.0000" in finding.measured[1]
    assert finding.verdict == HOLDS


def test_d3_reads_the_compensation_ratio_extra() -> None:
    records = [{"extras": {"compensation_ratio": 2e-3}}]
    runs = {
        papers.COCO: [_run(papers.COCO, s, 3.0 + s / 100, records=records) for s in (0, 1)],
        papers.COCO_NOCOMP: [_run(papers.COCO_NOCOMP, s, 3.0 + s / 100) for s in (0, 1)],
    }
    finding = papers.d3(Results(runs), QUICK)
    assert finding.verdict == FAILS  # the ratio 2e-3 is above the claimed 1e-4
    assert [link.verdict for link in finding.links] == [HOLDS, FAILS]


def test_f3_payload_ratio_and_orderings() -> None:
    labels = papers._desloc_labels(QUICK)
    k = QUICK.desloc_period
    flat = [{"train_loss": 3.0} for _ in range(QUICK.steps)]
    spiky = [{"train_loss": 3.5 if t % k == 0 and t > 0 else 3.0} for t in range(QUICK.steps)]

    def runs(label: str, final: float, sent: float, records: list[dict[str, Any]]) -> list[RunData]:
        return [
            _run(label, s, final + s / 1000, records=records, bytes_sent_per_worker=sent)
            for s in (0, 1)
        ]

    results = Results({
        "ddp": runs("ddp", 2.5, 100.0, flat),
        labels["desloc"]: runs(labels["desloc"], 3.0, 10.0, flat),
        labels["local_adam"]: runs(labels["local_adam"], 3.0, 20.0, flat),
        labels["favg_opt"]: runs(labels["favg_opt"], 3.1, 6.0, flat),
        labels["favg_reset"]: runs(labels["favg_reset"], 3.5, 6.0, spiky),
    })  # fmt: skip
    assert papers.f3(results, QUICK).verdict == HOLDS


# --- declared runs --------------------------------------------------------------------------


def _train_flag_names() -> set[str]:
    """Every `lowcomm train` option name, from the TrainConfig dataclass tree."""
    names: set[str] = set()
    config = TrainConfig()
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            # The data options and the flat components' are unprefixed.
            prefix = "" if field.name in ("data", *FLAT_COMPONENTS) else f"{field.name}."
            names |= {
                f"--{prefix}{sub.name.replace('_', '-')}" for sub in dataclasses.fields(value)
            }
        else:
            names.add(f"--{field.name.replace('_', '-')}")
    return names


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_every_declared_run_uses_real_options_and_methods(scale: str) -> None:
    known = _train_flag_names()
    for paper in PAPERS.values():
        specs = paper.runs(SCALES[scale])
        assert len({spec.label for spec in specs}) == len(specs), paper.name
        for spec in (spec for spec in specs if spec.kind == "train"):
            assert isinstance(spec.run, TrainConfig)
            assert spec.run.method in STRATEGIES, (spec.label, spec.run.method)
            assert spec.run.comm.clock == "virtual"
            # The command a report shows is real options that give back the same run.
            flags = train_flags(spec.run)
            assert {token for token in flags if token.startswith("--")} <= known, spec.label
            assert parse_train_flags(flags) == spec.run, spec.label


def test_one_declared_run_per_paper_validates_and_passes_preflight(tmp_path: Path) -> None:
    from lowcomm.launch.run import preflight

    for paper in PAPERS.values():
        spec = paper.runs(QUICK)[-2]
        config = spec.train_config(0, tmp_path / paper.name)
        config.validate()
        preflight(config)


def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (
        ["reproduce", "nope"],
        ["reproduce", "acco", "--scale", "huge"],
        ["reproduce", "acco", "--seeds", "1", "1"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args)
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("lowcomm: error:") and "\n" not in error, error
    with pytest.raises(ValueError, match="PAPER: unknown paper"):
        ReproduceConfig(paper="nope")


# --- end to end -----------------------------------------------------------------------------

TINY = dataclasses.replace(
    QUICK,
    name="quick",
    steps=4,
    model=ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=16),
    micro_batch_size=2,
    eval_every=2,
    eval_batches=1,
)


def _tiny_runs(scale: Scale) -> list[RunSpec]:
    return [spec for spec in papers.acco_runs(scale) if spec.label in (papers.DDP2, papers.ZERO2)]


@pytest.mark.slow
def test_reproduce_end_to_end_writes_report_and_json_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lowcomm.reproduce as reproduce

    tiny_paper = dataclasses.replace(
        PAPERS["acco"], runs=_tiny_runs, predictions=(papers.a5, papers.a1)
    )
    monkeypatch.setitem(reproduce.SCALES, "quick", TINY)
    monkeypatch.setitem(reproduce.PAPERS, "acco", tiny_paper)
    # One seed keeps it to two short runs; the verdict rule with several seeds is tested above.
    args = ["reproduce", "acco", "--out", str(tmp_path / "out"), "--seeds", "0", "--scale", "quick"]
    cli.main(args)
    paper_dir = tmp_path / "out" / "acco"
    doc = json.loads((paper_dir / "results.json").read_text())
    assert doc["paper"] == "acco" and doc["seeds"] == [0] and doc["scale"]["steps"] == 4
    assert (
        doc["command"] == f"lowcomm reproduce acco --out {tmp_path / 'out'} --seeds 0 --scale quick"
    )
    assert [p["id"] for p in doc["predictions"]] == ["A5", "A1"]
    for prediction in doc["predictions"]:
        assert set(prediction) == {"id", "claim", "measured", "verdict", "links", "note"}
        assert prediction["verdict"] in (
            "holds",
            "does not hold",
            "inconclusive (within noise)",
            "not measured",
        )
    # ZeRO-1 and DDP are the same update: A5 holds on real runs.
    assert doc["predictions"][0]["verdict"] == HOLDS
    # A1 needs the ACCO runs this tiny design lacks: reported, not skipped.
    assert any(link["verdict"] == NOT_MEASURED for link in doc["predictions"][1]["links"])
    rows = {row["label"]: row for row in doc["runs"]}
    assert set(rows) == {papers.DDP2, papers.ZERO2}
    assert rows[papers.DDP2]["seeds"] == [0] and len(rows[papers.DDP2]["final_val_loss"]) == 1
    assert rows[papers.DDP2]["rose_late_seeds"] in (0, 1)
    assert (
        rows[papers.DDP2]["command"].startswith("lowcomm train ")
        and "--method ddp" in rows[papers.DDP2]["command"]
    )
    assert doc["failures"] == {}
    # One calibration for the study, measured before its first run, charged by both runs.
    calibration = tmp_path / "out" / "calibration.json"
    assert (
        doc["calibration"]["path"] == str(calibration.resolve()) and doc["calibration"]["measured"]
    )
    charged = {
        json.loads((run / "summary.json").read_text())["compute_model"]["seconds_per_microbatch"]
        for run in (paper_dir / "runs").iterdir()
    }
    assert charged == {json.loads(calibration.read_text())["seconds_per_microbatch"]}
    report = (paper_dir / "report.md").read_text()
    # The paper's report sits one directory below the study's calibration and names it so.
    assert "Charge it again in another study: `--calibration DIR/../calibration.json`" in report
    assert str(calibration.resolve()) not in report
    for text in (
        "# Reproduction:",
        "Scale **quick**",
        doc["command"],
        "### A5: holds",
        "**Claim.**",
        "## Runs",
        "| zero1 x2 accumulation | 1 |",
        "Rose late:",
    ):
        assert text in report, text
    capsys.readouterr()
    # Re-running skips every finished run.
    cli.main(args)
    assert capsys.readouterr().err.count("done before, skipped") == 2


def test_a_finished_run_of_another_configuration_is_refused(tmp_path: Path) -> None:
    from lowcomm.bench.runs import run_or_resume

    run_dir = tmp_path / "ddp-s0"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "config.json").write_text(json.dumps({"method": "zero1"}))
    config = parse_train_flags(["--method", "ddp", "--out", str(run_dir)])
    with pytest.raises(
        ValueError, match=r"--runs-dir: .* holds a finished run with a different configuration"
    ):
        run_or_resume(config, "ddp seed 0", tag="reproduce", option="--runs-dir")
    # The same configuration is reused without running anything.
    (run_dir / "config.json").write_text(config.to_json())
    assert run_or_resume(config, "ddp seed 0", tag="reproduce", option="--runs-dir") is None


def test_rosenbrock_output_is_parsed() -> None:
    from lowcomm.reproduce.runner import _DISTANCE

    line = "favg_reset  x = (+1.0045, +1.0090)  distance to (1, 1) 0.0101"
    match = _DISTANCE.match(line)
    assert match is not None and match.group(1) == "favg_reset" and float(match.group(4)) == 0.0101


def test_d1_target_is_reached_by_every_mean_curve_even_after_a_divergence() -> None:
    def curve(losses: list[float]) -> list[tuple[int, float, float]]:
        return [(8 * (i + 1), float(i), loss) for i, loss in enumerate(losses)]

    shapes = {
        papers.COCO: [7.0, 6.5, 6.2, 6.1],
        papers.DILOCO: [7.0, 6.6, 6.3, 9.0],  # reaches 6.3, then diverges
        papers.STREAM: [7.0, 6.8, 6.6, 6.4],
    }
    results = Results({
        label: [_run(label, s, losses[-1], curve=curve(losses)) for s in (0, 1)] for label, losses in shapes.items()
    })  # fmt: skip
    finding = papers.d1(results, QUICK)
    assert "6.4000" in finding.measured[-1]  # streaming's best, the highest of the bests
    assert finding.measured[0].startswith("cocodc steps to 6.400 = 24.0000")
    assert finding.measured[1].startswith("diloco steps to 6.400 = 24.0000")
    assert finding.measured[2].startswith("streaming steps to 6.400 = 32.0000")


def test_rose_late_flags_a_run_that_ends_above_its_best() -> None:
    from lowcomm.reproduce import _rose_late

    assert _rose_late([(8, 1.0, 6.5), (16, 2.0, 6.3), (24, 3.0, 7.0)])
    assert not _rose_late([(8, 1.0, 6.5), (16, 2.0, 6.3), (24, 3.0, 6.31)])


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_a_sweeps_finished_runs_drop_their_checkpoints_unless_kept(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reproduce --checkpoints` reaches the shared run-or-resume (a finished run's
    checkpoints are deleted unless kept; a failed run's stay for a look)."""
    import lowcomm.bench.runs as runs
    import lowcomm.reproduce as reproduce

    assert ReproduceConfig(paper="acco").checkpoints == "drop"
    seen: list[str] = []

    def fake_run(config: TrainConfig) -> str | None:
        run_dir = Path(str(config.run.out))
        (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
        (run_dir / "model").mkdir()
        seen.append(config.method)
        return "boom" if config.method == "ddp" else None

    monkeypatch.setattr(runs, "run_one", fake_run)
    ok = TrainConfig(
        method="diloco",
        run=RunConfig(out=str(tmp_path / "ok")),
    )
    bad = TrainConfig(
        method="ddp",
        run=RunConfig(out=str(tmp_path / "bad")),
    )
    assert runs.run_or_resume(ok, "ok", tag="t", checkpoints=policy) is None
    assert runs.run_or_resume(bad, "bad", tag="t", checkpoints=policy) == "boom"
    assert (tmp_path / "ok" / "checkpoints").exists() == (policy == "keep")
    assert (tmp_path / "ok" / "model").is_dir()
    assert (tmp_path / "bad" / "checkpoints").exists()
    # The option travels from the command line to the runs.
    passed: list[str] = []

    def fake_execute(*args: Any, **kwargs: Any) -> Any:
        passed.append(args[5] if len(args) > 5 else kwargs["checkpoints"])
        raise SystemExit(0)

    monkeypatch.setattr(reproduce, "execute", fake_execute)
    with pytest.raises(SystemExit):
        reproduce.run_reproduce(
            ReproduceConfig(paper="acco", checkpoints=policy, out=str(tmp_path / "r"))
        )
    assert passed == [policy] and seen == ["diloco", "ddp"]
