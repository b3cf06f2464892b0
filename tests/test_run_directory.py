"""Runs a user can trust: nothing overwritten, one-line up-front errors, a readable failure,
and a resume that survives a damaged newest checkpoint.

Everything goes through the real command line; the runs are tiny.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from _cli import TINY, lowcomm
from lowcomm.config import RunConfig, TrainConfig
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.train.rundir import run_directory


def _train(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return lowcomm("train", *args, cwd=cwd)


def _one_line_error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The single stderr line of a failed command (asserting exit code, one line, no traceback)."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("lowcomm: error: "), lines[0]
    return lines[0]


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ddp run of 5 steps stopped after 3, with checkpoints at steps 2 and 3 (kept: 2)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    result = _train(
        *TINY, "--steps", "5", "--checkpoint-every", "1", "--keep-checkpoints", "2",
        "--stop-after", "3", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [
        "step-000002", "step-000003",
    ]  # fmt: skip
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


@pytest.mark.slow
def test_a_new_run_into_a_run_directory_is_refused_and_overwrite_replaces_it(
    stopped_run: Path, tmp_path: Path
) -> None:
    run = _copy(stopped_run, tmp_path)
    (run / "notes.txt").write_text("mine\n")
    before = (run / "metrics.jsonl").read_bytes()

    again = _train(*TINY, "--steps", "2", "--out", str(run))
    line = _one_line_error(again)
    assert line.startswith(f"lowcomm: error: --out: {run} already holds a run")
    assert "--overwrite" in line and "--resume" in line and "--out" in line
    assert (run / "metrics.jsonl").read_bytes() == before  # untouched
    assert (run / "checkpoints" / "step-000003" / "manifest.json").exists()

    replaced = _train(*TINY, "--steps", "2", "--out", str(run), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert _steps(run) == [0, 1]
    assert json.loads((run / "config.json").read_text())["run"]["steps"] == 2
    # The old run's checkpoints are gone, so a later --resume auto cannot pick them up; files
    # a run does not write are left alone.
    # (the new run's own final checkpoint, step 2, is all that is left)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000002"]
    assert (run / "notes.txt").read_text() == "mine\n"
    assert (run / "summary.json").exists() and not (run / "loss.png").exists()  # --plot False


def test_default_run_names_differ_by_setting() -> None:
    base = TrainConfig()
    assert run_directory(base) == Path("runs/ddp-wan-w4-s0")
    # A learning-rate sweep without --out: one directory per value.
    names = {run_directory(TrainConfig(optim=AdamWConfig(lr=lr))) for lr in (1e-4, 2e-4, 5e-4)}
    assert len(names) == 3 and run_directory(base) not in names
    assert all(name.name.startswith("ddp-wan-w4-s0-") for name in names)
    assert run_directory(TrainConfig(run=RunConfig(steps=100))) != run_directory(base)
    # The same settings give the same name; settings that only steer the run change nothing.
    assert run_directory(TrainConfig(optim=AdamWConfig(lr=5e-4))) in names
    assert run_directory(
        TrainConfig(run=RunConfig(progress=False, plot=False, checkpoint_every=5))
    ) == run_directory(base)


@pytest.mark.slow
def test_up_front_errors_are_one_line_and_exit_2(stopped_run: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    other_run = tmp_path / "other"
    other_run.mkdir()
    (other_run / "config.json").write_text(TrainConfig(method="co2").to_json())
    cases = {
        "an existing file": (["--out", str(a_file)], "--out: ", "existing file"),
        "under a file": (["--out", str(a_file / "run")], "--out: ", "which is a file"),
        "not writable": (["--out", "/proc/lowcomm-test/run"], "--out: ", "cannot write in /proc"),
        "another method's checkpoint": (
            ["--method", "co2", "--resume", "auto", "--out", str(stopped_run)],
            "--resume auto: ",
            "method='ddp' but this run has method='co2'",
        ),
        "another run without a checkpoint": (
            ["--resume", "auto", "--out", str(other_run)],
            "--resume auto: ",
            "holds another run",
        ),
        "cache not writable": (
            ["--cache-dir", "/proc/lowcomm-test/cache", "--out", str(tmp_path / "new")],
            "--data, --cache-dir: ",
            "/proc/lowcomm-test",
        ),
        "overwrite and resume": (
            ["--overwrite", "--resume", str(stopped_run)],
            "--overwrite: ",
            "pass one of them",
        ),
    }
    for name, (args, starts, says) in cases.items():
        line = _one_line_error(_train(*TINY, "--steps", "5", *args))
        assert line.startswith("lowcomm: error: " + starts), (name, line)
        assert says in line, (name, line)
    assert not (a_file / "run").exists() and a_file.read_text() == "not a directory\n"


@pytest.mark.slow
def test_a_non_finite_loss_is_one_line_with_the_traceback_in_the_run_directory(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    result = _train(
        *TINY, "--steps", "12", "--optim.lr", "1e4", "--max-grad-norm", "None", "--out", str(out)
    )
    line = _one_line_error(result, code=1)
    assert "non-finite" in line and f"traceback in {out / 'error.log'}" in line
    log = (out / "error.log").read_text()
    assert "Traceback (most recent call last)" in log and "NonFiniteLoss" in log


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_intact_checkpoint(
    stopped_run: Path, tmp_path: Path
) -> None:
    run = _copy(stopped_run, tmp_path)
    newest = run / "checkpoints" / "step-000003" / "rank1.pt"
    payload = bytearray(newest.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    newest.write_bytes(bytes(payload))

    resumed = _train("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    note = [line for line in resumed.stderr.splitlines() if "resuming from" in line]
    assert len(note) == 1, resumed.stderr
    # Which one it uses, which one it passed over, and why.
    assert "step-000002" in note[0] and "step-000003" in note[0] and "checksum" in note[0]
    assert _steps(run) == list(range(5))  # steps 2..4 redone after the fallback
    assert json.loads((run / "summary.json").read_text())["steps"] == 5


@pytest.mark.slow
def test_resume_fails_only_when_no_checkpoint_is_intact(stopped_run: Path, tmp_path: Path) -> None:
    run = _copy(stopped_run, tmp_path)
    (run / "checkpoints" / "step-000003" / "manifest.json").write_text("{torn")
    (run / "checkpoints" / "step-000002" / "rank0.pt").write_bytes(b"truncated")
    line = _one_line_error(_train("--resume", str(run)))
    assert "no intact checkpoint" in line
    assert "step-000003" in line and "manifest.json" in line
    assert "step-000002" in line and "rank0.pt" in line and "checksum" in line


@pytest.mark.slow
def test_a_checkpoint_of_another_format_is_refused_in_one_line(
    stopped_run: Path, tmp_path: Path
) -> None:
    run = _copy(stopped_run, tmp_path)
    for manifest in (run / "checkpoints").glob("step-*/manifest.json"):
        saved = json.loads(manifest.read_text())
        saved["format"] = 1  # as an earlier lowcomm wrote it (its optimizer states differ)
        manifest.write_text(json.dumps(saved))
    line = _one_line_error(_train("--resume", str(run)))
    assert "checkpoint format 1" in line and "another lowcomm version" in line
