"""`lowcomm bench compare` and `lowcomm reproduce` with faults: the --faults and --fault-*
options reach every run, and the tables give each run's goodput (from the command line)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lowcomm import cli
from lowcomm.models import ModelConfig
from lowcomm.reproduce import PAPERS, SCALES, papers
from lowcomm.reproduce.runner import RunSpec, Scale

TINY_TRAIN = [
    "--train.model.n-layer", "1", "--train.model.n-embd", "32", "--train.model.n-head", "2",
    "--train.model.block-size", "16", "--micro-batch-size", "2", "--train.eval-batches", "1",
    "--train.eval-every", "2", "--train.seconds-per-microbatch", "0.01",
    "--train.plot", "False", "--train.diloco.sync-every", "2",
]  # fmt: skip

TRACE = "step=1 worker=1 crash\nstep=3 worker=1 join\n"


def test_bench_compare_gives_every_run_the_trace_and_reports_goodput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "trace.txt", tmp_path / "cmp"
    trace.write_text(TRACE)
    args = [
        "bench", "compare", "--methods", "ddp,diloco,zero1", "--steps", "4", "--workers", "2",
        "--faults", str(trace), "--fault-detection-s", "0.5", "--out", str(out), *TINY_TRAIN,
    ]  # fmt: skip
    cli.main(args)
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["budget"] == "steps"  # (a run with faults takes its steps)
    assert set(results["methods"]) == {"ddp", "diloco"}
    assert "--method zero1 keeps its optimizer state sharded" in results["failures"]["zero1-s0"]
    report = (out / "report.md").read_text()
    assert "goodput | rounds dropped |" in report and f"the trace `{trace}`" in report
    for method, row in results["methods"].items():
        run = out / "runs" / f"{method}-s0"
        config = json.loads((run / "config.json").read_text())
        fault = config["fault"]
        assert fault["faults"] == str(trace) and fault["fault_detection_s"] == 0.5
        # (faults run as threads of one process)
        assert config["placement"]["workers_per_process"] == 2
        faults = json.loads((run / "summary.json").read_text())["faults"]
        assert [c["step"] for c in faults["membership_changes"]] == [1, 3]
        assert row["goodput"] == faults["goodput"] and 0 < row["goodput"] < 1
        assert row["rounds_dropped"] == faults["rounds_dropped"]
        assert f"| {method} |" in report and f"| {row['goodput']:.3f} |" in report
    assert results["methods"]["ddp"]["rounds_dropped"] == 1  # (ddp drops the crash's step)
    # Tokens are the committed ones: 4 steps of 2 workers, less the crash's dropped step
    # and the step worker 1 was away.
    assert results["methods"]["ddp"]["tokens"] == 32 * (2 * 4 - 2 - 1)


def test_bench_compare_refuses_a_fault_option_given_twice_and_a_step_cap_without_faults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "compare", "--methods", "ddp", "--out", str(tmp_path / "cmp")]
    for extra, expected in (
        (["--fault-seed", "1", "--train.fault-seed", "2"], "--fault-seed: given both"),
        (["--budget", "tokens", "--max-steps", "8"], "--max-steps: 8 is for --budget tokens"),
    ):
        with pytest.raises(SystemExit) as caught:
            cli.main([*base, *extra])
        assert caught.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err


TINY = dataclasses.replace(
    SCALES["quick"],
    name="quick",
    steps=4,
    model=ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=16),
    micro_batch_size=2,
    eval_every=2,
    eval_batches=1,
)


def _tiny_runs(scale: Scale) -> list[RunSpec]:
    return [spec for spec in papers.acco_runs(scale) if spec.label in (papers.DDP2, papers.ZERO2)]


def test_reproduce_gives_every_run_the_fault_options_and_reports_goodput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lowcomm.reproduce as reproduce

    tiny_paper = dataclasses.replace(PAPERS["acco"], runs=_tiny_runs, predictions=(papers.a5,))
    monkeypatch.setitem(reproduce.SCALES, "quick", TINY)
    monkeypatch.setitem(reproduce.PAPERS, "acco", tiny_paper)
    trace, out = tmp_path / "trace.txt", tmp_path / "out"
    trace.write_text(TRACE)
    flags = ["--faults", str(trace), "--fault-detection-s", "0.5", "--fault-quorum-wait-s", "60.0"]
    cli.main(["reproduce", "acco", "--out", str(out), "--seeds", "0", "--scale", "quick", *flags])
    capsys.readouterr()
    doc = json.loads((out / "acco" / "results.json").read_text())
    assert doc["command"].endswith(" ".join(flags))
    rows = {row["label"]: row for row in doc["runs"]}
    ddp = rows[papers.DDP2]
    assert f"--faults {trace}" in ddp["command"] and "--fault-detection-s 0.5" in ddp["command"]
    run = next((out / "acco" / "runs").glob("ddp*-s0"))
    fault = json.loads((run / "config.json").read_text())["fault"]
    assert (fault["faults"], fault["fault_detection_s"]) == (str(trace), 0.5)
    assert fault["fault_quorum_wait_s"] == 60.0
    faults = json.loads((run / "summary.json").read_text())["faults"]
    assert [c["step"] for c in faults["membership_changes"]] == [1, 3]
    assert ddp["goodput"] == [faults["goodput"]] and 0 < faults["goodput"] < 1
    assert any("keeps its optimizer state sharded" in e for e in doc["failures"].values())
    report = (out / "acco" / "report.md").read_text()
    assert "| bytes/worker | goodput |" in report and f"| {faults['goodput']:.3f} |" in report


def test_a_generated_trace_reaches_every_compared_run_in_one_process() -> None:
    from lowcomm.bench.compare import CompareBench
    from lowcomm.faults.run import FaultFlags

    bench = CompareBench(
        methods=("ddp", "diloco"), workers=3,
        fault=FaultFlags(fault_mtbf_s=50.0, fault_replace_after_s=5.0, fault_seed=4),
    )  # fmt: skip
    for method in ("ddp", "diloco"):
        run = bench.run_config(method, 0)
        fault = run.fault
        assert (fault.fault_mtbf_s, fault.fault_replace_after_s, fault.fault_seed) == (50.0, 5.0, 4)
        assert run.placement.workers_per_process == 3 and run.run.token_budget is None
    plain = CompareBench(methods=("ddp",), workers=3)
    assert (
        plain.budget == "tokens" and plain.run_config("ddp", 0).placement.workers_per_process == 1
    )
