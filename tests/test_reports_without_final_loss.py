"""The reports of ``bench`` and ``reproduce`` on a run whose final validation had no batch on
any worker (summary.json's ``final_val_loss`` null): no crash, the cell says n/a or counts the
seeds that had one, the means are over those seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lowcomm.bench import compare, elastic
from lowcomm.bench.figures import _final_scatter
from lowcomm.bench.runs import bytes_curve, val_curve
from lowcomm.bench.scale import ScaleBench, ScaleRun, equal_runs, scale_report
from lowcomm.config import TrainConfig
from lowcomm.reproduce import SCALES, _loss_cell, _run_rows, papers
from lowcomm.reproduce.runner import Results, RunData, RunSpec, loss_at_time
from lowcomm.reproduce.stats import NOT_MEASURED, less

NOTE = "no worker held a validation batch"


def _summary(final: float | None, **more: Any) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "final_val_loss": final, "steps": 4, "modeled_time_s": 8.0, "tokens": 512,
        "committed_tokens": 512, "utilization": 0.5, "bytes_sent_per_worker": 400.0,
        "state_bytes_per_worker": 10, **more,
    }  # fmt: skip
    if final is None:
        summary["final_val_loss_note"] = NOTE
    return summary


def _run_dir(tmp_path: Path, final: float | None) -> Path:
    """A run of 4 steps evaluated after step 2 (loss 5.0) and at the end (``final``)."""
    records = [
        {"step": 0, "clock_s": 1.0, "bytes_sent_per_worker": 100.0},
        {"step": 1, "clock_s": 2.0, "bytes_sent_per_worker": 100.0, "val_loss": 5.0},
        {"step": 2, "clock_s": 3.0, "bytes_sent_per_worker": 100.0},
        {"step": 3, "clock_s": 4.0, "bytes_sent_per_worker": 50.0, "val_loss": final},
    ]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_the_curve_ends_on_the_last_measured_evaluation(tmp_path: Path) -> None:
    measured = _run_dir(tmp_path / "a", 4.0)
    summary = _summary(4.0)
    curve = val_curve(measured, summary)
    assert curve == [(2, 2.0, 5.0), (4, 8.0, 4.0)]
    assert bytes_curve(measured, curve, summary) == [200.0, 400.0]
    unmeasured = _run_dir(tmp_path / "b", None)
    summary = _summary(None)
    curve = val_curve(unmeasured, summary)
    assert curve == [(2, 2.0, 5.0)]  # no point for the missing final validation
    assert bytes_curve(unmeasured, curve, summary) == [200.0]  # the step's, not the total


def _compare_row(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    mean, sd = compare._finals(summaries)
    return {
        "seeds": len(summaries),
        "final_val_loss_mean": None if math.isnan(mean) else mean,
        "final_val_loss_sd": None if math.isnan(sd) else sd,
        "final_val_loss_missing": sum(s["final_val_loss"] is None for s in summaries),
    }


def test_bench_compare_averages_the_seeds_with_a_final_loss_and_says_how_many() -> None:
    some = _compare_row([_summary(4.0), _summary(None), _summary(5.0)])
    assert some["final_val_loss_mean"] == 4.5
    assert compare._fmt_loss(some) == "4.5000 ± 0.7071 (2 of 3 seeds)"
    none = _compare_row([_summary(None), _summary(None)])
    assert none["final_val_loss_mean"] is None and compare._fmt_loss(none) == "n/a"
    every = _compare_row([_summary(4.0)])
    assert compare._fmt_loss(every) == "4.0000"
    rows = {"none": none, "some": some, "every": every}
    assert [m for m, _ in sorted(rows.items(), key=compare._loss_order)] == [
        "every", "some", "none",
    ]  # fmt: skip


def test_the_final_loss_figure_leaves_out_seeds_without_one(tmp_path: Path) -> None:
    runs = {"ddp": [_summary(4.0), _summary(None)], "diloco": [_summary(None)]}
    path = tmp_path / "final.png"
    _final_scatter(path, runs, "bytes", lambda s: float(s["bytes_sent_per_worker"]))
    assert path.stat().st_size > 0


def test_bench_elastic_reads_a_null_final_loss_and_tables_it(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(_summary(None)))
    assert elastic._summary(tmp_path) == (None, 8.0)
    runs = [
        {"method": "ddp", "scenario": "lose one", "final_val_loss": loss, "modeled_time_s": 8.0}
        for loss in (None, 4.0, 5.0)
    ] + [{"method": "ddp", "scenario": "add one", "final_val_loss": None, "modeled_time_s": 8.0}]
    table = elastic._table(runs, ("ddp",), ["lose one", "add one"])
    lines = elastic._format(table)
    assert "| ddp | lose one | 4.5000 ± 0.7071 (2 of 3 seeds) | 8.00 ± 0.00 |" in lines
    assert "| ddp | add one | n/a (no final validation batch) | 8.00 ± 0.00 |" in lines


def _scale_run(mode: str, loss: float) -> ScaleRun:
    return ScaleRun(
        mode=mode, workers=4, first_step_s=1.0, exit_s=2.0, setup_s=0.5, returncode=0,
        peak_rss_bytes=2**30, peak_threads=5, tokens_per_s=1000.0, final_val_loss=loss,
        modeled_time_s=1.25,
    )  # fmt: skip


def test_bench_scale_prints_n_a_and_compares_two_runs_without_a_final_loss() -> None:
    process, inprocess = _scale_run("process", math.nan), _scale_run("inprocess", math.nan)
    assert equal_runs(process, inprocess)
    assert not equal_runs(process, _scale_run("inprocess", 7.5))
    report = scale_report(ScaleBench(workers=(4,)), [process, inprocess], None)
    rows = [line for line in report.splitlines() if line.startswith("| 4 ")]
    assert all("| n/a | 1.250 s |" in row for row in rows) and rows[1].endswith("| yes |")


def _run(label: str, seed: int, final: float | None) -> RunData:
    # (without a final loss the curve ends on step 2's evaluation, above step 1's best)
    curve = [(1, 0.5, 4.0), (2, 1.0, 5.0)] + ([] if final is None else [(4, 2.0, final)])
    return RunData(label, seed, _summary(final), [], curve)


def test_reproduce_rows_and_cells_skip_the_seeds_without_a_final_loss() -> None:
    spec = RunSpec("ddp", TrainConfig())
    results = Results({"ddp": [_run("ddp", 0, 4.0), _run("ddp", 1, None), _run("ddp", 2, 5.0)]})
    results.specs = {"ddp": spec}
    [row] = _run_rows(results)
    assert row["final_val_loss"] == [4.0, None, 5.0]
    assert row["final_val_loss_mean"] == 4.5
    assert row["rose_late_seeds"] == 1  # seed 2 (5.0 over 4.0); not seed 1, which has no end
    assert _loss_cell(row) == "4.5000 ± 0.7071 (2 of 3 seeds)"
    results = Results({"ddp": [_run("ddp", 0, None)]})
    results.specs = {"ddp": spec}
    [row] = _run_rows(results)
    assert row["final_val_loss_mean"] is None
    assert _loss_cell(row) == "n/a (no final validation batch)"


def test_a_prediction_on_a_seed_without_a_final_loss_is_not_measured() -> None:
    results = Results(
        {"ddp": [_run("ddp", 0, None), _run("ddp", 1, 4.0)], "co2": [_run("co2", 0, 4.1)] * 2}
    )
    ddp = results.final("ddp")
    assert math.isnan(ddp.values[0]) and ddp.values[1] == 4.0
    assert less(ddp, results.final("co2")).verdict == NOT_MEASURED
    assert results.val_at("ddp", 4).values == (5.0, 4.0)  # the nearest measured evaluation
    never = Results({"x": [RunData("x", 0, _summary(None), [], [])]})
    assert math.isnan(never.val_at("x", 4).values[0])
    assert math.isnan(loss_at_time([], 1.0)) and math.isnan(loss_at_time([(2, 1.0, 5.0)], math.nan))
    assert math.isnan(papers._best_mean_loss(never, "x"))


def test_a4_on_runs_without_any_measured_evaluation_is_not_measured_at_equal_time() -> None:
    records = [{"microbatches_per_worker": [4, 4, 4, 1]}]
    runs = {
        label: [RunData(label, 0, _summary(None), records, [])]
        for label in (papers.ACCO_STRAG, papers.DDP_STRAG)
    }
    finding = papers.a4(Results(runs), SCALES["quick"])
    assert any("not finite" in link.detail for link in finding.links)


def test_a5_on_a_run_without_any_measured_evaluation_is_not_measured() -> None:
    runs = {
        papers.DDP2: [RunData(papers.DDP2, 0, _summary(4.0), [], [(4, 2.0, 4.0)])],
        papers.ZERO2: [RunData(papers.ZERO2, 0, _summary(None), [], [])],
    }
    assert papers.a5(Results(runs), SCALES["quick"]).verdict == NOT_MEASURED
