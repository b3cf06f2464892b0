"""End to end through the command line: files written, bad input, torchrun parity, example."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _cli import SMALL, lowcomm, small_flags, torchrun

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {
    "method", "workers", "steps", "num_params", "tokens", "final_train_loss", "final_val_loss",
    "wall_clock_s", "compute_s", "exposed_comm_s", "utilization", "bytes_sent_per_worker",
    "bytes_by_role", "clock", "modeled_time_s", "state_bytes_per_worker",
}  # fmt: skip


@pytest.mark.parametrize("method", ["ddp", "zero1"])
def test_train_writes_the_run_directory(tmp_path: Path, method: str) -> None:
    out = tmp_path / "run"
    flags = small_flags(plot=True)
    result = lowcomm("train", "--method", method, "--steps", "5", "--out", str(out), *flags)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert summary["method"] == method and summary["steps"] == 5 and summary["workers"] == 2
    assert summary["clock"] == "virtual"
    assert 0 < summary["utilization"] <= 1
    # Two workers on `wan`, one all-reduce-sized exchange per step: 2 (M-1)/M = 1 payload.
    payload = 4 * summary["num_params"]
    assert summary["bytes_sent_per_worker"] == pytest.approx(5 * payload, rel=0.01)
    role = "gradient" if method == "ddp" else "parameter"
    assert summary["bytes_by_role"][role] > 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(5))
    assert records[1]["val_loss"] is not None
    assert json.loads((out / "config.json").read_text())["method"] == method
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final val loss" in result.stdout


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--method", "nope"], "--method"),
        (["--network", "lan"], "--network"),
        (["--workers", "0"], "--workers"),
        (["--steps", "-3"], "--steps"),
        (["--data", "/does/not/exist"], "--data"),
        (["--bandwidth-gbps", "-1"], "--bandwidth-gbps"),
        (["--latency-ms", "-5"], "--latency-ms"),
        (["--clock", "real", "--seconds-per-microbatch", "0.1"], "--seconds-per-microbatch"),
    ],
)
def test_bad_options_give_a_one_line_error_and_exit_2(args: list[str], option: str) -> None:
    # (--workers given: the command runs in this process, see _cli.lowcomm; the message and
    # the exit status are the command line's, as the next test's subprocesses show)
    result = lowcomm("train", "--workers", "2", *args, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lowcomm: error: " + option)


def test_an_unknown_option_is_one_line_naming_the_closest_known_one() -> None:
    result = lowcomm("train", "--stepz", "3", "--no-such-option", "1", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lowcomm: error: lowcomm train: unknown options --stepz (did you mean --steps?), "
        "--no-such-option; `lowcomm train --help` lists them"
    ]
    result = lowcomm("bench", "clock", "--repeat", "2", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lowcomm: error: lowcomm bench clock: unknown option --repeat (did you mean "
        "--repeats?); `lowcomm bench clock --help` lists them"
    ]


@pytest.mark.parametrize(
    ("prog", "tokens", "message"),
    [
        (
            "lowcomm train",
            ["--acco.microbatch-per-phase", "3"],
            "unknown option --acco.microbatch-per-phase (did you mean "
            "--acco.microbatches-per-phase?)",
        ),
        (
            "lowcomm train",
            ["--no-progress"],
            "unknown option --no-progress (did you mean --progress?)",
        ),
        ("lowcomm plan", ["--workerz=2"], "unknown option --workerz (did you mean --workers?)"),
        (
            "lowcomm train",
            ["oops"],
            "unexpected argument 'oops' (options take the form --name value)",
        ),
    ],
)
def test_unrecognized_options_message(prog: str, tokens: list[str], message: str) -> None:
    from lowcomm.cli import unrecognized_options

    assert f"{prog}: {message}" in unrecognized_options(prog, tokens)


def test_a_benchmark_option_before_the_benchmark_says_which_benchmarks_have_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lowcomm.cli as cli

    monkeypatch.setattr(cli, "_command_line", ["bench", "--repeats", "2"])
    text = cli.unrecognized_options("lowcomm bench", ["--repeats", "2"])
    assert "--repeats (an option of lowcomm bench overhead, startup, clock, scale: name the " \
        "benchmark first)" in text  # fmt: skip


def test_the_flags_suggested_for_a_typo_are_the_ones_tyro_parses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The suggestions come from our reading of the options dataclasses; every flag it finds
    must be one that tyro's help lists (nesting and naming as tyro does them)."""
    import tyro

    from lowcomm.bench import BENCHMARKS
    from lowcomm.cli import option_flags
    from lowcomm.config import TrainConfig
    from lowcomm.plan import PlanConfig

    monkeypatch.setenv("COLUMNS", "400")
    for cls in (TrainConfig, PlanConfig, *BENCHMARKS.values()):
        with pytest.raises(SystemExit):
            tyro.cli(cls, args=["--help"], config=(tyro.conf.FlagConversionOff,))
        listed = set(re.findall(r"--[\w.-]+", capsys.readouterr().out))
        flags = option_flags(cls)
        assert len(flags) > 3
        assert set(flags) <= listed, (cls.__name__, sorted(set(flags) - listed))


