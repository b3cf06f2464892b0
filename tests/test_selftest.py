"""``lowcomm selftest`` on the CPU: the same battery users run on their GPUs, here on Gloo."""

from __future__ import annotations

import pytest

from _cli import lowcomm
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
