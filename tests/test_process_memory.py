"""CPU worker processes (``--workers-per-process 1``) that cannot fit this machine's free host
memory are refused before any starts (:func:`lowcomm.launch.device_memory.check_worker_processes`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, PlacementConfig, TrainConfig, with_options
from lowcomm.launch.device_memory import (
    MIB,
    PROCESS_SLACK,
    amount,
    check_worker_processes,
)

PARAMETERS = 10_000_000


def _config(**overrides: Any) -> TrainConfig:
    config = TrainConfig(
        method="ddp",
        placement=PlacementConfig(workers=8),
    )
    config = with_options(config, **overrides)
    return config


def _check(config: TrainConfig, free: float | None) -> Any:
    return check_worker_processes(config, PARAMETERS, free_bytes=lambda: free)


def test_the_floor_is_the_tensors_and_a_process_each_and_a_run_over_it_is_refused() -> None:
    """Per process: float32 parameters and gradients, AdamW's 12 bytes per parameter, and a
    forked process's own pages; the activations are left out (a floor)."""
    each = (4 + 4 + 12) * PARAMETERS + PROCESS_SLACK
    config = _config()
    assert _check(config, 8 * each).total == each  # exactly fits
    with pytest.raises(ConfigError) as caught:
        _check(config, 8 * each - 1)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"--workers 8: 8 worker processes on this machine need at least {amount(8 * each)} "
        f"of host memory ({amount(each)} per process: parameters {amount(4 * PARAMETERS)}, "
    )
    assert f"the rest of a process {amount(PROCESS_SLACK)}; a micro-batch's activations " in (
        message
    )
    assert message.endswith(
        f"at most 7 workers fit: pass --workers 7, --workers-per-process 8 (every worker in one "
        f"process: the interpreter once, about {amount(8 * (each - PROCESS_SLACK + 4 * MIB))}) "
        f"or a smaller model"
    )


def test_one_process_is_offered_only_where_it_fits_and_no_worker_is_named() -> None:
    each = (4 + 4 + 12) * PARAMETERS + PROCESS_SLACK
    config = _config()
    with pytest.raises(ConfigError) as caught:  # the tensors alone are over: one process no fix
        _check(config, 2.5 * each)
    assert str(caught.value).endswith("at most 2 workers fit: pass --workers 2 or a smaller model")
    with pytest.raises(ConfigError, match=r"are free; not one worker fits: a smaller model$"):
        _check(config, 0.5 * each)
    with pytest.raises(ConfigError, match=r"at most 1 worker fits: pass --workers 1 "):
        _check(config, 1.5 * each)


def test_the_method_and_the_ranks_of_a_worker_shape_the_floor() -> None:
    # ZeRO-1 shards AdamW's state over the workers; DiLoCo keeps one extra model-sized copy.
    zero1 = _check(_config(method="zero1"), 1e15)
    assert zero1.optimizer == 12 * PARAMETERS / 8
    diloco = _check(_config(method="diloco"), 1e15)
    assert diloco.method_state > 0
    assert diloco.total > _check(_config(), 1e15).total
    # Under FSDP each of a worker's R ranks (a process each) holds 1/R of everything.
    replicated = _check(_config(workers=4, ranks_per_worker=2), 1e15)
    sharded = _check(_config(workers=4, ranks_per_worker=2, worker_sharding="fsdp"), 1e15)
    assert sharded.parameters == replicated.parameters / 2
    assert sharded.gradients == replicated.gradients / 2
    assert sharded.total - PROCESS_SLACK == (4 + 4 + 12) * PARAMETERS / 2
    # (ZeRO-1 under FSDP: its state over the workers, then over a worker's ranks.)
    zero1_sharded = _check(
        _config(method="zero1", workers=4, ranks_per_worker=2, worker_sharding="fsdp"), 1e15
    )
    assert zero1_sharded.optimizer == 12 * PARAMETERS / 4 / 2


def test_what_is_not_checked_here() -> None:
    """Workers sharing processes (their processes check, with activations measured), GPU
    runs (a GPU per process) and a machine whose free memory cannot be read."""
    assert _check(_config(workers_per_process=8), 1.0) is None
    assert _check(_config(workers_per_process=4), 1.0) is None
    assert _check(_config(device="cuda"), 1.0) is None
    assert _check(_config(), None) is None


def test_a_run_that_cannot_fit_is_refused_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the command line, with this machine's real free memory: 4 processes of a
    48-layer GPT 9216 wide (about 49 B parameters: 0.9 TiB per process at 20 bytes each) fit
    no machine that runs tests; nothing is prepared or written, and the line names the fix."""
    from lowcomm.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main([
            "train", "--workers", "4", "--model.n-layer", "48", "--model.n-embd", "9216",
            "--model.n-head", "72", "--steps", "1", "--out", str(out),
        ])  # fmt: skip
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("lowcomm: error: --workers 4: 4 worker processes on this machine ")
    assert "not one worker fits: a smaller model" in lines[0]
    assert not out.exists()