def test_torchrun_matches_the_local_spawner(tmp_path: Path) -> None:
    common = ["train", "--steps", "3", "--seed", "3", *SMALL]
    local = lowcomm(*common, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    launched = subprocess.run(
        [*torchrun(tmp_path), "--standalone", "--nproc-per-node", "2", "-m", "lowcomm", *common,
         "--out", str(tmp_path / "torchrun")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    a = json.loads((tmp_path / "local" / "summary.json").read_text())
    b = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert a["final_train_loss"] == pytest.approx(b["final_train_loss"], abs=1e-6)
    assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], abs=1e-6)
    assert a["bytes_sent_per_worker"] == b["bytes_sent_per_worker"]


def test_own_loop_example_runs(repo_root: Path) -> None:
    example = repo_root / "examples" / "own_loop.py"
    for method in ("ddp", "zero1"):
        result = subprocess.run(
            [sys.executable, str(example), "--method", method, "--steps", "150"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        fields = dict(item.split("=") for item in result.stdout.split())
        assert fields["method"] == method
        assert float(fields["last_loss"]) < 0.1 * float(fields["first_loss"])


def test_a_non_finite_loss_stops_the_run_naming_step_and_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = lowcomm(
        "train", "--steps", "12", "--optim.lr", "1e4", "--max-grad-norm", "None",
        "--checkpoint-every", "1", "--out", str(out), *SMALL,
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    found = re.search(
        r"^lowcomm: error: worker \d failed: .*step (\d+): worker \d (reported a non-finite loss|has non-finite parameters)",
        last,
    )
    assert found, last
    bad_step = int(found.group(1))
    steps_written = len((out / "metrics.jsonl").read_text().splitlines())
    assert steps_written == bad_step  # stopped at the step it appeared
    assert not (out / "summary.json").exists()
    # The newest checkpoint is the last good step, and it is finite: bad state is never saved.
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{bad_step:06d}"
    import torch

    state = torch.load(out / "checkpoints" / latest / "rank0.pt", weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--workers", "two"], "--workers: 'two' is not a whole number"),
        (["--steps", "1.5"], "--steps: '1.5' is not a whole number"),
        (["--optim.lr", "fast"], "--optim.lr: 'fast' is not a number"),
        (["--speed-factors", "1", "x"], "--speed-factors: cannot read the values '1', 'x'"),
    ],
)
def test_a_value_that_is_not_a_number_is_said_in_words(
    args: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowcomm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", *args])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lowcomm: error: {line}"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        # The typo is the cause of the missing value: it is named, not the symptom.
        (
            ["generate", "runs/x", "--promt", "hi"],
            "lowcomm generate: unknown option --promt (did you mean --prompt?); "
            "`lowcomm generate --help` lists them",
        ),
        (
            ["generate", "--promt", "hi", "runs/x"],
            "lowcomm generate: unknown option --promt (did you mean --prompt?); "
            "`lowcomm generate --help` lists them",
        ),
        (
            ["generate", "runs/x"],
            "lowcomm generate: missing --prompt (required); `lowcomm generate --help` says more",
        ),
    ],
)
def test_a_missing_value_is_one_line_and_a_typo_behind_it_is_named(
    args: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowcomm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lowcomm: error: {line}"]
