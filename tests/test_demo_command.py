"""`lowcomm demo`: DDP and DiLoCo over the wan link on equal tokens, ending with a three-line
verdict whose numbers are the runs' own (summary.json)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from _cli import lowcomm
from lowcomm.config import RunConfig, TrainConfig
from lowcomm.data import DataConfig
from lowcomm.demo import DemoConfig, demo_train_config, run_demo
from lowcomm.models import ModelConfig

#: A model and data small enough for the test (the demo itself trains the default model).
TINY = TrainConfig(
    model=ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=16),
    data=DataConfig(micro_batch_size=2),
    run=RunConfig(eval_every=2, eval_batches=2, progress=False, plot=False),
)

_METHOD_LINE = re.compile(
    r"^(\w+) +modeled time ([\d.]+) s, sent [\d.]+ [KMGT]?B per worker \(([\d,]+) B\), "
    r"final val loss ([\d.]+)  \((.+)\)$"
)
_RATIO_LINE = re.compile(
    r"^diloco vs ddp: modeled time ([\d.e+-]+)x, bytes ([\d.e+-]+)x, loss ([+-][\d.]+)$"
)


def test_the_verdict_is_the_runs_own_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    out = tmp_path / "demo"
    demo = DemoConfig(out=str(out), steps=4, workers=2, sync_every=2)
    lines = run_demo(demo, TINY)
    # (the demo's heap setting is its own: the environment is left as it was)
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    assert printed[-3:] == lines and len(lines) == 3
    assert printed[-4].startswith("verdict: ddp vs diloco on wan, 2 workers, 256 tokens each")
    assert (out / "verdict.txt").read_text().splitlines() == printed[-4:]

    summaries = {}
    for line, method in zip(lines[:2], ("ddp", "diloco"), strict=True):
        match = _METHOD_LINE.match(line)
        assert match is not None, line
        name, seconds, sent, loss, run = match.groups()
        assert name == method and Path(run) == out / "runs" / f"{method}-s0"
        summary = json.loads((Path(run) / "summary.json").read_text())
        summaries[method] = summary
        assert summary["method"] == method and summary["network"]["name"] == "wan"
        assert int(sent.replace(",", "")) == summary["bytes_sent_per_worker"]
        assert float(seconds) == pytest.approx(summary["modeled_time_s"], abs=0.005)
        assert float(loss) == pytest.approx(summary["final_val_loss"], abs=5e-5)
    ddp, diloco = summaries["ddp"], summaries["diloco"]
    # Equal tokens, and DiLoCo syncs every 2nd of its 4 steps: fewer bytes than DDP's every step.
    assert ddp["committed_tokens"] == diloco["committed_tokens"] == 4 * 2 * 2 * 16
    assert 0 < diloco["bytes_sent_per_worker"] < ddp["bytes_sent_per_worker"]
    ratio = _RATIO_LINE.match(lines[2])
    assert ratio is not None, lines[2]
    time_x, bytes_x, loss_diff = (float(value) for value in ratio.groups())
    assert time_x == pytest.approx(diloco["modeled_time_s"] / ddp["modeled_time_s"], rel=5e-3)
    assert bytes_x == pytest.approx(
        diloco["bytes_sent_per_worker"] / ddp["bytes_sent_per_worker"], rel=5e-3
    )
    assert loss_diff == pytest.approx(diloco["final_val_loss"] - ddp["final_val_loss"], abs=5e-5)

    # A second demo into the same directory reuses the finished runs: the same verdict.
    assert run_demo(demo, TINY) == lines


def test_both_runs_share_the_link_the_clock_the_tokens_and_one_process() -> None:
    train = demo_train_config(DemoConfig(steps=7, workers=3, sync_every=5), TINY)
    assert (train.comm.network, train.comm.clock, train.run.steps, train.placement.workers) == (
        "wan",
        "virtual",
        7,
        3,
    )
    assert train.placement.workers_per_process == 3 and train.diloco.sync_every == 5
    assert train.model == TINY.model
    default = demo_train_config(DemoConfig())
    assert default.model == TrainConfig().model and default.placement.workers_per_process == 4


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--steps", "0", "--steps: 0 is below 1; pass 1 or more"),
        ("--workers", "1", "--workers: 1 is below 2; pass 2 or more"),
        ("--sync-every", "0", "--sync-every: 0 is below 1; pass 1 or more"),
    ],
)
def test_a_bad_option_is_refused_in_one_line(flag: str, value: str, message: str) -> None:
    done = lowcomm("demo", flag, value)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"lowcomm: error: {message}"]


def test_the_demo_is_a_command() -> None:
    done = lowcomm()
    assert "demo" in done.stdout.splitlines()[0]
    assert lowcomm("demo", "--help").returncode == 0
