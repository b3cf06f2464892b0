"""``lowcomm selftest`` on the CPU: the same battery users run on their GPUs, here on Gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from _cli import lowcomm, torchrun
from lowcomm.selftest import Check, RankReport, SelftestConfig, format_report, run_selftest


@pytest.mark.slow
def test_selftest_passes_on_two_gloo_processes() -> None:
    result = lowcomm("selftest", "--device", "cpu", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "backend gloo, 2 ranks" in out
    assert "all-reduce bus bandwidth" in out
    for name in (
        "collectives",
        "bookkeeping group",
        "arrival time",
        "method acco",
        "method diloco",
        "checkpoint and resume",
    ):
        assert f"PASS  {name}" in out
    assert "FAIL" not in out


@pytest.mark.slow
def test_selftest_under_torchrun_runs_as_the_torchrun_world(tmp_path: Path) -> None:
    """Under torchrun the battery runs on torchrun's ranks (not processes
    of its own), with the real-clock, bf16, fp8, Hugging Face, hierarchical and on-disk
    checkpoint checks, and rank 0 prints one report ending with the block to paste."""
    import subprocess

    result = subprocess.run(
        [*torchrun(tmp_path), "--standalone", "--nproc-per-node", "2", "-m", "lowcomm", "selftest"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "the torchrun world, 2 ranks" in out and out.count("checks passed") == 1
    for name in (
        "method co2 (real clock)",
        "method ddp (bf16 on the wire)",
        "method diloco (fp8 exchange)",
        "hierarchical group",
        "checkpoint and resume",
    ):
        assert f"PASS  {name}" in out
    assert "--- paste into a bug report ---" in out and "failed: none" in out


def test_selftest_on_cuda_without_a_gpu_fails_with_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert run_selftest(SelftestConfig(device="cuda")) == 1
    out = capsys.readouterr().out
    assert "FAIL  start-up" in out and "fix:" in out


def test_the_report_names_each_failure_its_rank_and_its_fix() -> None:
    environment = {"torch": "2.13", "backend": "nccl", "world_size": "2", "device": "cuda:0",
                   "device_name": "H100", "nccl": "2.21.5", "cuda": "12.4", "allreduce_bus_gbps": "310.00"}  # fmt: skip
    ok = Check("collectives", True, "correct")
    reports = [
        RankReport(0, environment, [ok, Check("method acco", True, "fine")]),
        RankReport(
            1,
            {**environment, "device": "cuda:1"},
            [ok, Check("method acco", False, "differs", "do X")],
        ),
    ]
    text = format_report(reports, 42.0)
    assert "NCCL 2.21.5" in text and "rank 1: cuda:1 (H100)" in text
    assert "bus bandwidth 310.00 Gbit/s" in text
    assert "PASS  collectives" in text
    assert "FAIL  method acco (rank 1): differs" in text and "fix: do X" in text
    assert "1/2 checks passed" in text
    # The block to paste into a bug report: versions, world, devices and what failed.
    block = text.split("--- paste into a bug report ---")[1]
    assert "1/2 passed" in block and "NCCL 2.21.5" in block and "2 ranks" in block
    assert "failed: method acco" in block and "H100" in block
