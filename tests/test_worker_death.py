"""A worker of the local launcher killed mid-run: the launcher's one line names the checkpoint
kept and the command that resumes from it, and the run directory gets an error.log saying what
happened. Real processes; the worker is found by scanning /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli import TINY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="scans /proc"),
]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _workers(launcher: int) -> list[int]:
    """The launcher's worker processes: children of its forkserver (or of itself when spawned),
    running the multiprocessing entry point."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        parent = _parent(pid)
        with contextlib.suppress(OSError):
            command = (entry / "cmdline").read_bytes()
            if b"resource_tracker" in command or b"multiprocessing" not in command:
                continue
            if parent == launcher and b"forkserver" in command:
                continue  # the forkserver itself
            if parent == launcher or _parent(parent or 0) == launcher:
                found.append(pid)
    return found


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def test_a_killed_worker_names_the_kept_checkpoint_and_the_resume_command(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", "train", *TINY, "--steps", "5000",
         "--checkpoint-every", "3", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while _lines(out / "metrics.jsonl") < 7:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached the kill step"
            time.sleep(0.05)
        workers = _workers(launcher.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("lowcomm: error:")]
    assert len(errors) == 1, stderr[-3000:]
    line = errors[0]
    assert "failed: killed by SIGKILL (exit code -9)" in line, line
    assert f"details in {out / 'error.log'}" in line, line
    assert f"its newest checkpoint is {out / 'checkpoints'}/step-" in line, line
    assert line.endswith(f"continue with: lowcomm train --resume {out}"), line
    log = (out / "error.log").read_text()
    assert "killed by SIGKILL" in log and "out-of-memory killer" in log, log
