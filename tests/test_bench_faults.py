"""``lowcomm bench faults``: the table it writes agrees with the runs' own summaries, and a
method that refuses --faults is reported as refused, not a failure of the benchmark."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lowcomm.bench.faults import FaultsBench, run_faults


def test_bench_faults_reports_each_runs_summary_and_the_refusals(tmp_path: Path) -> None:
    bench = FaultsBench(
        workers=(4,), methods=("ddp", "diloco", "streaming_diloco", "decoupled_diloco", "zero1"),
        steps=8,
        fault_mtbf_s=40.0, fault_replace_after_s=4.0, fault_slow_fraction=0.25,
        fault_detection_s=2.0, out=str(tmp_path / "bench"),
    )  # fmt: skip
    rows = run_faults(bench)
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["rows"] == rows
    report = (tmp_path / "bench" / "report.md").read_text()
    by_method = {row["method"]: row for row in rows}
    assert "refused" in by_method["zero1"]
    assert "keeps its optimizer state sharded" in by_method["zero1"]["refused"]
    assert "\n" not in by_method["zero1"]["refused"]
    for method in ("ddp", "diloco"):
        row = by_method[method]
        clean = json.loads((Path(row["clean_dir"]) / "summary.json").read_text())
        faulted = json.loads((Path(row["faults_dir"]) / "summary.json").read_text())
        assert "faults" not in clean and "faults" in faulted
        assert row["clean_loss"] == clean["final_train_loss"]
        assert row["clean_time_s"] == clean["modeled_time_s"]
        assert row["faults_loss"] == faulted["final_train_loss"]
        assert row["faults_time_s"] == faulted["modeled_time_s"]
        assert row["faults_bytes"] == faulted["bytes_sent_per_worker"]
        assert row["rounds_dropped"] == faulted["faults"]["rounds_dropped"]
        expected = (faulted["committed_tokens"] / faulted["modeled_time_s"]) / (
            clean["committed_tokens"] / clean["modeled_time_s"]
        )
        assert math.isclose(row["goodput"], expected, rel_tol=1e-12)
        assert 0 < row["goodput"] < 1  # (a straggler and a crash cost time)
        assert row["predicted_goodput"] is not None and 0 < row["predicted_goodput"] < 1
        assert f"| 4 | {method} | {row['goodput']:.3f} | {row['predicted_goodput']:.3f} |" in report
    assert "| 4 | zero1 | refused |" in report
    # streaming_diloco is priced with the fragments its run used (1 for the 1-block model,
    # where a plan alone takes 4, which H = 4 and tau = 1 do not fit).
    assert 0 < by_method["streaming_diloco"]["goodput"] < 1
    assert by_method["streaming_diloco"]["predicted_goodput"] is not None
    # decoupled_diloco runs with faults: its learners wait for no straggler, so it keeps more
    # of its fault-free rate than ddp, which waits for the slowest worker every step.
    assert by_method["ddp"]["goodput"] < by_method["decoupled_diloco"]["goodput"] <= 1
    # The planner prices it with the fragments training used.
    assert 0 < by_method["decoupled_diloco"]["predicted_goodput"] <= 1
