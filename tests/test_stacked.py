"""M = P x K workers (K threads in each of P processes): 4 workers in 2 processes of 2 threads each give the numbers of the
same run in 4 worker processes, and a worker that fails ends every process with its error."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import PlacementConfig, TrainConfig
from lowcomm.launch import WorkerFailed, spawn_workers
from lowcomm.launch.run import run_training
from test_resume import tiny_config

STEPS = 4


def _config(method: str, out: Path, per_process: int) -> TrainConfig:
    config = tiny_config(method, out, steps=STEPS, eval_every=2)
    config.placement.workers = 4
    config.placement.workers_per_process = per_process
    config.comm.speed_factors = (
        1.0,
        1.5,
        1.0,
        2.0,
    )  # the clock must follow the worker, not the process
    return config


def _steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_steps(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for name in ("train_loss", "val_loss"):
            a, b = g[name], w[name]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-6), (name, g, w)
        assert abs(g["clock_s"] - w["clock_s"]) <= 1e-9, (g, w)
        assert g["bytes_sent_per_worker"] == w["bytes_sent_per_worker"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ddp", "diloco", "acco", "demo"])
def test_two_processes_of_two_workers_equal_four_worker_processes(
    method: str, tmp_path: Path
) -> None:
    stacked = run_training(_config(method, tmp_path / "stacked", 2), report=None)
    flat = run_training(_config(method, tmp_path / "flat", 1), report=None)
    assert stacked is not None and flat is not None
    got, want = _steps(tmp_path / "stacked"), _steps(tmp_path / "flat")
    assert [r["step"] for r in got] == list(range(STEPS))
    _same_steps(got, want)
    assert math.isclose(stacked["final_val_loss"], flat["final_val_loss"], rel_tol=1e-6)
    for key in ("bytes_sent_per_worker", "bytes_sent_per_rank", "bytes_by_role", "tokens"):
        assert stacked[key] == flat[key], key
    for key in ("modeled_time_s", "exposed_comm_s", "compute_s"):
        assert abs(stacked[key] - flat[key]) <= 1e-9, key


def _fail_on_worker_3(config: TrainConfig) -> object:
    """A process of the stacked run whose worker 3 raises at its second step (a fault
    injected in this test only)."""
    from lowcomm.launch.stacked import train_stacked
    from lowcomm.train import loop

    step_of = loop.train_step

    def failing(worker: Any, step: int, *args: Any) -> bool:
        if worker.rank == 3 and step == 1:
            raise RuntimeError("injected failure on purpose")
        return step_of(worker, step, *args)

    loop.train_step = failing  # type: ignore[assignment]
    return train_stacked(config)


def test_a_failing_worker_ends_the_run_with_its_error(tmp_path: Path) -> None:
    config = _config("ddp", tmp_path / "run", 2)
    config.comm.speed_factors = ()
    from lowcomm.launch.run import make_paths_absolute

    make_paths_absolute(config)
    config.validate()
    begin = time.perf_counter()
    with pytest.raises(WorkerFailed) as failure:
        spawn_workers(_fail_on_worker_3, 2, (config,), timeout_s=60)
    message = str(failure.value)
    assert message.startswith("worker 3 failed: RuntimeError: injected failure on purpose")
    assert "\n" not in message
    assert time.perf_counter() - begin < 50  # no hang on the failed peer
    log = (tmp_path / "run" / "error.log").read_text()
    assert "traceback of worker 3" in log and "injected failure" in log


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_of_two_resumes_in_one_process(tmp_path: Path) -> None:
    """Checkpoints are per worker in every placement: a run stopped in 2 processes x 2
    continues with its 4 workers in one process exactly as the straight run."""
    straight = tmp_path / "straight"
    run_training(_config("diloco", straight, 4), report=None)
    stopped = _config("diloco", tmp_path / "stopped", 2)
    stopped.run.checkpoint_every = stopped.run.stop_after = 2
    run_training(stopped, report=None)
    resumed = _config("diloco", tmp_path / "stopped", 4)
    resumed.run.resume, resumed.run.out = str(tmp_path / "stopped"), None
    run_training(resumed, report=None)
    _same_steps(_steps(tmp_path / "stopped"), _steps(straight))


def test_torchrun_processes_of_several_workers_count_every_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun each process runs --workers-per-process workers: the run has K x the
    processes, and a process's pre-flight checks its own workers' checkpoint files."""
    from lowcomm.launch.run import adopt_torchrun_world
    from lowcomm.train.checkpoint import preflight_ranks

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    config = TrainConfig(placement=PlacementConfig(workers_per_process=2))
    adopt_torchrun_world(config)
    config.validate()
    assert config.placement.workers == 6
    assert preflight_ranks(2) == (2, 3)
