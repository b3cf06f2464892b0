"""SIGINT or SIGTERM sent to the launcher alone (as an IDE, a notebook or a process manager
sends it) stops every worker and leaves the run directory consistent.

The launcher runs in its own session, and only its pid is signalled: nothing else reaches the
workers. Real processes throughout; the workers are found by scanning /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli import TINY
from lowcomm.config import TrainConfig
from lowcomm.train.checkpoint import find_latest, fingerprint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="scans /proc"),
]

STEPS = 5000  # far more than run before the signal: the run must not end by itself
STOP_BOUND_S = 60  # generous: "a few seconds" on an idle machine, more on a loaded one


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of ``pid``, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Live descendants of ``root``: pid -> start time (which tells a reused pid apart)."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] != "Z":
                parents[int(entry.name)] = (stat[0], stat[2])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def _alive(processes: dict[int, str]) -> list[int]:
    """Those of ``processes`` still running (a zombie awaiting its reaper has stopped)."""
    alive = []
    for pid, started in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[1] != "Z":
            alive.append(pid)
    return alive


def _steps(metrics: Path) -> list[int]:
    """The steps of ``metrics``; every line must be a whole record."""
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def _line_count(metrics: Path) -> int:
    try:
        return len(metrics.read_text().splitlines())
    except OSError:
        return 0


def _interrupt(
    out: Path, log: Path, signum: int, after_steps: int, *, threads: bool = False
) -> tuple[int, str, dict[int, str]]:
    """Start a long run (``threads``: its workers in the launcher's process), signal the
    launcher once ``after_steps`` are written; return its exit code, stderr and the processes
    it had started."""
    placement = ["--workers-per-process", "2"] if threads else []
    with open(log, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "lowcomm", "train", *TINY, "--steps", str(STEPS),
             "--checkpoint-every", "4", "--out", str(out), *placement],
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
        )  # fmt: skip
    workers: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while _line_count(out / "metrics.jsonl") < after_steps:
            assert launcher.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the signal step"
            time.sleep(0.05)
        workers = _descendants(launcher.pid)
        assert threads or len(workers) >= 2, workers  # two workers (and multiprocessing's tracker)
        os.kill(launcher.pid, signum)  # the launcher alone
        code = launcher.wait(timeout=STOP_BOUND_S)
        deadline = time.monotonic() + STOP_BOUND_S
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(workers) == [], f"left behind: {_alive(workers)}"
    finally:
        if launcher.poll() is None or _alive(workers):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)  # its own session: its process group
            launcher.wait()
    return code, log.read_text(), workers


def _check_consistent(out: Path) -> int:
    """Whole metrics lines for steps 0..n-1 and an intact newest checkpoint at most at n;
    return n."""
    steps = _steps(out / "metrics.jsonl")
    assert steps == list(range(len(steps)))
    config = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    step, _ = find_latest(out, config.placement.world_size, fingerprint(config))
    assert 0 < step <= len(steps)
    return len(steps)


@pytest.mark.parametrize("threads", [False, True], ids=["processes", "in-process"])
def test_sigint_to_the_launcher_alone_stops_every_worker(tmp_path: Path, threads: bool) -> None:
    out = tmp_path / "run"
    code, stderr, _ = _interrupt(
        out, tmp_path / "stderr", signal.SIGINT, after_steps=10, threads=threads
    )
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    # One line says what happened (only a C++ library's own warning could come before it).
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("lowcomm: interrupted by SIGINT"), stderr[-3000:]
    assert f"--resume {out}" in last
    done = _check_consistent(out)
    if threads:
        return  # (resuming an in-process run is test_inprocess.py's)

    # The interrupted run continues from its newest checkpoint, step for step.
    resumed = subprocess.run(
        [sys.executable, "-m", "lowcomm", "train", "--resume", str(out),
         "--stop-after", str(done + 2)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out / "metrics.jsonl") == list(range(done + 2))


def test_sigterm_to_the_launcher_alone_stops_every_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, stderr, _ = _interrupt(out, tmp_path / "stderr", signal.SIGTERM, after_steps=6)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr and "interrupted by SIGTERM" in stderr
    _check_consistent(out)
