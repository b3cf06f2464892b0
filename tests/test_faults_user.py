"""What a user of ``--faults`` is told before the run: a trace file with no event, and events
placed by step that the run never reaches (they are valid, so the run goes on, but say so)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm.config import TrainConfig, with_options
from lowcomm.faults.run import run_trace, trace_notes
from lowcomm.faults.trace import TraceError


def _config(trace: Path, steps: int = 10) -> TrainConfig:
    return with_options(TrainConfig(), method="diloco", workers=2, steps=steps, faults=str(trace))


def _notes(tmp_path: Path, text: str, steps: int = 10) -> str | None:
    path = tmp_path / "trace.txt"
    path.write_text(text)
    config = _config(path, steps)
    return trace_notes(run_trace(config), config)


def test_a_trace_file_with_no_event_says_the_run_has_no_fault(tmp_path: Path) -> None:
    for text in ("", "# only a comment\n\n   \n"):
        note = _notes(tmp_path, text)
        assert note is not None
        assert note.startswith(f"lowcomm: note: --faults {tmp_path / 'trace.txt'} holds no event")
        assert "the run has no fault" in note and "\n" not in note


def test_events_placed_at_or_past_the_last_step_are_named(tmp_path: Path) -> None:
    trace = "step=4 worker=1 crash\nstep=10 worker=1 join\nstep=30 worker=0 crash\n"
    note = _notes(tmp_path, trace, steps=10)
    assert note is not None and "\n" not in note
    assert f"{tmp_path / 'trace.txt'}:2: 'step=10 worker=1 join' (and 1 more)" in note
    assert "at or past --steps 10 (steps 0 to 9): it never happens" in note


def test_a_trace_within_the_run_says_nothing(tmp_path: Path) -> None:
    # (step 9 is the run's last step; an event placed by time may land on any step)
    assert _notes(tmp_path, "step=9 worker=1 crash\nt=500 worker=0 slow factor=2\n") is None
    assert trace_notes(None, _config(tmp_path / "unused.txt")) is None


def test_a_generated_trace_with_no_event_says_nothing() -> None:
    # (a generated trace is empty by its options, not by a mistyped file)
    config = with_options(TrainConfig(), method="diloco", workers=2, steps=10, fault_mtbf_s=1e9)
    assert trace_notes(run_trace(config), config) is None


def test_a_word_for_an_optional_number_is_refused_in_words() -> None:
    from _cli import lowcomm

    for command, flag, value, rule in (
        (("plan", "--method", "diloco", "--params", "1m", "--workers", "4"), "--fault-mtbf-s",
         "abc", "is not a number (nor None, for unset)"),
        (("train",), "--membership.worker", "x", "is not a whole number (nor None, for unset)"),
    ):  # fmt: skip
        refused = lowcomm(*command, flag, value)
        assert refused.returncode == 2
        assert refused.stderr.strip() == f"lowcomm: error: {flag}: {value!r} {rule}"


def test_bench_compare_refuses_a_bad_trace_or_fault_option_once_before_any_run(
    tmp_path: Path,
) -> None:
    from _cli import lowcomm

    typo = tmp_path / "typo.txt"
    typo.write_text("step=4 worker=1 crahs\n")
    out = tmp_path / "cmp"
    for extra, expected in (
        (["--faults", str(typo)],
         f"--faults: {typo}:1: 'step=4 worker=1 crahs': unknown word 'crahs'; did you mean 'crash'?"),
        (["--faults", str(tmp_path)], f"--faults: {tmp_path}: cannot read the fault trace"),
        (["--fault-mtbf-s", "-1"], "--fault-mtbf-s: -1.0 is not valid"),
        (["--fault-min-workers", "9"], "--fault-min-workers: 9 is not valid"),
    ):  # fmt: skip
        refused = lowcomm(
            "bench", "compare", "--methods", "ddp", "diloco", "--out", str(out), *extra
        )
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.strip().startswith(f"lowcomm: error: {expected}"), refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
        assert not (out / "runs").exists()  # (no run started)


def test_bench_compare_whose_every_run_is_refused_reports_them(tmp_path: Path) -> None:
    from _cli import lowcomm

    trace = tmp_path / "trace.txt"
    trace.write_text("step=1 worker=1 crash\n")
    out = tmp_path / "cmp"
    ran = lowcomm("bench", "compare", "--methods", "zero1", "--steps", "4", "--out", str(out),
                  "--faults", str(trace))  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]  # (the report, with no figure to draw)
    assert "error" not in ran.stderr
    assert "keeps its optimizer state sharded" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["methods"] == {}


def test_a_generated_trace_that_kills_everyone_names_the_options_that_change_it() -> None:
    deadly = with_options(
        TrainConfig(), method="diloco", workers=2, fault_mtbf_s=10.0, fault_seed=1
    )
    with pytest.raises(TraceError) as refused:
        run_trace(deadly)  # (each worker crashes, none is replaced)
    message = str(refused.value)
    assert "no worker is alive from t=" in message and "drop this line" not in message
    assert message.endswith(
        "the trace is generated from --fault-*: give a longer --fault-mtbf-s, a shorter "
        "--fault-replace-after-s, more --workers or another --fault-seed"
    )
