"""``lowcomm bench scale``: what it runs, what it measures and how it reports (no runs here: the
benchmark's numbers are its own output)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lowcomm.bench.scale import (
    ScaleBench,
    ScaleRun,
    TreeSampler,
    equal_runs,
    planned_runs,
    scale_report,
    train_command,
    tree_usage,
)


def _run(mode: str, workers: int, loss: float = 7.5, modeled: float = 1.25) -> ScaleRun:
    return ScaleRun(
        mode=mode, workers=workers, first_step_s=1.0, exit_s=2.0, setup_s=0.5, returncode=0,
        peak_rss_bytes=2**30, peak_threads=5, tokens_per_s=1000.0, final_val_loss=loss,
        modeled_time_s=modeled,
    )  # fmt: skip


def test_process_mode_stops_at_its_limit_and_the_limit_row_takes_the_largest_common_m() -> None:
    bench = ScaleBench(workers=(4, 16, 64), process_limit=16)
    assert planned_runs(bench) == [
        ("process", 4), ("inprocess", 4), ("process", 16), ("inprocess", 16),
        ("inprocess", 64), ("limit", 16),
    ]  # fmt: skip


def test_an_unknown_placement_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"--modes: 'threads' is not one of process, inprocess"):
        planned_runs(ScaleBench(modes=("process", "threads")))


def test_the_commands_differ_only_in_placement(tmp_path: Path) -> None:
    bench = ScaleBench(micro_batch_size=4)
    process = train_command(bench, "process", 16, tmp_path, tmp_path / "c.json")
    inprocess = train_command(bench, "inprocess", 16, tmp_path, tmp_path / "c.json")
    assert inprocess[: len(process)] == process
    # Every step logged: metrics.jsonl's first line, the bench's "first step", is step 1's.
    assert process[process.index("--log-every") + 1] == "1"
    assert inprocess[len(process) :] == ["--workers-per-process", "16"]
    limit = train_command(bench, "limit", 16, tmp_path, tmp_path / "c.json")
    assert limit[limit.index("--workers") + 1] == "1"
    assert limit[limit.index("--micro-batch-size") + 1] == "64"
    assert "--calibration" not in limit  # a 16x micro-batch is another shape: its own cost


def test_equality_uses_the_issue_tolerances() -> None:
    assert equal_runs(_run("process", 4), _run("inprocess", 4, loss=7.5 * (1 + 5e-7)))
    assert not equal_runs(_run("process", 4), _run("inprocess", 4, loss=7.5 * (1 + 5e-6)))
    assert not equal_runs(_run("process", 4), _run("inprocess", 4, modeled=1.25 + 1e-8))
    assert not equal_runs(_run("process", 4), _run("inprocess", 4, loss=math.nan))


def test_report_marks_equal_and_unequal_pairs_and_the_skipped_process_runs() -> None:
    bench = ScaleBench(workers=(4, 16, 256), process_limit=16)
    runs = [
        _run("process", 4), _run("inprocess", 4), _run("process", 16),
        _run("inprocess", 16, loss=7.6), _run("inprocess", 256),
    ]  # fmt: skip
    report = scale_report(bench, runs, None)
    rows = [line for line in report.splitlines() if line.startswith("| 4 ") or "| 16 |" in line]
    assert rows[1].endswith("| yes |") and rows[3].endswith("| NO |")
    assert "Process mode not run at M = 256" in report


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_the_sampler_sums_a_process_tree() -> None:
    """A child holding 200 MB raises the tree's resident bytes by about that much over the
    parent alone, and its threads are counted. A forked child shares its parent's pages: the
    summed resident sets count them twice, the summed proportional sets once."""
    own = tree_usage(os.getpid())
    assert own.rss > 0 and own.threads >= threading.active_count()
    assert 0 < own.pss <= own.rss
    code = "b = bytearray(200 * 2**20); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        with TreeSampler(os.getpid(), period_s=0.02, pss_period_s=0.1) as sampler:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (
                sampler.peak_rss_bytes < own.rss + 190 * 2**20
                or sampler.peak_pss_bytes < own.pss + 190 * 2**20
            ):
                time.sleep(0.05)
        assert sampler.peak_rss_bytes >= own.rss + 190 * 2**20
        assert sampler.peak_pss_bytes >= own.pss + 190 * 2**20  # (its own pages: not shared)
        assert sampler.peak_threads >= own.threads + 1
    finally:
        child.kill()
        child.wait()
    held = bytearray(100 * 2**20)
    held[:: 2**12] = b"\x01" * (100 * 2**8)  # every page touched: resident, then shared
    before = tree_usage(os.getpid())
    pid = os.fork()
    if pid == 0:  # the child only waits to be killed, writing nothing
        signal.pause()
        os._exit(0)
    try:  # (fork copied the page-table entries: the child's resident set holds them already)
        shared = tree_usage(os.getpid())
        assert shared.rss >= before.rss + 90 * 2**20  # the parent's pages counted again
        assert shared.pss <= before.pss + 30 * 2**20  # and not again
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        del held
